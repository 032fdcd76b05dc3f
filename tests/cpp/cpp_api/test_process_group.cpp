// The C++ interface in one process: argument errors before any collective,
// and a whole world-size-1 group (the backend, its process group, the
// message queue) against the plain result. Groups of several processes are
// the example's (tests/python/integration/test_cpp_package.py).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "tpcomm/tpcomm.hpp"

namespace {

c10::intrusive_ptr<c10d::Store> store() { return c10::make_intrusive<c10d::HashStore>(); }

std::string messageOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

TEST(CppInterface, BadArgumentsAreNamedBeforeAnyCollective) {
  EXPECT_NE(messageOf([] { tpcomm::makeBackend(store(), 2, 2); }).find("rank 2 is out of range"),
            std::string::npos);
  EXPECT_NE(messageOf([] { tpcomm::makeBackend(nullptr, 0, 1); }).find("store is null"),
            std::string::npos);
  tpcomm::Options zero;
  zero.timeout = std::chrono::milliseconds(0);
  EXPECT_NE(messageOf([&] { tpcomm::makeBackend(store(), 0, 1, zero); }).find("timeout"),
            std::string::npos);
  tpcomm::Options ranks;
  ranks.globalRanks = {0, 1};
  EXPECT_NE(messageOf([&] { tpcomm::makeBackend(store(), 0, 1, ranks); }).find("globalRanks"),
            std::string::npos);
}

TEST(CppInterface, WorldSizeOneGroupComputesAndCounts) {
  auto pg = tpcomm::makeProcessGroup(store(), 0, 1);
  // A custom backend's process group answers "custom" (as in Python).
  EXPECT_EQ(pg->getDefaultBackend()->getBackendName(), "tpcomm");
  EXPECT_TRUE(tpcomm::isTpcomm(pg->getBackend(c10::DeviceType::CPU)));
  std::vector<at::Tensor> x{at::arange(10, at::kDouble)};
  const at::Tensor expected = x[0].clone();
  pg->allreduce(x)->wait();
  EXPECT_TRUE(at::equal(x[0], expected));
  tpcomm::allReduce(pg, x[0], c10d::ReduceOp::MAX);
  EXPECT_TRUE(at::equal(x[0], expected));
  uint64_t calls = 0;
  for (const auto& row : tpcomm::stats(pg)) calls += row.calls;
  EXPECT_GE(calls, 2u);
  EXPECT_EQ(tpcomm::fault(pg), "");

  auto queue = tpcomm::MessageQueue::create(pg);
  EXPECT_TRUE(queue->isWriter());
  EXPECT_EQ(queue->broadcastBytes("hello"), "hello");
  const tpcomm::TensorDict dict{{"a", at::ones({3})}};
  EXPECT_TRUE(at::equal(queue->broadcastTensorDict(dict).at("a"), dict.at("a")));
  queue->shutdown();
  EXPECT_NE(messageOf([&] { queue->broadcastBytes("late"); }).find("shut down"),
            std::string::npos);

  pg->getBackend(c10::DeviceType::CPU)->abort();
  EXPECT_NE(tpcomm::fault(pg), "");
  EXPECT_THROW(pg->allreduce(x)->wait(), c10::DistBackendError);
}

// Groups of different names on one store keep apart; a group remade under
// a name starts afresh.
TEST(CppInterface, GroupsOnOneStoreAreScopedByName) {
  auto shared = store();
  for (const char* name : {"a", "b", "a"}) {
    tpcomm::Options options;
    options.groupName = name;
    auto pg = tpcomm::makeProcessGroup(shared, 0, 1, options);
    std::vector<at::Tensor> x{at::ones({2})};
    pg->allreduce(x)->wait();
    EXPECT_TRUE(at::equal(x[0], at::ones({2}))) << name;
    EXPECT_EQ(pg->getGroupName(), name);
  }
}

TEST(CppInterface, QueueOptionsAreCheckedOnEveryRank) {
  auto pg = tpcomm::makeProcessGroup(store(), 0, 1);
  tpcomm::MessageQueueOptions options;
  options.writerRank = 1;
  EXPECT_NE(messageOf([&] { tpcomm::MessageQueue::create(pg, options); })
                .find("writerRank 1 is out of range"),
            std::string::npos);
  options = {};
  options.maxChunkBytes = 32;
  EXPECT_NE(messageOf([&] { tpcomm::MessageQueue::create(pg, options); }).find("[64, 2^32 - 64]"),
            std::string::npos);
  options = {};
  options.maxChunks = 0;
  EXPECT_NE(messageOf([&] { tpcomm::MessageQueue::create(pg, options); }).find("maxChunks"),
            std::string::npos);
}

TEST(CppInterface, StatsRefuseAnotherBackend) {
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store(), 0, 1);
  EXPECT_NE(messageOf([&] { tpcomm::stats(pg); }).find("no backend for CPU"), std::string::npos);
  EXPECT_FALSE(tpcomm::version().empty());
  EXPECT_EQ(tpcomm::builtWithTorch().rfind("2.", 0), 0u);
}

}  // namespace

#if defined(C10D_BACKEND_HAS_WINDOW)
// torch 2.15's one-sided window through the installed header: the group's
// new_window, a put into its own window (the one rank), a signal it waits
// for, and the view of the window, against the values put.
TEST(CppInterface, AWindowOfAWorldSizeOneGroupPutsSignalsAndMaps) {
  auto pg = tpcomm::makeProcessGroup(store(), 0, 1);
  ASSERT_TRUE(pg->supportsWindow());
  at::Tensor mine = at::zeros({8}, at::kFloat);
  auto window = pg->new_window(mine);
  window->put(at::full({3}, 5.0f), 0, 2, false)->wait();
  window->signal(0, false)->wait();
  window->wait_signal(0, false)->wait();
  const at::Tensor expected = at::tensor({0.f, 0.f, 5.f, 5.f, 5.f, 0.f, 0.f, 0.f});
  EXPECT_TRUE(at::equal(mine, expected));
  EXPECT_TRUE(at::equal(window->map_remote_tensor(0), expected));
  EXPECT_NE(messageOf([&] { window->put(at::ones({1}, at::kDouble), 0, 0, false); })
                .find("a Double tensor into rank 0's Float window"),
            std::string::npos);
}
#endif
