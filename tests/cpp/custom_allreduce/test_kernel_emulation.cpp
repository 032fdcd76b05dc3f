// The allreduce kernels' own source (kernels.cuh) compiled for the CPU (see
// custom_allreduce/emulation.hpp) and run with one process per rank over
// shared memory. Each rank's result is compared bit for bit with a float32
// rank-order sum (what the GPU must produce too) and with a float64 sum
// within rounding. This checks the kernels' partitions, tails, two-shot
// parts, epochs over many calls with changing block counts, zero-copy
// sources, the AVG scale and the timeout's error codes; it does not check
// GPU timing or the GPU memory model.
// Longer than 600 lines because the cases share the process-per-rank group
// (EmulatedGroup) and the reference check (expectResults) at its top.
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

#include "tests/cpp/custom_allreduce/emulation_support.hpp"

namespace tpcomm::car {

void launchAllreduce(const LaunchParams& p, cudaStream_t stream) {
  if (orderState != OrderState::kBefore || stream != orderStream) {
    orderViolation("a launch not preceded by before() on its stream");
  }
  orderState = OrderState::kLaunched;
  emu::launch(kernelFor(p), kernelArgsOf(p), p.blocks, 32);
}

namespace {

struct Call {
  Algorithm algorithm = Algorithm::kOneShot;
  DType dtype = DType::kFloat32;
  size_t count = 0;
  int blocks = 1;
  int threads = 32;
  bool inPlace = false;
  float scale = 1.f;
  bool zeroCopy = false;      // sources from a table of the ranks' inputs
  std::vector<bool> stages;   // zero-copy: which ranks still copy
  bool ready = true;          // zero-copy: the table was filled
  std::vector<bool> readyOf;  // per rank, overriding `ready` (empty: not)
  uint64_t timeoutNs = 0;     // 0: the run's
  bool hostApi = false;       // through CustomAllreduce::allreduce (blocks 0: by size)
  bool chooseAlgorithm = false;
  std::vector<uint64_t> timeouts;  // per rank, overriding timeoutNs (0: not)
  int slowRank = -1;               // this rank's blocks sleep slowMs after passing
  int slowPhase = kStart;          // a barrier of this phase
  int slowMs = 0;
  bool resetBefore = false;       // every rank runs CustomAllreduce::reset first
  cudaStream_t stream = nullptr;  // host API: the stream the call names
  bool check = true;              // expectResults compares this call's outputs
  bool zeros = false;             // inputs full of +0 and -0 (see EmulatedGroup)
  // Set by the group.
  std::vector<void*> in, out;
  std::vector<std::vector<char>> original;  // the inputs as they were
  std::vector<RegisteredInputs*> tables;
};

class EmulatedGroup {
 public:
  EmulatedGroup(int n, size_t maxBytes, std::vector<Call> calls)
      : n_(n), layout_(BufferLayout::forMaxBytes(maxBytes)), calls_(std::move(calls)) {
    size_t bytes = n * layout_.totalBytes + 4096;
    for (const Call& c : calls_) {
      bytes += n * (2 * c.count * dtypeSize(c.dtype) + sizeof(RegisteredInputs) + 768);
    }
    arena_ = std::make_unique<Arena>(bytes + sizeof(pthread_barrier_t));
    errors_ = static_cast<uint32_t*>(arena_->take(sizeof(uint32_t) * kMaxRanks));
    // The ranks' CPU barrier (the reset's), shared by their processes.
    cpuBarrier_ = static_cast<pthread_barrier_t*>(arena_->take(sizeof(pthread_barrier_t)));
    pthread_barrierattr_t attr;
    pthread_barrierattr_init(&attr);
    pthread_barrierattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_barrier_init(cpuBarrier_, &attr, static_cast<unsigned>(n));
    pthread_barrierattr_destroy(&attr);
    for (int r = 0; r < n; ++r)
      buffers_.push_back(static_cast<char*>(arena_->take(layout_.totalBytes)));
    std::mt19937 random(1234 + n);
    std::uniform_real_distribution<float> value(-1.f, 1.f);
    for (Call& c : calls_) {
      if (c.stages.empty()) c.stages.assign(n, false);
      const size_t size = c.count * dtypeSize(c.dtype);
      for (int r = 0; r < n; ++r) {
        c.in.push_back(arena_->take(size));
        c.out.push_back(c.inPlace ? c.in[r] : arena_->take(size));
        for (size_t i = 0; i < c.count; ++i) {
          // Magnitudes from 2^-6 to 1, so the float32 sums round.
          float v = value(random) * std::ldexp(1.f, -static_cast<int>(i % 7));
          if (c.zeros) {
            // Element i % 4: 0 is -0 on every rank, 1 is -0 on even ranks and
            // +0 on odd ones, 2 is -0 on rank 0 only, 3 is +0 on every rank.
            const int kind = static_cast<int>(i % 4);
            if (kind == 0 || (kind == 1 && r % 2 == 0) || (kind == 2 && r == 0)) v = -0.f;
            if ((kind == 1 && r % 2 == 1) || kind == 3) v = 0.f;
          }
          store(c.dtype, c.in[r], i, v);
        }
        c.original.emplace_back(static_cast<char*>(c.in[r]), static_cast<char*>(c.in[r]) + size);
        if (!c.inPlace) std::memset(c.out[r], 0xA5, size);  // poison
      }
      if (c.zeroCopy) {
        for (int q = 0; q < n; ++q) {
          auto* table = static_cast<RegisteredInputs*>(arena_->take(sizeof(RegisteredInputs)));
          for (int r = 0; r < n; ++r) {
            table->input[r] = c.stages[r] ? buffers_[r] + layout_.stagingOffset : c.in[r];
          }
          table->ready = (c.readyOf.empty() ? c.ready : static_cast<bool>(c.readyOf[q])) ? 1 : 0;
          c.tables.push_back(table);
        }
      }
    }
  }

  // Runs every call on each rank of `ranks` (a process each, the others
  // withheld); `callsOf[r]` limits rank r to its first calls. False when a
  // rank did not exit cleanly within `deadlineS`.
  bool run(const std::vector<int>& ranks, uint64_t timeoutNs, int deadlineS = 120,
           std::vector<size_t> callsOf = {}) {
    return forkRanks(ranks, deadlineS, [&](int rank) {
      const size_t calls = callsOf.empty() ? calls_.size() : callsOf[rank];
      for (size_t i = 0; i < calls; ++i) runCall(calls_[i], rank, timeoutNs);
    });
  }

  uint32_t error(int rank) const { return errors_[rank]; }
  uint32_t* errorWord(int rank) { return &errors_[rank]; }
  std::vector<void*> bases() const { return {buffers_.begin(), buffers_.end()}; }
  const std::vector<Call>& calls() const { return calls_; }
  int size() const { return n_; }

 private:
  void runCall(const Call& c, int rank, uint64_t timeoutNs) {
    if (!c.timeouts.empty() && c.timeouts[rank] != 0)
      timeoutNs = c.timeouts[rank];
    else if (c.timeoutNs != 0)
      timeoutNs = c.timeoutNs;
    if (c.resetBefore) resetThroughHostApi(rank);
    std::fill(std::begin(emu::leaveDelayMs), std::end(emu::leaveDelayMs), 0);
    if (c.slowRank == rank) emu::leaveDelayMs[c.slowPhase] = c.slowMs;
    if (c.hostApi) {
      runThroughHostApi(c, rank, timeoutNs);
      return;
    }
    KernelArgs a{};
    a.input = c.in[rank];
    a.output = c.out[rank];
    a.count = c.count;
    for (int r = 0; r < n_; ++r) a.buffers[r] = buffers_[r];
    a.registered = c.zeroCopy ? c.tables[rank] : nullptr;
    a.stagingOffset = layout_.stagingOffset;
    a.stagingBytes = layout_.stagingBytes;
    a.resultOffset = layout_.resultOffset;
    a.pushOffset = layout_.pushOffset;
    a.pushSlotBytes = layout_.pushSlotBytes;
    a.rank = rank;
    a.stage = c.zeroCopy ? (c.stages[rank] ? 1 : 0) : 1;
    a.scale = c.scale;
    a.timeoutNs = timeoutNs;
    a.error = &errors_[rank];
    const uint64_t readsBefore = emu::readyReads.load();
    emu::launch(kernelFor(c.dtype, c.algorithm, n_), a, c.blocks, c.threads);
    // One thread per block reads the table's `ready` (so that a block's
    // threads cannot disagree about it).
    const uint64_t reads = emu::readyReads.load() - readsBefore;
    if (reads != (c.zeroCopy ? static_cast<uint64_t>(c.blocks) : 0)) {
      std::fprintf(stderr, "rank %d: %llu reads of `ready` by %d blocks\n", rank,
                   static_cast<unsigned long long>(reads), c.blocks);
      _exit(7);
    }
  }

  // The product's reset (CustomAllreduce::reset) with the emulation's
  // operations: kernels here end before launch() returns, the CPU barrier is
  // the ranks' shared one, zeroing is a memset.
  void resetThroughHostApi(int rank) {
    CustomAllreduce car(rank, n_, bases(), layout_.maxBytes, std::chrono::milliseconds(1000),
                        &errors_[rank], &errors_[rank], std::make_unique<CheckedOrder>());
    CustomAllreduce::ResetOps ops;
    ops.synchronize = [] {};
    ops.barrier = [this] { pthread_barrier_wait(cpuBarrier_); };
    ops.zeroSignals = [this](void* buffer) { std::memset(buffer, 0, layout_.signalBytes); };
    car.reset(ops);
  }

  void runThroughHostApi(const Call& c, int rank, uint64_t timeoutNs) {
    CustomAllreduce car(rank, n_, bases(), layout_.maxBytes,
                        std::chrono::milliseconds(std::max<uint64_t>(1, timeoutNs / 1000000)),
                        &errors_[rank], &errors_[rank], std::make_unique<CheckedOrder>());
    CallOptions options;
    options.chooseAlgorithm = c.chooseAlgorithm;
    options.algorithm = c.algorithm;
    options.blocks = c.blocks;
    options.scale = c.scale;
    options.registered = c.zeroCopy ? c.tables[rank] : nullptr;
    options.stageInput = c.zeroCopy ? static_cast<bool>(c.stages[rank]) : true;
    const uint64_t launchesBefore = orderedLaunches;
    try {
      car.allreduce(c.in[rank], c.out[rank], c.count, c.dtype, c.stream, options);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
      _exit(3);
    }
    // An empty call launches nothing; every other call is ordered.
    if (orderedLaunches - launchesBefore != (c.count == 0 ? 0u : 1u)) {
      orderViolation("a launch that was not ordered");
    }
  }

  int n_;
  BufferLayout layout_;
  std::vector<Call> calls_;
  std::unique_ptr<Arena> arena_;
  uint32_t* errors_ = nullptr;
  pthread_barrier_t* cpuBarrier_ = nullptr;
  std::vector<char*> buffers_;
};

std::string describe(const Call& c, int n) {
  return std::string(algorithmName(c.algorithm)) + " " + dtypeName(c.dtype) +
         " n=" + std::to_string(n) + " count=" + std::to_string(c.count) +
         " blocks=" + std::to_string(c.blocks) + " threads=" + std::to_string(c.threads) +
         (c.inPlace ? " in place" : "") + (c.zeroCopy ? " zero-copy" : "");
}

// Every rank's output equals the float32 rank-order sum bit for bit, and the
// float64 sum within rounding. Stops at the first wrong element per call.
// A push reads a zero of either sign as +0 (push_kernels.cuh): its reference
// does too.
void expectResults(const EmulatedGroup& g) {
  const int n = g.size();
  for (const Call& c : g.calls()) {
    if (!c.check) continue;
    const size_t elementBytes = dtypeSize(c.dtype);
    std::vector<char> expected(c.count * elementBytes);
    for (size_t i = 0; i < c.count; ++i) {
      float acc = 0.f;
      double exact = 0.0, magnitude = 0.0;
      for (int r = 0; r < n; ++r) {
        float v = load(c.dtype, c.original[r].data(), i);
        if (c.algorithm == Algorithm::kPush && v == 0.f) v = 0.f;  // -0 is read as +0
        acc = r == 0 ? v : acc + v;
        exact += v;
        magnitude += std::fabs(v);
      }
      store(c.dtype, expected.data(), i, acc * c.scale);
      const double got = load(c.dtype, expected.data(), i);
      const double tolerance = (n * std::ldexp(1.0, -24) * magnitude) * c.scale +
                               roundingOf(c.dtype) * std::fabs(exact * c.scale) * 2 +
                               subnormalOf(c.dtype);
      ASSERT_LE(std::fabs(got - exact * c.scale), tolerance) << describe(c, n) << " element " << i;
    }
    for (int r = 0; r < n; ++r) {
      const char* out = static_cast<const char*>(c.out[r]);
      for (size_t i = 0; i < c.count; ++i) {
        if (std::memcmp(out + i * elementBytes, expected.data() + i * elementBytes, elementBytes) !=
            0) {
          ADD_FAILURE() << describe(c, n) << ": rank " << r << " element " << i << " is "
                        << load(c.dtype, out, i) << ", expected "
                        << load(c.dtype, expected.data(), i);
          break;
        }
      }
    }
  }
}

constexpr uint64_t kGenerousNs = 60ull * 1000 * 1000 * 1000;  // a loaded CI machine

std::vector<int> allRanks(int n) {
  std::vector<int> out;
  for (int r = 0; r < n; ++r) out.push_back(r);
  return out;
}

// Runs every call on every rank of `g`; no rank may fail, and every output
// must be the reference.
void expectCleanRun(EmulatedGroup& g) {
  ASSERT_TRUE(g.run(allRanks(g.size()), kGenerousNs));
  for (int r = 0; r < g.size(); ++r) EXPECT_EQ(g.error(r), 0u) << describeError(g.error(r));
  expectResults(g);
}

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

// The push one-shot's rounds (push_kernels.cuh, "Why three rounds"): a
// reader held back after its push while its peers run into the next call
// and push into its next round; calls of every kind in between (each clears
// the round before its own), sizes that grow and shrink (a round is cleared
// by the size that was pushed into it), one and several blocks. Every call
// has fresh inputs, so a value left from three calls ago, or one zeroed
// before it was read, shows in the result or as a timeout. With two rounds
// (kPushDepth = 2) this fails: the held-back reader clears the round its
// peers are pushing into and waits in vain.
TEST(KernelEmulationFull, PushSurvivesSlowReadersAndMixedCalls) {
  constexpr int kRanks = 3;
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
  EmulatedGroup g(kRanks, 32 << 10, calls);
  expectCleanRun(g);
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
