#pragma once
// The process-per-rank group of the kernel emulation tests
// (test_kernel_emulation.cpp, test_push_emulation.cpp): a list of calls
// with their inputs in shared memory, each rank a forked process running
// them through the kernels directly or through CustomAllreduce, and the
// reference check (every output bit for bit against the float32 rank-order
// sum, and within rounding of the float64 sum).
#include <gtest/gtest.h>
#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "tests/cpp/custom_allreduce/emulation_support.hpp"

namespace tpcomm::car {
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

  // The push rounds in rotation for the kernels this group runs directly
  // (kPushDepth unless set; 2 shows why kPushDepth is 3). Before run().
  void setPushDepth(uint32_t depth) {
    ASSERT_TRUE(depth >= 2 && depth <= static_cast<uint32_t>(kPushDepth)) << depth;
    pushDepth_ = depth;
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
    a.pushDepth = pushDepth_;
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
  uint32_t pushDepth_ = kPushDepth;
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

// The float32 rank-order sum of call `c`'s inputs over `n` ranks, scaled:
// the bits every rank's output must have. A push reads a zero of either
// sign as +0 (push_kernels.cuh): its reference does too.
std::vector<char> rankOrderSum(const Call& c, int n) {
  std::vector<char> expected(c.count * dtypeSize(c.dtype));
  for (size_t i = 0; i < c.count; ++i) {
    float acc = 0.f;
    for (int r = 0; r < n; ++r) {
      float v = load(c.dtype, c.original[r].data(), i);
      if (c.algorithm == Algorithm::kPush && v == 0.f) v = 0.f;  // -0 is read as +0
      acc = r == 0 ? v : acc + v;
    }
    store(c.dtype, expected.data(), i, acc * c.scale);
  }
  return expected;
}

// The first element of rank `r`'s output of `c` that differs from
// `expected`, described; empty when none does.
std::string firstWrongElement(const Call& c, int n, int r, const std::vector<char>& expected) {
  const size_t elementBytes = dtypeSize(c.dtype);
  const char* out = static_cast<const char*>(c.out[r]);
  for (size_t i = 0; i < c.count; ++i) {
    if (std::memcmp(out + i * elementBytes, expected.data() + i * elementBytes, elementBytes) !=
        0) {
      return describe(c, n) + ": rank " + std::to_string(r) + " element " + std::to_string(i) +
             " is " + std::to_string(load(c.dtype, out, i)) + ", expected " +
             std::to_string(load(c.dtype, expected.data(), i));
    }
  }
  return "";
}

// Every rank's output equals the float32 rank-order sum bit for bit, and the
// float64 sum within rounding. Stops at the first wrong element per call.
void expectResults(const EmulatedGroup& g) {
  const int n = g.size();
  for (const Call& c : g.calls()) {
    if (!c.check) continue;
    const std::vector<char> expected = rankOrderSum(c, n);
    for (size_t i = 0; i < c.count; ++i) {
      double exact = 0.0, magnitude = 0.0;
      for (int r = 0; r < n; ++r) {
        float v = load(c.dtype, c.original[r].data(), i);
        if (c.algorithm == Algorithm::kPush && v == 0.f) v = 0.f;
        exact += v;
        magnitude += std::fabs(v);
      }
      const double got = load(c.dtype, expected.data(), i);
      const double tolerance = (n * std::ldexp(1.0, -24) * magnitude) * c.scale +
                               roundingOf(c.dtype) * std::fabs(exact * c.scale) * 2 +
                               subnormalOf(c.dtype);
      ASSERT_LE(std::fabs(got - exact * c.scale), tolerance) << describe(c, n) << " element " << i;
    }
    for (int r = 0; r < n; ++r) {
      const std::string wrong = firstWrongElement(c, n, r, expected);
      if (!wrong.empty()) ADD_FAILURE() << wrong;
    }
  }
}

// The first output of `g` that differs from the float32 rank-order sum, as
// expectResults compares them, described; empty when every output matches.
std::string firstWrongOutput(const EmulatedGroup& g) {
  for (const Call& c : g.calls()) {
    if (!c.check) continue;
    const std::vector<char> expected = rankOrderSum(c, g.size());
    for (int r = 0; r < g.size(); ++r) {
      std::string wrong = firstWrongElement(c, g.size(), r, expected);
      if (!wrong.empty()) return wrong;
    }
  }
  return "";
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

}  // namespace
}  // namespace tpcomm::car
