// A reader's polling learnt from its waits (SpinLearner): the policy step by
// step, then a ring whose messages come far apart (its reader stops polling)
// and back to back again (polling comes back), every message checked.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "message_queue/ring/ring.hpp"

namespace tpcomm::mq {
namespace {

using namespace std::chrono_literals;

constexpr std::chrono::microseconds kSpin{200};

// n waits that ended as given, each after asking for its spin.
void waits(SpinLearner& l, int n, bool atOnce, bool polled) {
  for (int i = 0; i < n; ++i) {
    l.next(kSpin);
    l.record(atOnce, polled);
  }
}

TEST(SpinLearner, PollsFullyWhileMostWaitsAreMetPolling) {
  SpinLearner l(true);
  // 8 of 16 met polling: half is enough to keep polling.
  for (int i = 0; i < 8; ++i) {
    waits(l, 1, false, true);
    waits(l, 1, false, false);
  }
  EXPECT_FALSE(l.brief());
  EXPECT_EQ(l.next(kSpin), kSpin);
}

TEST(SpinLearner, WaitsThatSleepMakeItPollBrieflyThenProbe) {
  SpinLearner l(true);
  waits(l, SpinLearner::kWindow - 1, false, false);
  EXPECT_FALSE(l.brief()) << "decided before a whole window";
  waits(l, 1, false, false);
  ASSERT_TRUE(l.brief());
  // Brief waits, then one whole spin every kProbeEvery-th wait.
  for (uint32_t round = 0; round < 3; ++round) {
    for (uint32_t i = 1; i < SpinLearner::kProbeEvery; ++i) {
      EXPECT_EQ(l.next(kSpin), SpinLearner::kBrief) << "round " << round << " wait " << i;
      l.record(false, false);
    }
    EXPECT_EQ(l.next(kSpin), kSpin) << "round " << round << ": no probe";
    l.record(false, false);  // the probe slept too
    EXPECT_TRUE(l.brief());
  }
  // A brief wait met polling proves nothing; a probe met polling restores polling.
  EXPECT_EQ(l.next(kSpin), SpinLearner::kBrief);
  l.record(false, true);
  EXPECT_TRUE(l.brief());
  for (uint32_t i = 2; i < SpinLearner::kProbeEvery; ++i) waits(l, 1, false, false);
  EXPECT_EQ(l.next(kSpin), kSpin);
  l.record(false, true);
  EXPECT_FALSE(l.brief());
  EXPECT_EQ(l.next(kSpin), kSpin);
}

TEST(SpinLearner, MessagesFoundAtOnceCountForNothing) {
  SpinLearner l(true);
  waits(l, 1000, true, false);
  waits(l, SpinLearner::kWindow - 1, false, false);
  EXPECT_FALSE(l.brief());
}

TEST(SpinLearner, OffOrSpinZeroLeavesTheSpinAsConfigured) {
  SpinLearner off(false);
  waits(off, 100, false, false);
  EXPECT_FALSE(off.brief());
  EXPECT_EQ(off.next(kSpin), kSpin);
  SpinLearner on(true);
  waits(on, 100, false, false);
  ASSERT_TRUE(on.brief());
  // Spin 0 is the fixed 4,000 polls: never shortened.
  for (int i = 0; i < 20; ++i) EXPECT_EQ(on.next(std::chrono::microseconds(0)).count(), 0);
  // ... nor learnt from: waits at spin 0 that slept leave a polling learner polling.
  SpinLearner zero(true);
  for (int i = 0; i < 100; ++i) {
    zero.next(std::chrono::microseconds(0));
    zero.record(false, false);
  }
  EXPECT_FALSE(zero.brief());
}

std::vector<char> payload(uint32_t k) {
  std::vector<char> m(8 + k % 57);
  for (size_t i = 0; i < m.size(); ++i) m[i] = static_cast<char>((k * 7 + i) & 0xff);
  return m;
}

// A real ring: messages 20 ms apart make the reader poll briefly (each wait
// outlasts the 200 us spin); then the writer sends each message as soon as
// the previous one was read, the reader's probe meets one polling and
// polling returns. Every message arrives, in order, intact.
TEST(SpinLearner, AReaderStopsPollingForSlowMessagesAndResumesForFastOnes) {
  Geometry g;
  g.numReaders = 1;
  g.numChunks = 8;
  g.chunkBytes = 256;
  Writer writer(g);
  Reader reader(writer.name(), 0);
  writer.waitForReaders(5s);
  writer.setSpin(kSpin);
  reader.setSpin(kSpin);
  const uint32_t slow = 2 * SpinLearner::kWindow;
  const uint32_t fast = 2000;
  std::atomic<uint32_t> read{0};
  std::thread sender([&] {
    for (uint32_t k = 0; k < slow + fast; ++k) {
      if (k < slow) {
        std::this_thread::sleep_for(20ms);
      } else {
        // Written once the reader took the one before and is waiting again.
        while (read.load() < k) std::this_thread::yield();
      }
      const auto m = payload(k);
      writer.write(m.data(), m.size(), 10s);
    }
  });
  bool briefAfterSlow = false;
  uint32_t firstFullAgain = 0;
  for (uint32_t k = 0; k < slow + fast; ++k) {
    const auto got = reader.read(10s);
    ASSERT_EQ(got, payload(k)) << "message " << k;
    if (k == slow - 1) briefAfterSlow = reader.pollsBriefly();
    if (k >= slow && firstFullAgain == 0 && !reader.pollsBriefly()) firstFullAgain = k;
    read.store(k + 1);
  }
  sender.join();
  EXPECT_TRUE(briefAfterSlow) << "waits of 20 ms each did not stop the polling";
  EXPECT_NE(firstFullAgain, 0u) << "messages sent as soon as the last was read never brought "
                                   "polling back";
}

}  // namespace
}  // namespace tpcomm::mq
