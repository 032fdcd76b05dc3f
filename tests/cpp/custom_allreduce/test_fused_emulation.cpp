// The fused allreduce + residual add + RMSNorm kernels (fused_kernels.cuh)
// compiled for the CPU and run through the host API
// (CustomAllreduce::allreduceAddRmsNorm) with one process per rank over
// shared memory, as test_kernel_emulation.cpp runs the plain kernels.
// Each rank's residual_out is compared bit for bit with the float32
// rank-order sum rounded to the dtype plus the residual (what the separate
// allreduce and add give), its normed rows with a float64 RMSNorm of that
// residual_out within float32 rounding, and the normed rows of ranks that
// share a residual bit for bit with each other.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <string>
#include <vector>

#include "tests/cpp/custom_allreduce/emulation_support.hpp"

namespace tpcomm::car {
namespace {

struct FusedCall {
  Algorithm algorithm = Algorithm::kOneShot;
  DType dtype = DType::kFloat32;
  size_t rows = 1;
  size_t hidden = 8;
  int blocks = 1;
  bool residualInPlace = false;  // residual_out is the residual
  bool normedInPlace = false;    // normed is the input
  bool ownResiduals = false;     // each rank's residual differs
  // The last rank's residual and weight start one element past a pack
  // boundary: it takes the element path while its peers take the pack path.
  bool misalignedLastRank = false;
  // The inputs, residuals and weights of the call before (to compare the
  // algorithms' bits on the same data).
  bool sameDataAsPrevious = false;
  float eps = 1e-5f;
  // Set by the group.
  std::vector<void*> in, residual, residualOut, weight, normed;
  std::vector<std::vector<char>> original, originalResidual;
};

std::string describe(const FusedCall& c, int n) {
  return std::string("fused ") + algorithmName(c.algorithm) + " " + dtypeName(c.dtype) +
         " n=" + std::to_string(n) + " rows=" + std::to_string(c.rows) +
         " hidden=" + std::to_string(c.hidden) + " blocks=" + std::to_string(c.blocks) +
         (c.residualInPlace ? " residual in place" : "") +
         (c.normedInPlace ? " normed in place" : "") + (c.ownResiduals ? " own residuals" : "") +
         (c.misalignedLastRank ? " last rank misaligned" : "");
}

class FusedGroup {
 public:
  FusedGroup(int n, size_t maxBytes, std::vector<FusedCall> calls)
      : n_(n), layout_(BufferLayout::forMaxBytes(maxBytes)), calls_(std::move(calls)) {
    size_t bytes = n * layout_.totalBytes + 4096;
    for (const FusedCall& c : calls_) {
      bytes += n * (5 * c.rows * c.hidden * dtypeSize(c.dtype) + 5 * 256 + 2 * 16);
    }
    arena_ = std::make_unique<Arena>(bytes);
    errors_ = static_cast<uint32_t*>(arena_->take(sizeof(uint32_t) * kMaxRanks));
    for (int r = 0; r < n; ++r)
      buffers_.push_back(static_cast<char*>(arena_->take(layout_.totalBytes)));
    std::mt19937 random(4321 + n);
    std::uniform_real_distribution<float> value(-1.f, 1.f);
    for (size_t index = 0; index < calls_.size(); ++index) {
      FusedCall& c = calls_[index];
      const size_t count = c.rows * c.hidden;
      const size_t size = count * dtypeSize(c.dtype);
      std::vector<float> sharedResidual(count), weight(c.hidden);
      for (float& v : sharedResidual) v = value(random);
      for (float& v : weight) v = 0.5f + value(random);
      for (int r = 0; r < n; ++r) {
        c.in.push_back(arena_->take(size));
        const size_t shift = c.misalignedLastRank && r == n - 1 ? dtypeSize(c.dtype) : 0;
        c.residual.push_back(static_cast<char*>(arena_->take(size + shift)) + shift);
        c.residualOut.push_back(c.residualInPlace ? c.residual[r] : arena_->take(size));
        const size_t weightBytes = c.hidden * dtypeSize(c.dtype);
        c.weight.push_back(static_cast<char*>(arena_->take(weightBytes + shift)) + shift);
        c.normed.push_back(c.normedInPlace ? c.in[r] : arena_->take(size));
        for (size_t i = 0; i < count; ++i) {
          store(c.dtype, c.in[r], i, value(random) * std::ldexp(1.f, -static_cast<int>(i % 5)));
          store(c.dtype, c.residual[r], i, c.ownResiduals ? value(random) : sharedResidual[i]);
        }
        for (size_t i = 0; i < c.hidden; ++i) store(c.dtype, c.weight[r], i, weight[i]);
        if (c.sameDataAsPrevious && index > 0) {
          const FusedCall& p = calls_[index - 1];
          std::memcpy(c.in[r], p.original[r].data(), size);
          std::memcpy(c.residual[r], p.originalResidual[r].data(), size);
          std::memcpy(c.weight[r], p.weight[r], c.hidden * dtypeSize(c.dtype));
        }
        const char* in = static_cast<const char*>(c.in[r]);
        const char* res = static_cast<const char*>(c.residual[r]);
        c.original.emplace_back(in, in + size);
        c.originalResidual.emplace_back(res, res + size);
        if (!c.residualInPlace) std::memset(c.residualOut[r], 0xA5, size);  // poison
        if (!c.normedInPlace) std::memset(c.normed[r], 0xA5, size);
      }
    }
  }

  bool run(uint64_t timeoutNs, int deadlineS = 240) {
    std::vector<int> ranks;
    for (int rank = 0; rank < n_; ++rank) ranks.push_back(rank);
    return forkRanks(ranks, deadlineS, [&](int rank) {
      for (const FusedCall& c : calls_) runCall(c, rank, timeoutNs);
    });
  }

  uint32_t error(int rank) const { return errors_[rank]; }
  const std::vector<FusedCall>& calls() const { return calls_; }
  int size() const { return n_; }

 private:
  void runCall(const FusedCall& c, int rank, uint64_t timeoutNs) {
    CustomAllreduce car(rank, n_, {buffers_.begin(), buffers_.end()}, layout_.maxBytes,
                        std::chrono::milliseconds(timeoutNs / 1000000), &errors_[rank],
                        &errors_[rank], std::make_unique<CheckedOrder>());
    CustomAllreduce::AddRmsNorm norm;
    norm.residual = c.residual[rank];
    norm.residualOut = c.residualOut[rank];
    norm.weight = c.weight[rank];
    norm.normed = c.normed[rank];
    norm.rows = c.rows;
    norm.hidden = c.hidden;
    norm.eps = c.eps;
    CallOptions options;
    options.chooseAlgorithm = false;
    options.algorithm = c.algorithm;
    options.blocks = c.blocks;
    const uint64_t launchesBefore = orderedLaunches;
    try {
      car.allreduceAddRmsNorm(c.in[rank], norm, c.dtype, nullptr, options);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
      _exit(3);
    }
    if (orderedLaunches - launchesBefore != 1) orderViolation("a launch that was not ordered");
  }

  int n_;
  BufferLayout layout_;
  std::vector<FusedCall> calls_;
  std::unique_ptr<Arena> arena_;
  uint32_t* errors_ = nullptr;
  std::vector<char*> buffers_;
};

// Checks every rank's outputs against the references described at the top.
void expectFusedResults(const FusedGroup& g) {
  const int n = g.size();
  for (const FusedCall& c : g.calls()) {
    const size_t bytes = dtypeSize(c.dtype);
    const size_t count = c.rows * c.hidden;
    // The sum every rank must have: float32 in rank order, rounded once.
    std::vector<char> sum(count * bytes);
    for (size_t i = 0; i < count; ++i) {
      float acc = 0.f;
      for (int r = 0; r < n; ++r) {
        const float v = load(c.dtype, c.original[r].data(), i);
        acc = r == 0 ? v : acc + v;
      }
      store(c.dtype, sum.data(), i, acc);
    }
    for (int r = 0; r < n; ++r) {
      std::vector<char> expected(count * bytes);
      for (size_t i = 0; i < count; ++i) {
        store(c.dtype, expected.data(), i,
              load(c.dtype, sum.data(), i) + load(c.dtype, c.originalResidual[r].data(), i));
      }
      ASSERT_EQ(std::memcmp(c.residualOut[r], expected.data(), count * bytes), 0)
          << describe(c, n) << ": rank " << r << "'s residual_out differs from sum + residual";
      for (size_t row = 0; row < c.rows; ++row) {
        double squares = 0.0;
        for (size_t j = 0; j < c.hidden; ++j) {
          const double v = load(c.dtype, expected.data(), row * c.hidden + j);
          squares += v * v;
        }
        const double inverse = 1.0 / std::sqrt(squares / static_cast<double>(c.hidden) + c.eps);
        for (size_t j = 0; j < c.hidden; ++j) {
          const size_t i = row * c.hidden + j;
          const double exact =
              load(c.dtype, expected.data(), i) * inverse * load(c.dtype, c.weight[r], j);
          const double got = load(c.dtype, c.normed[r], i);
          // float32 statistics over the row, then one rounding to the dtype.
          const double tolerance = std::fabs(exact) * (std::ldexp(1.0, -24) * (c.hidden / 8.0 + 8) +
                                                       roundingOf(c.dtype) * 2) +
                                   subnormalOf(c.dtype);
          ASSERT_LE(std::fabs(got - exact), tolerance)
              << describe(c, n) << ": rank " << r << " row " << row << " element " << j;
        }
      }
      if (!c.ownResiduals && r > 0) {
        EXPECT_EQ(std::memcmp(c.normed[r], c.normed[0], count * bytes), 0)
            << describe(c, n) << ": rank " << r << "'s normed rows differ from rank 0's";
      }
    }
  }
}

constexpr uint64_t kGenerousNs = 60ull * 1000 * 1000 * 1000;

class FusedEmulation : public ::testing::TestWithParam<int> {};

// Every dtype and algorithm (the push too); hidden sizes that are and are not multiples of
// the pack (odd ones take the element path); more rows than blocks and
// fewer; both outputs in place; ranks with their own residuals.
TEST_P(FusedEmulation, EveryDtypeAlgorithmAndHiddenSizeMatchesTheReference) {
  const int n = GetParam();
  std::vector<FusedCall> calls;
  const std::vector<std::pair<size_t, size_t>> shapes = {
      {1, 8}, {3, 13}, {2, 64}, {7, 40}, {5, 1001}};
  int variant = 0;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (Algorithm algorithm : {Algorithm::kPush, Algorithm::kOneShot, Algorithm::kTwoShot}) {
      for (const auto& [rows, hidden] : shapes) {
        FusedCall c;
        c.dtype = dtype;
        c.algorithm = algorithm;
        c.rows = rows;
        c.hidden = hidden;
        c.blocks = 1 + variant % 3;
        c.residualInPlace = variant % 2 == 0;
        c.normedInPlace = variant % 4 == 1;
        c.ownResiduals = variant % 5 == 3;
        ++variant;
        calls.push_back(c);
      }
    }
  }
  FusedGroup g(n, 64 << 10, calls);
  ASSERT_TRUE(g.run(kGenerousNs));
  for (int r = 0; r < n; ++r) EXPECT_EQ(g.error(r), 0u) << describeError(g.error(r));
  expectFusedResults(g);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, FusedEmulation, ::testing::Range(2, 9));

// A rank whose residual and weight are not pack-aligned runs the element
// path while its peers run the pack path; the row statistics must still be
// summed in one order, so that the normed rows stay bitwise equal.
TEST(FusedEmulationPaths, ARankOnTheElementPathNormsAsItsPeersOnThePackPath) {
  std::vector<FusedCall> calls;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (Algorithm algorithm : {Algorithm::kPush, Algorithm::kOneShot, Algorithm::kTwoShot}) {
      for (size_t hidden : {64, 200, 1024}) {
        FusedCall c;
        c.dtype = dtype;
        c.algorithm = algorithm;
        c.rows = 3;
        c.hidden = hidden;
        c.blocks = 2;
        c.misalignedLastRank = true;
        calls.push_back(c);
      }
    }
  }
  for (int n : {2, 3}) {
    FusedGroup g(n, 64 << 10, calls);
    ASSERT_TRUE(g.run(kGenerousNs));
    for (int r = 0; r < n; ++r) EXPECT_EQ(g.error(r), 0u) << describeError(g.error(r));
    expectFusedResults(g);
  }
}

// The fused push (its register path when a row is at most one pack per
// thread and the pointers allow packs, its general path otherwise) gives
// the fused one-shot's bits on the same data: residual_out and normed.
TEST(FusedEmulationPaths, ThePushGivesTheOneShotsBits) {
  std::vector<FusedCall> calls;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    for (const auto& [rows, hidden] :
         std::vector<std::pair<size_t, size_t>>{{1, 64}, {5, 128}, {3, 40}, {2, 1024}, {4, 13}}) {
      for (bool misaligned : {false, true}) {
        FusedCall c;
        c.dtype = dtype;
        c.rows = rows;
        c.hidden = hidden;
        c.blocks = 2;
        c.misalignedLastRank = misaligned;
        c.algorithm = Algorithm::kOneShot;
        calls.push_back(c);
        c.algorithm = Algorithm::kPush;
        c.sameDataAsPrevious = true;
        calls.push_back(c);
      }
    }
  }
  FusedGroup g(3, 64 << 10, calls);
  ASSERT_TRUE(g.run(kGenerousNs));
  for (int r = 0; r < 3; ++r) EXPECT_EQ(g.error(r), 0u) << describeError(g.error(r));
  expectFusedResults(g);
  for (size_t i = 1; i < g.calls().size(); i += 2) {
    const FusedCall& one = g.calls()[i - 1];
    const FusedCall& push = g.calls()[i];
    const size_t bytes = push.rows * push.hidden * dtypeSize(push.dtype);
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(std::memcmp(push.residualOut[r], one.residualOut[r], bytes), 0)
          << describe(push, 3) << ": rank " << r;
      EXPECT_EQ(std::memcmp(push.normed[r], one.normed[r], bytes), 0)
          << describe(push, 3) << ": rank " << r;
    }
  }
}

// The host refuses what the kernel cannot do, before anything is launched.
TEST(FusedEmulationRefusal, OverlapsEpsAndZeroCopyAreRefused) {
  const BufferLayout layout = BufferLayout::forMaxBytes(4096);
  std::vector<char> own(layout.totalBytes), peer(layout.totalBytes);
  uint32_t error = 0;
  CustomAllreduce car(0, 2, {own.data(), peer.data()}, layout.maxBytes,
                      std::chrono::milliseconds(100), &error, &error,
                      std::make_unique<CheckedOrder>());
  alignas(16) float in[64], residual[64], out[64], normed[64], weight[16];
  CustomAllreduce::AddRmsNorm norm;
  norm.residual = residual;
  norm.residualOut = out;
  norm.weight = weight;
  norm.normed = normed;
  norm.rows = 4;
  norm.hidden = 16;
  auto refused = [&](const CustomAllreduce::AddRmsNorm& bad, const CallOptions& options,
                     const std::string& what) {
    try {
      car.allreduceAddRmsNorm(in, bad, DType::kFloat32, nullptr, options);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "not refused: " << what;
  };
  CustomAllreduce::AddRmsNorm bad = norm;
  bad.normed = residual;
  refused(bad, {}, "normed overlaps the residual");
  bad = norm;
  bad.residualOut = in + 1;
  refused(bad, {}, "without being the same memory");
  bad = norm;
  bad.eps = -1.f;
  refused(bad, {}, "eps");
  bad = norm;
  bad.hidden = 0;
  refused(bad, {}, "hidden size 0");
  bad = norm;
  bad.rows = 1000;
  refused(bad, {}, "exceed the custom maximum");
  CallOptions zeroCopy;
  zeroCopy.stageInput = false;
  refused(norm, zeroCopy, "always stages");
  EXPECT_EQ(orderState, OrderState::kIdle);
}

}  // namespace
}  // namespace tpcomm::car
