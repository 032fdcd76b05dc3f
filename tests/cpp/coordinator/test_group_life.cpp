// A group's life (coordinator/group_life.hpp): the ranks of one making of a
// group agree on one id, every making gets another, and an id a dead rank 0
// left behind is dropped; a making ends together, and a rank whose part
// failed is named by every other. Ranks are threads over one in-memory store.
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <atomic>
#include <chrono>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "coordinator/group_life.hpp"

namespace tpcomm {
namespace {

using namespace std::chrono_literals;

// Every rank's id for one making of a group of `size` on `store`.
std::vector<std::string> agree(const c10::intrusive_ptr<c10d::Store>& store, int size) {
  std::vector<std::string> ids(size);
  std::vector<std::thread> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.emplace_back([&, r] { ids[r] = coord::agreeOnLife(store, r, size, 20s); });
  }
  for (auto& t : ranks) t.join();
  return ids;
}

TEST(GroupLife, EveryRankOfAMakingAgreesAndEveryMakingDiffers) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::set<std::string> seen;
  for (int size : {1, 2, 3, 5, 8}) {
    for (int making = 0; making < 40; ++making) {
      const auto ids = agree(store, size);
      for (const auto& id : ids) ASSERT_EQ(id, ids[0]) << "size " << size;
      ASSERT_EQ(ids[0].size(), 16u);
      ASSERT_TRUE(seen.insert(ids[0]).second) << "an id came twice: " << ids[0];
    }
  }
  // A finished making leaves its id spent, for no next one to take.
  const auto left = store->get("tpcomm/life");
  EXPECT_EQ(std::string(left.begin(), left.end()).rfind("spent:", 0), 0u);
}

TEST(GroupLife, AnIdADeadRankZeroLeftBehindIsDropped) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::string stale = "00000000deadbeef";
  store->set("tpcomm/life", std::vector<uint8_t>(stale.begin(), stale.end()));
  // The followers may read the stale id before rank 0 replaces it.
  std::vector<std::string> ids(3);
  std::vector<std::thread> ranks;
  for (int r = 1; r < 3; ++r) {
    ranks.emplace_back([&, r] { ids[r] = coord::agreeOnLife(store, r, 3, 20s); });
  }
  std::this_thread::sleep_for(50ms);
  ids[0] = coord::agreeOnLife(store, 0, 3, 20s);
  for (auto& t : ranks) t.join();
  EXPECT_NE(ids[0], stale);
  EXPECT_EQ(ids[1], ids[0]);
  EXPECT_EQ(ids[2], ids[0]);
}

TEST(GroupLife, ARankZeroThatNeverComesIsATimeoutNamingIt) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  try {
    coord::agreeOnLife(store, 1, 2, 200ms);
    FAIL() << "no timeout";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 waited 200 ms for rank 0 to make the group"),
              std::string::npos)
        << e.what();
  }
}

using Clock = std::chrono::steady_clock;

TEST(GroupLife, AMakingEndsWhenTheLastRankMadeItsPart) {
  auto store = coord::storeOfLife(c10::make_intrusive<c10d::HashStore>(), "0123456789abcdef");
  constexpr int kSize = 3;
  std::vector<Clock::time_point> returned(kSize);
  Clock::time_point lastCame;
  std::vector<std::thread> ranks;
  for (int r = 0; r < kSize; ++r) {
    ranks.emplace_back([&, r] {
      if (r == kSize - 1) {
        std::this_thread::sleep_for(300ms);
        lastCame = Clock::now();
      }
      coord::finishMaking(store, r, kSize, 20s);
      returned[r] = Clock::now();
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kSize; ++r) {
    EXPECT_GE(returned[r], lastCame) << "rank " << r << " returned before the last rank came";
  }
  // Alone, a rank never waits.
  coord::finishMaking(c10::make_intrusive<c10d::HashStore>(), 0, 1, 1ms);
}

TEST(GroupLife, APartThatFailedIsRaisedAtOnceByEveryOtherRank) {
  auto store = coord::storeOfLife(c10::make_intrusive<c10d::HashStore>(), "0123456789abcdef");
  constexpr int kSize = 4;
  std::vector<std::string> errors(kSize);
  std::vector<ErrorCode> codes(kSize, ErrorCode::kInvalidUsage);
  std::atomic<int> threw{0};
  const auto start = Clock::now();
  std::vector<std::thread> ranks;
  for (int r = 0; r < kSize; ++r) {
    ranks.emplace_back([&, r] {
      try {
        auto made = coord::makeTogether(store, r, kSize, 20s, [&] {
          if (r == 1) throw std::runtime_error("connect failed\nException raised from frame #0");
          if (r == 3) std::this_thread::sleep_for(100ms);  // comes after the failure
          return r * 10;
        });
        errors[r] = "made " + std::to_string(made);
      } catch (const Error& e) {
        errors[r] = e.what();
        codes[r] = e.code();
        ++threw;
      } catch (const std::runtime_error& e) {
        errors[r] = std::string("own: ") + e.what();
        ++threw;
      }
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_LT(Clock::now() - start, 5s) << "the ranks waited out the timeout";
  EXPECT_EQ(threw.load(), kSize);
  EXPECT_EQ(errors[1].rfind("own: connect failed", 0), 0u) << errors[1];
  for (int r : {0, 2, 3}) {
    EXPECT_EQ(codes[r], ErrorCode::kPeerLost) << errors[r];
    EXPECT_NE(errors[r].find("rank " + std::to_string(r) +
                             " made its part of the group, but not every rank did: "
                             "rank 1: connect failed"),
              std::string::npos)
        << errors[r];
    EXPECT_EQ(errors[r].find("frame #0"), std::string::npos) << "only the first line: " << errors[r];
  }
}

TEST(GroupLife, EveryFailedPartIsNamedAndAFailedRankWaitsForEveryRankToEnd) {
  auto store = coord::storeOfLife(c10::make_intrusive<c10d::HashStore>(), "0123456789abcdef");
  std::string error;
  Clock::time_point lastCame, failedReturned[2];
  std::vector<std::thread> ranks;
  ranks.emplace_back([&] {
    coord::finishMaking(store, 0, 3, 20s, std::string("no listener"));
    failedReturned[0] = Clock::now();
  });
  ranks.emplace_back([&] {
    coord::finishMaking(store, 2, 3, 20s, std::string());
    failedReturned[1] = Clock::now();
  });
  ranks.emplace_back([&] {
    std::this_thread::sleep_for(300ms);  // still in Gloo's rendezvous
    lastCame = Clock::now();
    try {
      coord::finishMaking(store, 1, 3, 20s);
    } catch (const Error& e) {
      error = e.what();
    }
  });
  for (auto& t : ranks) t.join();
  // The failed ranks kept their part until the last rank ended its making.
  EXPECT_GE(failedReturned[0], lastCame);
  EXPECT_GE(failedReturned[1], lastCame);
  const bool both = error.find("rank 0: no listener; rank 2: (an error without a message)") !=
                        std::string::npos ||
                    error.find("rank 2: (an error without a message); rank 0: no listener") !=
                        std::string::npos;
  EXPECT_TRUE(both) << error;
}

TEST(GroupLife, ARankThatNeverFinishesIsATimeoutThatALaterRankRaisesToo) {
  auto store = coord::storeOfLife(c10::make_intrusive<c10d::HashStore>(), "0123456789abcdef");
  std::vector<std::string> errors(2);
  std::vector<ErrorCode> codes(2, ErrorCode::kInvalidUsage);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        coord::finishMaking(store, r, 3, 300ms);
      } catch (const Error& e) {
        errors[r] = e.what();
        codes[r] = e.code();
      }
    });
  }
  for (auto& t : ranks) t.join();
  // The first whose wait ran out raises a timeout; the other raises it too,
  // at once or at its own timeout. How many made their part depends on when
  // the threads started: only the wording is checked.
  int timeouts = 0;
  for (int r = 0; r < 2; ++r) {
    if (codes[r] == ErrorCode::kTimeout) {
      ++timeouts;
      EXPECT_NE(errors[r].find("rank " + std::to_string(r) +
                               " waited 300 ms for every rank to make its part of the group ("),
                std::string::npos)
          << errors[r];
      EXPECT_NE(errors[r].find(" of 3 did"), std::string::npos) << errors[r];
    } else {
      EXPECT_EQ(codes[r], ErrorCode::kPeerLost) << errors[r];
      EXPECT_NE(errors[r].find("gave up after 300 ms"), std::string::npos) << errors[r];
    }
  }
  EXPECT_GE(timeouts, 1);
  // The rank that comes late does not return a group the others left.
  try {
    coord::finishMaking(store, 2, 3, 20s);
    FAIL() << "a late rank made a group the others gave up on";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kPeerLost) << e.what();
    EXPECT_NE(std::string(e.what()).find("gave up after 300 ms"), std::string::npos) << e.what();
  }
}

TEST(GroupLife, AWaitThatRunsOutAsTheLastRankCameEndsAsMade) {
  // The last rank added its 1 but had not yet said so ("tpcomm/made-all")
  // when this rank's wait ran out: the count decides, and the group is made
  // on both, never made on one and refused on the other.
  auto store = coord::storeOfLife(c10::make_intrusive<c10d::HashStore>(), "0123456789abcdef");
  std::string error = "not returned";
  std::thread rank0([&] {
    try {
      coord::finishMaking(store, 0, 2, 1s);
      error.clear();
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(50ms);
  store->add("tpcomm/made-or-failed", 1);
  store->add("tpcomm/made", 1);  // rank 1, descheduled before it set the end
  rank0.join();
  EXPECT_EQ(error, "");
  EXPECT_FALSE(store->check({"tpcomm/not-made"}));
  EXPECT_FALSE(store->check({"tpcomm/made-all"})) << "rank 0 was not the one to end it";
}

// Every key of a group made, used and shut down on every rank is gone from
// its store, the group's "tpcomm/life" and its fault lines included; a
// group a rank never left keeps its keys. Other keys are untouched.
TEST(GroupLife, AWholeLifeLeavesNoKeyOfItsOwnBehind) {
  const std::vector<uint8_t> kOne{1};
  auto base = c10::make_intrusive<c10d::HashStore>();
  base->set("other", kOne);
  constexpr int kSize = 3;
  auto keys = [&] {
    auto list = base->listKeys();
    return std::set<std::string>(list.begin(), list.end());
  };
  auto live = [&](bool fault, int leaving) {
    const std::string life = agree(base, kSize)[0];
    auto store = coord::storeOfLife(base, life);
    std::vector<std::thread> ranks;
    for (int r = 0; r < kSize; ++r) {
      ranks.emplace_back([&, r] { coord::finishMaking(store, r, kSize, 20s); });
    }
    for (auto& t : ranks) t.join();
    // What the group's Gloo, its device backend and its calls write.
    store->set("cpu/0", kOne);
    store->set("device/ncclUniqueId", kOne);
    store->set("tpcomm-hier/g/cpu/1", kOne);
    if (fault) store->append("tpcomm/faults", kOne);
    int removed = 0;
    for (int r = 0; r < leaving; ++r) removed += coord::endLife(store, kSize, {r}) ? 1 : 0;
    EXPECT_EQ(removed, leaving == kSize ? 1 : 0);
    return life;
  };
  live(false, kSize);
  EXPECT_EQ(keys(), std::set<std::string>({"other"}));
  live(true, kSize);
  EXPECT_EQ(keys(), std::set<std::string>({"other"})) << "a broken group's fault lines stay";
  const std::string lost = live(false, kSize - 1);
  const auto kept = keys();
  EXPECT_TRUE(kept.count("tpcomm-life-" + lost + "/cpu/0")) << "a group a rank never left";
  // A shrink leaves for the lost rank (GroupCoordinator::shrink), which
  // may have left already: each rank counts once, and the two that stay
  // end the life; a rank that leaves after that adds nothing.
  {
    auto store = coord::storeOfLife(base, "0000000000000777");
    store->set("tpcomm/life-ok", kOne);
    store->set("cpu/0", kOne);
    EXPECT_FALSE(coord::endLife(store, kSize, {2})) << "the lost rank, itself";
    EXPECT_FALSE(coord::endLife(store, kSize, {2})) << "the shrink, for the same rank";
    EXPECT_FALSE(coord::endLife(store, kSize, {0})) << "rank 0, again after its abort";
    EXPECT_FALSE(coord::endLife(store, kSize, {0}));
    EXPECT_TRUE(coord::endLife(store, kSize, {1})) << "the last survivor out";
    EXPECT_EQ(keys(), kept);
    EXPECT_FALSE(coord::endLife(store, kSize, {2})) << "after the end";
    EXPECT_EQ(keys(), kept) << "nothing written after the end";
  }
  // 1,000 lives, each on every rank: nothing grows.
  for (int i = 0; i < 1000; ++i) {
    auto store = coord::storeOfLife(base, "00000000000" + std::to_string(10000 + i));
    store->set("tpcomm/life-ok", kOne);
    store->set("cpu/0", kOne);
    for (int r = 0; r < kSize; ++r) coord::endLife(store, kSize, {r});
  }
  EXPECT_EQ(keys(), kept);
  // A group of one ends alone.
  auto alone = coord::storeOfLife(base, agree(base, 1)[0]);
  alone->set("cpu/0", kOne);
  EXPECT_TRUE(coord::endLife(alone, 1, {0}));
  EXPECT_EQ(keys(), kept);
}

TEST(GroupLife, AKeyIsReadWithoutWaitingForIt) {
  auto store = coord::storeOfLife(c10::make_intrusive<c10d::HashStore>(), "0123456789abcdef");
  store->setTimeout(30s);
  const auto start = Clock::now();
  EXPECT_FALSE(coord::readWithoutWaiting(store, "tpcomm/faults").has_value());
  EXPECT_LT(Clock::now() - start, 1s);
  EXPECT_FALSE(store->check({"tpcomm/faults"})) << "the read wrote the key";
  store->append("tpcomm/faults", std::vector<uint8_t>{'B', ' ', '1'});
  const auto read = coord::readWithoutWaiting(store, "tpcomm/faults");
  ASSERT_TRUE(read.has_value());
  EXPECT_EQ(std::string(read->begin(), read->end()), "B 1");
}

}  // namespace
}  // namespace tpcomm
