// The hooks a caller registers on a group (backend/hooks.hpp): abort hooks
// in id order before a failure is raised and in abort(), a hook's error never
// the call's; completion hooks once per Work that succeeded, with its key.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/exception.h>

#include "backend/hooks.hpp"
#include "backend/process_group_tpcomm.hpp"
#include "common/error.hpp"
#include "group_fixture.hpp"
#include "torch_compat.hpp"

namespace tpcomm::testing {
namespace {

using backend::BackendHooks;
using backend::ProcessGroupTpcomm;

TEST(BackendHooks, AbortHooksRunInIdOrderAndAHooksErrorIsNotTheCallers) {
  BackendHooks hooks;
  std::vector<int> ran;
  hooks.registerAbort(30, [&] { ran.push_back(30); });
  hooks.registerAbort(10, [&] { ran.push_back(10); });
  hooks.registerAbort(20, [&] {
    ran.push_back(20);
    throw std::runtime_error("the hook's own failure");
  });
  hooks.runAbort();
  EXPECT_EQ(ran, (std::vector<int>{10, 20, 30}));
  // Registering a taken id replaces its hook; a hook may unregister hooks.
  ran.clear();
  hooks.registerAbort(10, [&] {
    ran.push_back(11);
    hooks.unregisterAbort(30);
  });
  hooks.runAbort();
  EXPECT_EQ(ran, (std::vector<int>{11, 20, 30}));  // 30 was copied out before it ran
  ran.clear();
  hooks.runAbort();
  EXPECT_EQ(ran, (std::vector<int>{11, 20}));
}

TEST(BackendHooks, UnknownIdsAndEmptyHooksAreNamed) {
  BackendHooks hooks;
  try {
    hooks.unregisterAbort(5);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
    EXPECT_NE(std::string(e.what()).find("no abort hook 5 is registered"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(hooks.registerAbort(1, BackendHooks::AbortHook()), Error);
  EXPECT_THROW(hooks.unregisterCompletion(2), Error);
}

TEST(BackendHooks, CompletionHooksGetTheKeyAndCostNothingWhenNoneIsRegistered) {
  BackendHooks hooks;
  EXPECT_FALSE(hooks.wantsCompletion());
  std::vector<uint64_t> keys;
  hooks.registerCompletion(1, [&](uint64_t key, std::optional<float> ms) {
    EXPECT_FALSE(ms.has_value());  // tpcomm does not time its calls
    keys.push_back(key);
  });
  EXPECT_TRUE(hooks.wantsCompletion());
  const uint64_t a = BackendHooks::nextCompletionKey();
  const uint64_t b = BackendHooks::nextCompletionKey();
  EXPECT_NE(a, b);
  hooks.runCompletion(a);
  EXPECT_EQ(keys, std::vector<uint64_t>{a});
  hooks.unregisterCompletion(1);
  EXPECT_FALSE(hooks.wantsCompletion());
  hooks.runCompletion(b);
  EXPECT_EQ(keys, std::vector<uint64_t>{a});
}

c10::intrusive_ptr<ProcessGroupTpcomm> failingGroup() {
  return c10::make_intrusive<ProcessGroupTpcomm>(failingCoordinator());
}

#if defined(TPCOMM_ABORT_HOOKS)
TEST(GroupHooks, AbortHooksRunBeforeAFailureIsRaisedWithTheGroupsReasonSet) {
  auto pg = failingGroup();
  EXPECT_TRUE(pg->supportsAbortHooks());
  std::vector<std::string> seen;  // the group's reason when the hook ran
  pg->registerAbortHook(1, [&] { seen.push_back(pg->coordinator().fault().reason()); });
  std::vector<at::Tensor> t{at::ones({4})};
  // The routed work fails at once: its callback establishes the failure
  // (and runs the hooks) before the caller waits; wait() raises it.
  auto work = pg->allreduce(t, c10d::AllreduceOptions());
  EXPECT_THROW(work->wait(), c10::DistBackendError);
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_NE(seen[0].find("allreduce #1 failed: Timed out"), std::string::npos) << seen[0];
  // The next call of the broken group raises too, after the hooks ran again.
  EXPECT_THROW(pg->allreduce(t, c10d::AllreduceOptions()), c10::DistBackendError);
  EXPECT_EQ(seen.size(), 2u);
  pg->unregisterAbortHook(1);
  EXPECT_THROW(pg->unregisterAbortHook(1), c10::Error);
}

TEST(GroupHooks, AbortRunsTheAbortHooksFirst) {
  ThreadGroup group(1);
  auto pg = c10::make_intrusive<ProcessGroupTpcomm>(group.coordinators[0]);
  std::vector<std::string> seen;
  pg->registerAbortHook(3, [&] { seen.push_back(pg->coordinator().fault().reason()); });
  pg->abort();
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0], "") << "the hooks run before the abort";
  EXPECT_FALSE(pg->coordinator().fault().reason().empty());
}
#endif

#if defined(TPCOMM_COMPLETION_HOOKS)
TEST(GroupHooks, ACompletionHookRunsOncePerWorkThatSucceededWithItsKey) {
  ThreadGroup group(1);
  auto pg = c10::make_intrusive<ProcessGroupTpcomm>(group.coordinators[0]);
  EXPECT_TRUE(pg->supportsCompletionHooks());
  std::vector<uint64_t> keys;
  pg->registerCompletionHook(
      1, [&](const c10d::CompletionHookArgs& args) { keys.push_back(args.completionKey); });
  std::vector<at::Tensor> t{at::ones({4})};
  auto first = pg->allreduce(t, c10d::AllreduceOptions());
  first->wait();
  first->wait();
  // A work without a future of the routed backend (reduce-scatter).
  at::Tensor out = at::empty({4});
  at::Tensor in = at::ones({4});
  auto second = pg->_reduce_scatter_base(out, in, c10d::ReduceScatterOptions());
  second->wait();
  ASSERT_EQ(keys.size(), 2u);
  EXPECT_EQ(keys[0], first->getCompletionKey());
  EXPECT_EQ(keys[1], second->getCompletionKey());
  EXPECT_NE(keys[0], keys[1]);
  pg->unregisterCompletionHook(1);

  // Failed work runs none.
  auto failing = failingGroup();
  std::vector<uint64_t> none;
  failing->registerCompletionHook(
      1, [&](const c10d::CompletionHookArgs& args) { none.push_back(args.completionKey); });
  auto work = failing->allreduce(t, c10d::AllreduceOptions());
  EXPECT_THROW(work->wait(), c10::DistBackendError);
  EXPECT_TRUE(none.empty());
}
#endif

}  // namespace
}  // namespace tpcomm::testing
