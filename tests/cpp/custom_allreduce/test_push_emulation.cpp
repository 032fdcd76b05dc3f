// The push one-shot (custom_allreduce/push_kernels.cuh) in the kernel
// emulation: its rounds with a reader held back and a late pusher among
// calls of every kind, its zeros, and the reset after a failed push. (Its
// plain cases, every dtype, tail and world size, in place and scaled, and
// its timeout, run with the other algorithms in test_kernel_emulation.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/cpp/custom_allreduce/emulated_group.hpp"

namespace tpcomm::car {
namespace {

// The push one-shot's rounds (push_kernels.cuh, "Why three rounds"): a
// reader held back after its push while its peers run into the next call
// and push into its next round; calls of every kind in between (each clears
// the round before its own), sizes that grow and shrink (a round is cleared
// by the size that was pushed into it), one and several blocks. Every call
// has fresh inputs, so a value left from three calls ago, or one zeroed
// before it was read, shows in the result or as a timeout. With two rounds
// in rotation this fails (PushNeedsThreeRounds): the held-back reader
// clears the round its peers are pushing into.
std::vector<Call> slowReadersAndMixedCalls(int kRanks) {
  const size_t counts[] = {901, 17, 4000, 3, 2500, 64};
  std::vector<Call> calls;
  for (int i = 0; i < 24; ++i) {
    Call c;
    c.algorithm = i % 7 == 3 ? Algorithm::kTwoShot
                  : i % 7 == 5 ? Algorithm::kOneShot
                               : Algorithm::kPush;
    c.dtype = i % 3 == 0 ? DType::kFloat32 : i % 3 == 1 ? DType::kBFloat16 : DType::kFloat16;
    c.count = counts[i % 6];
    c.blocks = i < 12 ? 1 : 1 + i % 3;
    c.slowRank = i % kRanks;
    c.slowPhase = i % 2 == 0 ? kPush : emu::kBeforePush;
    c.slowMs = 20;
    calls.push_back(c);
  }
  return calls;
}

TEST(KernelEmulationFull, PushSurvivesSlowReadersAndMixedCalls) {
  EmulatedGroup g(3, 32 << 10, slowReadersAndMixedCalls(3));
  ASSERT_EQ(kPushDepth, 3);
  expectCleanRun(g);
}

// The same calls with two push rounds in rotation instead of kPushDepth's
// three: they must go wrong (wrong sums, or a push waited for in vain),
// else the test above does not show why the third round is there.
TEST(KernelEmulationFull, PushNeedsThreeRounds) {
  EmulatedGroup g(3, 32 << 10, slowReadersAndMixedCalls(3));
  g.setPushDepth(2);
  // Every rank runs to its end (a rank's process failing here would prove
  // nothing): what goes wrong must be a kernel's error word (a push waited
  // for in vain, the poison it spreads) or a wrong sum.
  ASSERT_TRUE(g.run(allRanks(g.size()), 2ull * 1000 * 1000 * 1000));
  std::string wrong;
  for (int r = 0; r < g.size() && wrong.empty(); ++r) {
    if (g.error(r) != 0) wrong = "rank " + std::to_string(r) + ": " + describeError(g.error(r));
  }
  if (wrong.empty()) wrong = firstWrongOutput(g);
  EXPECT_FALSE(wrong.empty()) << "two push rounds in rotation gave every call's right sum: "
                                 "the slow-reader test no longer shows why there are three";
  std::printf("with two push rounds: %s\n", wrong.c_str());
}

// A zero of either sign is read as +0 by the push (it sends every zero as
// -0, so that no word it sends is zero): an element that is -0 on every rank
// sums to +0, where the barrier kernels (plain IEEE addition) give -0; mixes
// of zeros and values sum as IEEE addition does.
TEST(KernelEmulationFull, PushReadsEveryZeroAsPositiveZero) {
  std::vector<Call> calls;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (Algorithm algorithm : {Algorithm::kPush, Algorithm::kOneShot}) {
      Call c;
      c.algorithm = algorithm;
      c.dtype = dtype;
      c.count = 203;
      c.blocks = 2;
      c.zeros = true;
      calls.push_back(c);
    }
  }
  EmulatedGroup g(3, 32 << 10, calls);
  expectCleanRun(g);
  for (const Call& c : g.calls()) {
    for (int r = 0; r < 3; ++r) {
      for (size_t i = 0; i < c.count; i += 4) {  // -0 on every rank
        const float v = load(c.dtype, c.out[r], i);
        ASSERT_EQ(v, 0.f) << describe(c, 3) << " element " << i;
        ASSERT_EQ(std::signbit(v), c.algorithm != Algorithm::kPush)
            << describe(c, 3) << ": rank " << r << " element " << i;
      }
    }
  }
}

TEST(KernelEmulationFailure, AResetAfterAFailedPushClearsItsValues) {
  // Rank 1 pushes late (after rank 0 gave up); after the reset, pushes of
  // every round are right on both ranks (a value left in a round would be
  // taken for the next call's).
  Call failed;
  failed.algorithm = Algorithm::kPush;
  failed.count = 4096;
  failed.timeouts = {100ull * 1000 * 1000, 400ull * 1000 * 1000};
  failed.slowRank = 1;
  failed.slowPhase = emu::kBeforePush;
  failed.slowMs = 300;
  failed.check = false;
  std::vector<Call> calls = {failed};
  for (int i = 0; i < 4; ++i) {
    Call next;
    next.algorithm = i == 2 ? Algorithm::kTwoShot : Algorithm::kPush;
    next.count = 4096 - 1000 * i;
    next.resetBefore = i == 0;
    calls.push_back(next);
  }
  EmulatedGroup g(2, 32 << 10, calls);
  ASSERT_TRUE(g.run({0, 1}, kGenerousNs, 60));
  for (int r = 0; r < 2; ++r) EXPECT_EQ(g.error(r), 0u) << describeError(g.error(r));
  expectResults(g);
}

}  // namespace
}  // namespace tpcomm::car
