// The allreduce kernels' own source (kernels.cuh) compiled for the CPU (see
// custom_allreduce/emulation.hpp) and run with one process per rank over
// shared memory. Each rank's result is compared bit for bit with a float32
// rank-order sum (what the GPU must produce too) and with a float64 sum
// within rounding. This checks the kernels' partitions, tails, two-shot
// parts, epochs over many calls with changing block counts, zero-copy
// sources, the AVG scale and the timeout's error codes; it does not check
// GPU timing or the GPU memory model.
// The process-per-rank group and the reference check are in
// emulated_group.hpp; the push one-shot's own cases in test_push_emulation.cpp.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tests/cpp/custom_allreduce/emulated_group.hpp"

namespace tpcomm::car {

void launchAllreduce(const LaunchParams& p, cudaStream_t stream) {
  if (orderState != OrderState::kBefore || stream != orderStream) {
    orderViolation("a launch not preceded by before() on its stream");
  }
  orderState = OrderState::kLaunched;
  emu::launch(kernelFor(p), kernelArgsOf(p), p.blocks, 32);
}

namespace {

class KernelEmulation : public ::testing::TestWithParam<int> {};

// Every dtype and algorithm, counts around the pack size and the block and
// part boundaries, 1 and 3 blocks: one long sequence of calls per rank, so
// the per-block epochs advance while the block count changes.
TEST_P(KernelEmulation, EveryDtypeAlgorithmAndTailMatchesTheReference) {
  const int n = GetParam();
  std::vector<Call> calls;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (Algorithm algorithm : {Algorithm::kPush, Algorithm::kOneShot, Algorithm::kTwoShot}) {
      for (size_t count : {size_t{1}, size_t{3}, size_t{8}, size_t{9}, size_t{31}, size_t{69},
                           size_t{500}, size_t{2007}, size_t{5000}}) {
        for (int blocks : {1, 3}) {
          Call c;
          c.dtype = dtype;
          c.algorithm = algorithm;
          c.count = count;
          c.blocks = blocks;
          calls.push_back(c);
        }
      }
    }
  }
  EmulatedGroup g(n, 32 << 10, calls);
  ASSERT_TRUE(g.run(allRanks(n), kGenerousNs));
  for (int r = 0; r < n; ++r) EXPECT_EQ(g.error(r), 0u) << describeError(g.error(r));
  expectResults(g);
}

// In place (output = input), the AVG scale, and zero-copy sources: every
// rank's input read where it lies, some ranks still staging, two-shot in
// place (the host never asks for one-shot zero-copy in place).
TEST_P(KernelEmulation, InPlaceScaleAndZeroCopy) {
  const int n = GetParam();
  std::vector<Call> calls;
  for (Algorithm algorithm : {Algorithm::kPush, Algorithm::kOneShot, Algorithm::kTwoShot}) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      Call c;
      c.algorithm = algorithm;
      c.dtype = dtype;
      c.count = 1003;
      c.blocks = 2;
      c.inPlace = true;
      calls.push_back(c);
      c.inPlace = false;
      c.scale = 1.f / static_cast<float>(n);
      calls.push_back(c);
      c.scale = 1.f;
      if (algorithm == Algorithm::kPush) continue;  // reads its input where it lies anyway
      c.zeroCopy = true;
      calls.push_back(c);
      c.stages.assign(n, false);
      for (int r = 0; r < n; r += 2) c.stages[r] = true;
      calls.push_back(c);
      if (algorithm == Algorithm::kTwoShot) {
        c.inPlace = true;
        c.stages.assign(n, false);
        calls.push_back(c);
      }
    }
  }
  EmulatedGroup g(n, 32 << 10, calls);
  ASSERT_TRUE(g.run(allRanks(n), kGenerousNs));
  for (int r = 0; r < n; ++r) EXPECT_EQ(g.error(r), 0u) << describeError(g.error(r));
  expectResults(g);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, KernelEmulation, ::testing::Range(2, 9));

// Through the host API (CustomAllreduce::allreduce): the algorithm and block
// count chosen by size (two-shot above the one-shot limit at 4 and 5 ranks),
// AVG, an empty call that launches nothing, zero-copy options, and launches on
// several streams, each bracketed by the rank's launch order (CheckedOrder).
class HostApiEmulation : public ::testing::TestWithParam<int> {};

TEST_P(HostApiEmulation, CallsThroughCustomAllreduceMatchTheReference) {
  const int n = GetParam();
  std::vector<Call> calls;
  Call c;
  c.hostApi = true;
  c.chooseAlgorithm = true;
  c.blocks = 0;
  c.count = 200000;  // 800 KB of float32: two-shot at 4 and 5 ranks, one-shot at 2
  calls.push_back(c);
  c.count = 0;
  calls.push_back(c);
  c.count = 1501;  // 6 KB: a push, chosen by size
  calls.push_back(c);
  c.dtype = DType::kBFloat16;
  c.count = 777;
  c.stream = reinterpret_cast<cudaStream_t>(0x1000);  // launches on several streams
  c.chooseAlgorithm = false;
  c.algorithm = Algorithm::kTwoShot;
  calls.push_back(c);
  c.dtype = DType::kFloat16;
  c.count = 4096 + 3;
  c.algorithm = Algorithm::kOneShot;
  c.scale = 1.f / static_cast<float>(n);
  calls.push_back(c);
  c.scale = 1.f;
  c.zeroCopy = true;
  c.stages.assign(n, false);
  c.stages[n - 1] = true;
  c.stream = reinterpret_cast<cudaStream_t>(0x2000);
  calls.push_back(c);
  c.algorithm = Algorithm::kTwoShot;
  c.inPlace = true;
  c.stages.assign(n, false);
  calls.push_back(c);
  EmulatedGroup g(n, 1 << 20, calls);
  ASSERT_TRUE(g.run(allRanks(n), kGenerousNs, 300));
  for (int r = 0; r < n; ++r) EXPECT_EQ(g.error(r), 0u) << describeError(g.error(r));
  expectResults(g);
  EXPECT_EQ(chooseAlgorithm(n, 800000, 1 << 20),
            n == 2 ? Algorithm::kOneShot : Algorithm::kTwoShot);
  EXPECT_EQ(chooseAlgorithm(n, 1501 * 4, 1 << 20), Algorithm::kPush);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, HostApiEmulation, ::testing::Values(2, 4, 5));

// The product's thread count (kThreads per block) with several packs per
// thread.
TEST(KernelEmulationFull, ProductBlockSize) {
  std::vector<Call> calls;
  for (Algorithm algorithm : {Algorithm::kOneShot, Algorithm::kTwoShot}) {
    Call c;
    c.algorithm = algorithm;
    c.count = 4 * 2 * kThreads * 3 + 3;
    c.blocks = 2;
    c.threads = kThreads;
    calls.push_back(c);
  }
  EmulatedGroup g(3, 128 << 10, calls);
  ASSERT_TRUE(g.run(allRanks(3), kGenerousNs));
  expectResults(g);
}

// One-shot with one barrier (signal.hpp, "Staging parity"): a rank is slow
// to read after the start barrier while its peers run ahead into the next
// call and stage into their other region. Every call has fresh inputs, so a
// peer that rewrote a region still being read shows in the result (with one
// staging region this fails). Block counts change from call to call, so the
// parity must follow the call count on every block; two-shot and zero-copy
// one-shot calls (which keep their end barrier) come in between.
TEST(KernelEmulationFull, OneBarrierOneShotSurvivesASlowReader) {
  constexpr int kRanks = 3;
  const int blocks[] = {1, 3, 2, 1};
  std::vector<Call> calls;
  for (int i = 0; i < 16; ++i) {
    Call c;
    c.algorithm = i % 5 == 4 ? Algorithm::kTwoShot : Algorithm::kOneShot;
    c.dtype = i % 2 == 0 ? DType::kFloat32 : DType::kBFloat16;
    c.count = 901;
    c.blocks = blocks[i % 4];
    c.slowRank = 1 + i % 2;
    c.slowPhase = kStart;
    c.slowMs = 25;
    if (i == 6 || i == 11) {
      c.zeroCopy = true;
      c.stages.assign(kRanks, false);
      c.stages[0] = true;  // rank 0's entry names its staging
    }
    calls.push_back(c);
  }
  EmulatedGroup g(kRanks, 32 << 10, calls);
  ASSERT_TRUE(g.run(allRanks(kRanks), kGenerousNs));
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(g.error(r), 0u) << describeError(g.error(r));
  expectResults(g);
}

// A withheld rank: the others stop within the timeout, name it in the error
// word, leave the output alone; a rank that took part in an earlier call got
// that call's result.
TEST(KernelEmulationFailure, WithheldRankIsNamedAndOutputUntouched) {
  Call first;
  first.count = 300;
  first.blocks = 2;
  Call second = first;
  second.algorithm = Algorithm::kTwoShot;
  second.timeoutNs = 200ull * 1000 * 1000;
  EmulatedGroup g(3, 32 << 10, {first, second});
  const auto start = std::chrono::steady_clock::now();
  // Rank 2 takes part in the first call only.
  ASSERT_TRUE(g.run({0, 1, 2}, kGenerousNs, 60, {2, 2, 1}));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(30));
  // Each of ranks 0 and 1 either timed out itself or found the group
  // poisoned by the other first; either way the cause is rank 2.
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(g.error(r) & ~(0xfu << 24), errorCode(2, kStart, 0)) << describeError(g.error(r));
    EXPECT_NE(describeError(g.error(r)).find("rank 2 did not arrive (block 0, start barrier)"),
              std::string::npos);
    const auto* out = static_cast<const unsigned char*>(g.calls()[1].out[r]);
    for (size_t i = 0; i < 300 * 4; ++i) ASSERT_EQ(out[i], 0xA5) << "rank " << r << " byte " << i;
  }
  EXPECT_EQ(g.error(2), 0u);
  // The first call, which every rank made, is right everywhere.
  EmulatedGroup reference(3, 32 << 10, {first});
  ASSERT_TRUE(reference.run({0, 1, 2}, kGenerousNs));
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(std::memcmp(g.calls()[0].out[r], reference.calls()[0].out[r], 300 * 4), 0);
  }
}

// A timeout poisons the group: a rank's kernels queued behind the failed one
// (or graph replays) end at once with the original cause instead of waiting
// out their own timeout, and a peer that comes late finds the poison at entry
// instead of pairing its call with its peers' next one (whose flags and
// staging it would take for its own; a late push pushes nothing). Outputs
// stay untouched everywhere (no pack of a push had all its values). The
// failed call is a barrier one-shot or a push (named by "its pushed values").
class TimeoutEmulation : public ::testing::TestWithParam<Algorithm> {};

TEST_P(TimeoutEmulation, ATimeoutPoisonsQueuedAndLateKernelsOfEveryRank) {
  const bool push = GetParam() == Algorithm::kPush;
  Call first;
  first.algorithm = GetParam();
  first.count = 300;
  first.blocks = 2;
  first.timeoutNs = 200ull * 1000 * 1000;
  Call second = first;
  second.algorithm = Algorithm::kTwoShot;
  second.timeoutNs = 0;  // the run's: a minute
  EmulatedGroup g(3, 32 << 10, {first, second});
  auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(g.run({0, 1}, kGenerousNs, 30)) << "the queued call waited out its timeout";
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  start = std::chrono::steady_clock::now();
  ASSERT_TRUE(g.run({2}, kGenerousNs, 30)) << "the late rank waited";
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  const std::string cause = std::string("rank 2 did not arrive (block 0, ") +
                            (push ? "its pushed values)" : "start barrier)");
  for (int r = 0; r < 3; ++r) {
    const uint32_t code = g.error(r);
    EXPECT_EQ(code & ~(0xfu << 24), errorCode(2, push ? kPush : kStart, 0))
        << "rank " << r << ": " << describeError(code);
    EXPECT_NE(describeError(code).find(cause), std::string::npos) << describeError(code);
    if (r == 2) {
      EXPECT_TRUE(reporterOf(code) == 0 || reporterOf(code) == 1) << describeError(code);
      EXPECT_NE(describeError(code).find("the group is poisoned: rank "), std::string::npos);
    }
    for (const Call& c : g.calls()) {
      const auto* out = static_cast<const unsigned char*>(c.out[r]);
      for (size_t i = 0; i < c.count * 4; ++i) {
        ASSERT_EQ(out[i], 0xA5) << describe(c, 3) << ": rank " << r << " byte " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Algorithms, TimeoutEmulation,
                         ::testing::Values(Algorithm::kOneShot, Algorithm::kPush),
                         [](const ::testing::TestParamInfo<Algorithm>& info) {
                           return std::string(info.param == Algorithm::kPush ? "Push"
                                                                             : "OneShot");
                         });

// The collective reset waits until no rank has a kernel in flight before
// anyone zeroes: rank 0 gives up on a two-shot call while rank 1 is slow to
// reduce; rank 1 then arrives at the middle barrier and writes its flag into
// rank 0's buffer. Had rank 0 zeroed its flags before that write, the stale
// flag would let its next call's middle barrier pass before rank 1 (slow
// again) had reduced its part: rank 0 would gather the failed call's part.
// The calls after the reset are right on every rank and leave no error.
TEST(KernelEmulationFailure, ResetWaitsForLateFlagsOfTheFailedCall) {
  Call failed;
  failed.algorithm = Algorithm::kTwoShot;
  failed.count = 4096;
  failed.timeouts = {100ull * 1000 * 1000, 0};
  failed.slowRank = 1;
  failed.slowPhase = kStart;
  failed.slowMs = 500;
  failed.check = false;
  Call next = failed;
  next.timeouts.clear();
  next.slowMs = 200;
  next.resetBefore = true;
  next.check = true;
  Call last = next;
  last.slowRank = -1;
  last.resetBefore = false;
  last.algorithm = Algorithm::kOneShot;
  EmulatedGroup g(2, 32 << 10, {failed, next, last});
  ASSERT_TRUE(g.run({0, 1}, kGenerousNs, 60));
  for (int r = 0; r < 2; ++r) EXPECT_EQ(g.error(r), 0u) << describeError(g.error(r));
  expectResults(g);
}

// Through the host API: after a peer did not arrive, the rank's next call is
// refused (PeerLost, naming the peer) before anything is launched.
TEST(KernelEmulationFailure, HostApiRefusesCallsAfterATimeout) {
  Call c;
  c.count = 64;
  EmulatedGroup g(2, 32 << 10, {c});
  const BufferLayout layout = BufferLayout::forMaxBytes(32 << 10);
  // Rank 1 never calls; rank 0 waits 200 ms, then its next call must fail.
  const pid_t pid = fork();
  if (pid == 0) {
    CustomAllreduce car(0, 2, g.bases(), layout.maxBytes, std::chrono::milliseconds(200),
                        g.errorWord(0), g.errorWord(0), std::make_unique<CheckedOrder>());
    const Call& call = g.calls()[0];
    car.allreduce(call.in[0], call.out[0], call.count, DType::kFloat32, nullptr);
    // 256 bytes, chosen by size: a push.
    if (car.errorCode() != errorCode(1, kPush, 0)) _exit(4);
    try {
      car.allreduce(call.in[0], call.out[0], call.count, DType::kFloat32, nullptr);
    } catch (const Error& e) {
      const std::string what = e.what();
      const bool named =
          what.find("rank 1 did not arrive (block 0, its pushed values)") != std::string::npos;
      _exit(e.code() == ErrorCode::kPeerLost && named ? 0 : 5);
    }
    _exit(6);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "4: no error code, 5: wrong error, 6: not refused";
}

// One rank's zero-copy table was never filled (its graph replayed before
// graph_capture() exited), its peer's was: the refusing rank poisons the
// group, so the peer stops at once instead of waiting out its timeout, and
// their next calls (whose epochs no longer match) are refused, not paired.
TEST(KernelEmulationFailure, AnUnfilledTableOnOneRankPoisonsTheGroup) {
  Call replay;
  replay.count = 500;
  replay.algorithm = Algorithm::kTwoShot;
  replay.zeroCopy = true;
  replay.readyOf = {false, true};
  Call next;
  next.count = 500;
  EmulatedGroup g(2, 32 << 10, {replay, next});
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(g.run({0, 1}, kGenerousNs, 30)) << "a rank waited out its timeout";
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(g.error(r) & ~(0xfu << 24), errorCode(0, kNotRegistered, 0))
        << describeError(g.error(r));
    for (const Call& c : g.calls()) {
      const auto* out = static_cast<const unsigned char*>(c.out[r]);
      for (size_t i = 0; i < c.count * 4; ++i) ASSERT_EQ(out[i], 0xA5) << "rank " << r;
    }
  }
}

// A zero-copy table that was never filled: every rank stops with the
// not-registered code before touching any flag or output.
TEST(KernelEmulationFailure, UnfilledZeroCopyTableRefusesToRun) {
  Call c;
  c.count = 100;
  c.algorithm = Algorithm::kTwoShot;
  c.zeroCopy = true;
  c.ready = false;
  EmulatedGroup g(2, 32 << 10, {c});
  ASSERT_TRUE(g.run({0, 1}, kGenerousNs));
  for (int r = 0; r < 2; ++r) {
    // Its own refusal, or the other rank's poison (the same cause).
    EXPECT_EQ(g.error(r) & ~(0xfu << 24), errorCode(0, kNotRegistered, 0));
    EXPECT_NE(describeError(g.error(r)).find("replayed before the context exited"),
              std::string::npos);
    const auto* out = static_cast<const unsigned char*>(g.calls()[0].out[r]);
    for (size_t i = 0; i < 100 * 4; ++i) ASSERT_EQ(out[i], 0xA5);
  }
}

// The group broke (an abort on rank 0, or a peer's refusal on another route):
// rank 0's host writes the abort into every rank's poison word while ranks 1
// and 2 wait for it at the start barrier with a minute's timeout. Their
// waiting kernels and the ones queued behind them stop at once, name rank 0,
// and leave every output alone; their next call through the host API is
// refused naming the abort.
TEST(KernelEmulationFailure, AnAbortStopsEveryRanksWaitingAndQueuedKernels) {
  Call first;
  first.count = 300;
  first.blocks = 2;
  first.algorithm = Algorithm::kPush;  // waits for rank 0's values
  Call second = first;
  second.algorithm = Algorithm::kTwoShot;
  EmulatedGroup g(3, 32 << 10, {first, second});
  const BufferLayout layout = BufferLayout::forMaxBytes(32 << 10);
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    CustomAllreduce car(0, 3, g.bases(), layout.maxBytes, std::chrono::milliseconds(60000),
                        g.errorWord(0), g.errorWord(0), std::make_unique<CheckedOrder>());
    car.abort(
        [](uint32_t* word, uint32_t value) { __atomic_store_n(word, value, __ATOMIC_RELEASE); });
  });
  const auto start = std::chrono::steady_clock::now();
  const bool ran = g.run({1, 2}, kGenerousNs, 30);
  aborter.join();
  ASSERT_TRUE(ran) << "a rank waited out its timeout";
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(g.error(0), abortCode(0));
  EXPECT_EQ(describeError(g.error(0)), "rank 0 aborted the group");
  for (int r = 1; r < 3; ++r) {
    EXPECT_EQ(g.error(r), poisonCode(abortCode(0), 0)) << describeError(g.error(r));
    EXPECT_EQ(describeError(g.error(r)), "the group is poisoned: rank 0 aborted it");
    for (const Call& c : g.calls()) {
      const auto* out = static_cast<const unsigned char*>(c.out[r]);
      for (size_t i = 0; i < c.count * 4; ++i) ASSERT_EQ(out[i], 0xA5) << "rank " << r;
    }
  }
  CustomAllreduce car(1, 3, g.bases(), layout.maxBytes, std::chrono::milliseconds(60000),
                      g.errorWord(1), g.errorWord(1), std::make_unique<CheckedOrder>());
  try {
    car.checkError();
    FAIL() << "no error after the abort";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kPeerLost);
    EXPECT_NE(std::string(e.what()).find("rank 0 aborted it"), std::string::npos) << e.what();
  }
}

// This rank's own abort, from another thread, stops its waiting kernel
// through the error word alone (mapped host memory), even when the poison
// copies do not land (a writer that drops them).
TEST(KernelEmulationFailure, AnAbortStopsThisRanksKernelThroughItsErrorWord) {
  Call c;
  c.count = 300;
  EmulatedGroup g(2, 32 << 10, {c});
  const BufferLayout layout = BufferLayout::forMaxBytes(32 << 10);
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    CustomAllreduce car(1, 2, g.bases(), layout.maxBytes, std::chrono::milliseconds(60000),
                        g.errorWord(1), g.errorWord(1), std::make_unique<CheckedOrder>());
    car.abort([](uint32_t*, uint32_t) {});
  });
  const auto start = std::chrono::steady_clock::now();
  const bool ran = g.run({1}, kGenerousNs, 30);  // rank 0 never comes
  aborter.join();
  ASSERT_TRUE(ran) << "the kernel waited out its timeout";
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(g.error(1), abortCode(1)) << describeError(g.error(1));
  const auto* out = static_cast<const unsigned char*>(g.calls()[0].out[1]);
  for (size_t i = 0; i < 300 * 4; ++i) ASSERT_EQ(out[i], 0xA5);
}

}  // namespace
}  // namespace tpcomm::car
