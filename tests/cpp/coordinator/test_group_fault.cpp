// GroupFault (coordinator/faults/group_fault.hpp): two ranks of one group in one
// process, sharing a HashStore, with the process's real watchdog.
#include <atomic>
#include <stdexcept>
#include <chrono>
#include <thread>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "common/error.hpp"
#include "coordinator/faults/group_fault.hpp"

namespace tpcomm::coord {
namespace {

using namespace std::chrono_literals;

struct TwoRanks {
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  std::shared_ptr<GroupFault> r0 = GroupFault::create(store, "g", 0, 2, 2000ms);
  std::shared_ptr<GroupFault> r1 = GroupFault::create(store, "g", 1, 2, 2000ms);
};

// Polls `done` for up to `within`.
template <typename F>
bool eventually(F done, std::chrono::milliseconds within = 5000ms) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return done();
}

struct Flag : Interruptible {
  std::atomic<int> calls{0};
  std::string why;
  void interrupt(const std::string& w) override {
    why = w;
    ++calls;
  }
};

TEST(GroupFault, ARefusalBreaksThePeerThatMadeTheCall) {
  TwoRanks g;
  auto waiter = std::make_shared<Flag>();
  const uint64_t ticket = g.r1->enter(1, "allreduce", false, waiter);
  g.r0->refused(1, "allreduce", "bad op");
  // Rank 1's call waits longer than the watchdog's interval: it reads the
  // refusal, breaks the group and releases the call.
  ASSERT_TRUE(eventually([&] { return g.r1->broken(); }));
  EXPECT_EQ(g.r1->reason(), "rank 0 refused allreduce #1 (bad op) while rank 1 made that call");
  ASSERT_TRUE(eventually([&] { return waiter->calls.load() == 1; }));
  EXPECT_EQ(waiter->why, g.r1->reason());
  g.r1->leave(ticket);
  // Rank 0's next call learns that the group broke, and raises naming it.
  try {
    g.r0->checkBeforeCall("allreduce");
    FAIL() << "the refusing rank went on";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kPeerLost);
    EXPECT_NE(std::string(e.what()).find("the group is unusable: rank 0 refused allreduce #1"),
              std::string::npos)
        << e.what();
  }
}

TEST(GroupFault, ARefusalOnEveryRankBreaksNothing) {
  TwoRanks g;
  g.r0->refused(1, "scatter", "list length");
  g.r1->refused(1, "scatter", "list length");
  EXPECT_FALSE(g.r0->usable());  // each waits for the other's word once
  g.r0->checkBeforeCall("allreduce");
  g.r1->checkBeforeCall("allreduce");
  EXPECT_TRUE(g.r0->usable());
  EXPECT_TRUE(g.r1->usable());
  // The peers' later calls, stuck for a while, find nothing to break on.
  const uint64_t ticket = g.r1->enter(2, "allreduce", false);
  std::this_thread::sleep_for(watchdogInterval() * 2);
  EXPECT_FALSE(g.r1->broken()) << g.r1->reason();
  g.r1->leave(ticket);
}

TEST(GroupFault, ARefusalNobodyAnswersEndsAtTheTimeout) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto r0 = GroupFault::create(store, "g", 0, 2, 300ms);
  r0->refused(1, "gather", "list on a non-root");
  const auto start = std::chrono::steady_clock::now();
  try {
    r0->checkBeforeCall("allreduce");
    FAIL() << "the settle wait returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_NE(std::string(e.what()).find("ranks 1 neither refused it nor reported being in it"),
              std::string::npos)
        << e.what();
  }
  EXPECT_GE(std::chrono::steady_clock::now() - start, 300ms);
  EXPECT_TRUE(r0->broken());
}

TEST(GroupFault, ABreakIsPublishedThenReleasedOnEveryRank) {
  TwoRanks g;
  std::atomic<int> released0{0};
  std::string why0;
  g.r0->setReleaser([&](const std::string& why) {
    // Published first: the store already holds the line.
    EXPECT_TRUE(g.store->check({"tpcomm/faults"}));
    why0 = why;
    ++released0;
  });
  auto waiter = std::make_shared<Flag>();
  const uint64_t ticket = g.r1->enter(3, "broadcast", false, waiter);
  g.r0->breakGroup("rank 0 aborted the group");
  EXPECT_TRUE(g.r0->broken());
  ASSERT_TRUE(eventually([&] { return released0.load() == 1; }));
  EXPECT_EQ(why0, "rank 0 aborted the group");
  ASSERT_TRUE(eventually([&] { return waiter->calls.load() == 1; }));
  EXPECT_EQ(g.r1->reason(), "rank 0 aborted the group");
  g.r1->leave(ticket);
  // The first reason stays.
  g.r0->breakGroup("something later");
  EXPECT_EQ(g.r0->reason(), "rank 0 aborted the group");
  EXPECT_EQ(released0.load(), 1);
  g.r0->setReleaser({});
}

TEST(GroupFault, PositionsNameWhereAStuckPeerWaits) {
  TwoRanks g;
  const uint64_t ticket = g.r1->enter(7, "all_to_all", false);
  ASSERT_TRUE(eventually([&] { return g.store->check({"tpcomm/pos/1"}); }));
  const std::string text = g.r0->positions("allreduce", 8);
  EXPECT_NE(text.find("this rank (0) in allreduce #8"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 1: in all_to_all #7 for "), std::string::npos) << text;
  g.r1->leave(ticket);
  // Once it left, it says where it went.
  ASSERT_TRUE(eventually([&] {
    return g.r0->positions().find("rank 1: after all_to_all #7") != std::string::npos;
  }));
}

// A custom-kernel call: the host call returned at once, the kernel waits on
// the GPU. The device probe stands for the GPU; once it has said "pending"
// for longer than the watchdog's interval, rank 0's refusal of that call
// breaks rank 1's group and its releaser runs (which aborts the kernel).
// Work that is pending with no fault published breaks nothing.
TEST(GroupFault, DeviceWorkThatWaitsIsWatchedLikeACallInFlight) {
  TwoRanks g;
  std::atomic<bool> pending{true};
  std::atomic<int> released{0};
  g.r1->setDeviceProbe([&] { return pending.load(); });
  g.r1->setReleaser([&](const std::string&) { ++released; });
  g.r1->leave(g.r1->enter(1, "allreduce", false));  // launched; returned at once
  std::this_thread::sleep_for(watchdogInterval() * 3);
  EXPECT_FALSE(g.r1->broken()) << g.r1->reason();
  g.r0->refused(1, "allreduce", "bad op");
  ASSERT_TRUE(eventually([&] { return g.r1->broken(); }));
  EXPECT_EQ(g.r1->reason(), "rank 0 refused allreduce #1 (bad op) while rank 1 made that call");
  ASSERT_TRUE(eventually([&] { return released.load() == 1; }));
  g.r1->setReleaser({});
  g.r1->setDeviceProbe({});
}

TEST(GroupFault, DeviceWorkThatEndedIsNotWatched) {
  TwoRanks g;
  g.r1->setDeviceProbe([] { return false; });
  g.r1->leave(g.r1->enter(1, "allreduce", false));
  g.r0->refused(1, "allreduce", "bad op");
  std::this_thread::sleep_for(watchdogInterval() * 4);
  // Nothing of rank 1's waits: it learns at its next call (settle, store).
  EXPECT_FALSE(g.r1->broken()) << g.r1->reason();
  g.r1->setDeviceProbe({});
}

// A store whose host went away: every request fails, as TCPStore's do once
// the rank that serves it exited.
struct LostStore : c10d::HashStore {
  std::atomic<bool> lost{false};
  std::atomic<int> requests{0};
  void fail() {
    if (!lost) return;
    ++requests;
    throw std::runtime_error("Connection reset by peer\nand a long trace");
  }
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    fail();
    HashStore::set(key, value);
  }
  std::vector<uint8_t> get(const std::string& key) override {
    fail();
    return HashStore::get(key);
  }
  bool check(const std::vector<std::string>& keys) override {
    fail();
    return HashStore::check(keys);
  }
};

TEST(GroupFault, AStoreThatStopsAnsweringBreaksAStuckCallOnce) {
  auto store = c10::make_intrusive<LostStore>();
  auto r1 = GroupFault::create(store, "g", 1, 2, 2000ms);
  auto waiter = std::make_shared<Flag>();
  store->lost = true;
  const uint64_t ticket = r1->enter(1, "allreduce", false, waiter);
  ASSERT_TRUE(eventually([&] { return r1->broken(); }));
  EXPECT_EQ(r1->reason(),
            "the group's store stopped answering (Connection reset by peer) while rank 1 was in "
            "allreduce #1: the rank that hosts it may be gone");
  ASSERT_TRUE(eventually([&] { return waiter->calls.load() == 1; }));
  r1->leave(ticket);
  // Asked once, not at every visit of the watchdog.
  const int asked = store->requests.load();
  std::this_thread::sleep_for(watchdogInterval() * 3);
  EXPECT_EQ(store->requests.load(), asked);
  EXPECT_LE(asked, 2);
}

TEST(GroupFault, WithoutAStoreOrPeersNothingIsPublished) {
  auto alone = GroupFault::create({}, "g", 0, 1, 1000ms);
  alone->refused(1, "allreduce", "bad");
  EXPECT_TRUE(alone->usable());
  alone->breakGroup("rank 0 aborted the group");
  EXPECT_TRUE(alone->broken());
  EXPECT_EQ(alone->positions(), "");
}

}  // namespace
}  // namespace tpcomm::coord
