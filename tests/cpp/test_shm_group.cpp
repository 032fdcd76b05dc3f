// The shared-memory collectives (message_queue/shm_group.hpp) with a forked
// process per rank: every op, dtype and reduction against a rank-order
// reference (bit for bit) and float64 (within rounding), sizes around the
// chunk and slice boundaries, mismatched calls, a killed rank (left a
// zombie), a rank that never arrives, more ranks than cores, and the CPU an
// idle waiter burns.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "coordinator/common/error.hpp"
#include "message_queue/shm_group.hpp"
#include "message_queue/worker_pool.hpp"

namespace tpcomm::mq {
namespace {

using namespace std::chrono_literals;

// Runs body(group) in `size` forked processes over one fresh region; returns
// each child's exit status (0: every check passed).
std::vector<int> runRanks(int size, const ShmGroupOptions& base,
                          const std::function<int(ShmGroup&)>& body,
                          const std::function<void(std::vector<pid_t>&)>& meanwhile = {}) {
  const size_t bytes = ShmGroup::regionBytes(size, base.bufferBytes);
  auto region = SharedRegion::create(bytes);
  ShmGroup::initRegion(region->base(), size, base.bufferBytes, base.twoPhaseMinBytes);
  const pid_t parent = ::getpid();
  std::vector<pid_t> pids(size);
  for (int r = 0; r < size; ++r) {
    pids[r] = ::fork();
    if (pids[r] == 0) {
      int status = 90;
      try {
        ShmGroupOptions options = base;
        options.rank = r;
        options.size = size;
        auto mine = SharedRegion::attach(parent, region->fd(), bytes);  // through /proc
        std::vector<int32_t> ids;
        // A child knows the pids forked before it; later ones count as alive.
        for (int k = 0; k < size; ++k) ids.push_back(k < r ? pids[k] : 0);
        ShmGroup group(std::move(mine), options, ids);
        status = body(group);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        status = 91;
      }
      ::_exit(status);
    }
  }
  if (meanwhile) meanwhile(pids);
  std::vector<int> codes;
  for (pid_t p : pids) {
    int status = 0;
    ::waitpid(p, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  return codes;
}

size_t sizeOf(DType d) { return dtypeBytes(d); }

// Rank r's input element i, stored in dtype d.
void makeInput(DType d, int r, size_t count, std::vector<char>& out, bool small) {
  out.assign(count * sizeOf(d), 0);
  for (size_t i = 0; i < count; ++i) {
    const int64_t raw = static_cast<int64_t>((r * 7919 + i * 104729 + 13) % 2001) - 1000;
    const double v = small ? static_cast<double>(raw % 3 + (raw % 3 == 0 ? 2 : 0)) : raw / 64.0;
    char* p = out.data() + i * sizeOf(d);
    switch (d) {
      case DType::kFloat32: {
        const float f = static_cast<float>(v);
        std::memcpy(p, &f, 4);
        break;
      }
      case DType::kFloat64:
        std::memcpy(p, &v, 8);
        break;
      case DType::kBFloat16: {
        const uint16_t h = floatToBf16(static_cast<float>(v));
        std::memcpy(p, &h, 2);
        break;
      }
      case DType::kFloat16: {
        const uint16_t h = floatToFp16(static_cast<float>(v));
        std::memcpy(p, &h, 2);
        break;
      }
      case DType::kInt32: {
        const int32_t x = static_cast<int32_t>(raw);
        std::memcpy(p, &x, 4);
        break;
      }
      case DType::kInt64: {
        const int64_t x = raw * 1000003;
        std::memcpy(p, &x, 8);
        break;
      }
    }
  }
}

double loadAsDouble(DType d, const char* p) {
  switch (d) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kFloat64: {
      double v;
      std::memcpy(&v, p, 8);
      return v;
    }
    case DType::kBFloat16:
    case DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return d == DType::kBFloat16 ? bf16ToFloat(h) : fp16ToFloat(h);
    }
    case DType::kInt32: {
      int32_t x;
      std::memcpy(&x, p, 4);
      return x;
    }
    case DType::kInt64: {
      int64_t x;
      std::memcpy(&x, p, 8);
      return static_cast<double>(x);
    }
  }
  return 0;
}

// The promised result, written independently of shm_reduce.cpp's loops:
// rank-order accumulation in float (16-bit and float32), double (float64)
// or wrapping integers, one rounding at the end.
void reference(DType d, const ReduceSpec& spec, int size, size_t count, bool small,
               std::vector<char>& out, std::vector<double>& exact) {
  std::vector<std::vector<char>> in(size);
  for (int r = 0; r < size; ++r) {
    makeInput(d, r, count, in[r], small);
    if (spec.premultiply) copyScaled(in[r].data(), in[r].data(), count, d, spec);
  }
  out.assign(count * sizeOf(d), 0);
  exact.assign(count, 0);
  const bool integral = d == DType::kInt32 || d == DType::kInt64;
  for (size_t i = 0; i < count; ++i) {
    const size_t at = i * sizeOf(d);
    if (integral) {
      int64_t acc = 0;
      uint64_t uacc = 0;
      for (int r = 0; r < size; ++r) {
        int64_t x;
        if (d == DType::kInt32) {
          int32_t y;
          std::memcpy(&y, in[r].data() + at, 4);
          x = y;
        } else {
          std::memcpy(&x, in[r].data() + at, 8);
        }
        const uint64_t ux = static_cast<uint64_t>(x);
        if (r == 0) {
          uacc = ux;
          acc = x;
          continue;
        }
        switch (spec.kind) {
          case ReduceKind::kSum:
            uacc += ux;
            break;
          case ReduceKind::kProduct:
            uacc *= ux;
            break;
          case ReduceKind::kMin:
            acc = std::min(acc, x);
            break;
          case ReduceKind::kMax:
            acc = std::max(acc, x);
            break;
        }
      }
      int64_t v =
          (spec.kind == ReduceKind::kSum || spec.kind == ReduceKind::kProduct)
              ? (d == DType::kInt32 ? static_cast<int32_t>(uacc) : static_cast<int64_t>(uacc))
              : acc;
      if (spec.divisor != 1) v /= spec.divisor;
      if (d == DType::kInt32) {
        const int32_t y = static_cast<int32_t>(v);
        std::memcpy(out.data() + at, &y, 4);
      } else {
        std::memcpy(out.data() + at, &v, 8);
      }
      exact[i] = static_cast<double>(v);
      continue;
    }
    double accD = 0, ex = 0;
    float accF = 0;
    for (int r = 0; r < size; ++r) {
      const double x = loadAsDouble(d, in[r].data() + at);
      const float xf = static_cast<float>(x);
      if (r == 0) {
        accD = x, accF = xf, ex = x;
        continue;
      }
      switch (spec.kind) {
        case ReduceKind::kSum:
          accD += x, accF += xf, ex += x;
          break;
        case ReduceKind::kProduct:
          accD *= x, accF *= xf, ex *= x;
          break;
        case ReduceKind::kMin:
          accD = std::min(accD, x), accF = std::min(accF, xf), ex = std::min(ex, x);
          break;
        case ReduceKind::kMax:
          accD = std::max(accD, x), accF = std::max(accF, xf), ex = std::max(ex, x);
          break;
      }
    }
    if (spec.divisor != 1) accD /= spec.divisor, accF /= spec.divisor, ex /= spec.divisor;
    exact[i] = ex;
    char* p = out.data() + at;
    if (d == DType::kFloat64) {
      std::memcpy(p, &accD, 8);
    } else if (d == DType::kFloat32) {
      std::memcpy(p, &accF, 4);
    } else {
      const uint16_t h = d == DType::kBFloat16 ? floatToBf16(accF) : floatToFp16(accF);
      std::memcpy(p, &h, 2);
    }
  }
}

double tolerance(DType d) {
  switch (d) {
    case DType::kBFloat16:
      return 1.0 / 128;
    case DType::kFloat16:
      return 1.0 / 1024;
    case DType::kFloat32:
      return 1e-6;
    default:
      return 1e-12;
  }
}

#define CHILD_CHECK(cond, ...)                \
  do {                                        \
    if (!(cond)) {                            \
      std::fprintf(stderr, __VA_ARGS__);      \
      std::fprintf(stderr, " [%s]\n", #cond); \
      return 1;                               \
    }                                         \
  } while (0)

const std::vector<DType> kDtypes = {DType::kFloat32, DType::kFloat64, DType::kBFloat16,
                                    DType::kFloat16, DType::kInt32,   DType::kInt64};

std::vector<ReduceSpec> specsFor(DType d, int size) {
  std::vector<ReduceSpec> specs;
  for (auto kind : {ReduceKind::kSum, ReduceKind::kProduct, ReduceKind::kMin, ReduceKind::kMax}) {
    ReduceSpec s;
    s.kind = kind;
    specs.push_back(s);
  }
  ReduceSpec avg;
  avg.divisor = size;
  specs.push_back(avg);
  if (d != DType::kInt32 && d != DType::kInt64) {
    ReduceSpec premul;
    premul.premultiply = true;
    premul.scale = 0.375;
    specs.push_back(premul);
  }
  return specs;
}

// Every op at the counts that cross the chunk and slice boundaries.
int exerciseEverything(ShmGroup& g) {
  const int n = g.options().size, me = g.options().rank;
  const size_t buffer = g.options().bufferBytes;
  for (DType d : kDtypes) {
    const size_t e = sizeOf(d);
    const size_t chunk = buffer / e;
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, chunk - 1, chunk, chunk + 1,
                         3 * chunk + 5, 64 / e * n + 3}) {
      for (const ReduceSpec& spec : specsFor(d, n)) {
        const bool small = spec.kind == ReduceKind::kProduct;
        std::vector<char> in, out, want;
        std::vector<double> exact;
        makeInput(d, me, count, in, small);
        reference(d, spec, n, count, small, want, exact);
        const bool inPlace = count % 2 == 1;
        out = inPlace ? in : std::vector<char>(in.size(), 0x5a);
        g.allreduce(in.data(), out.data(), count, d, spec);
        CHILD_CHECK(std::memcmp(out.data(), want.data(), want.size()) == 0,
                    "allreduce %s %s count %zu (n=%d) differs from the rank-order reference",
                    dtypeName(d), reduceKindName(spec.kind), count, n);
        if (spec.kind == ReduceKind::kSum) {
          for (size_t i = 0; i < count; ++i) {
            const double got = loadAsDouble(d, out.data() + i * e);
            CHILD_CHECK(std::fabs(got - exact[i]) <= tolerance(d) * (1 + std::fabs(exact[i])),
                        "allreduce %s element %zu: %g vs float64 %g", dtypeName(d), i, got,
                        exact[i]);
          }
        }
      }
      // reduce-scatter: rank r's input holds n pieces of `count`; piece p of
      // rank r is what allreduce inputs of "rank r, offset p*count" would be.
      ReduceSpec sum;
      std::vector<char> full, rsOut(count * e, 0x11), want;
      std::vector<double> exact;
      makeInput(d, me, count * n, full, false);
      std::vector<const void*> ins;
      for (int p = 0; p < n; ++p) ins.push_back(full.data() + p * count * e);
      g.reduceScatter(ins, rsOut.data(), count, d, sum);
      // Reference: the allreduce of the whole inputs, then my piece.
      reference(d, sum, n, count * n, false, want, exact);
      CHILD_CHECK(std::memcmp(rsOut.data(), want.data() + me * count * e, count * e) == 0,
                  "reduce_scatter %s count %zu differs", dtypeName(d), count);
    }
  }
  for (size_t bytes : {size_t{0}, size_t{1}, buffer - 1, buffer, buffer + 1, 2 * buffer + 17}) {
    std::vector<char> mine(bytes);
    for (size_t i = 0; i < bytes; ++i) mine[i] = static_cast<char>(me * 31 + i);
    std::vector<std::vector<char>> gathered(n, std::vector<char>(bytes, 0));
    std::vector<void*> outs;
    for (auto& v : gathered) outs.push_back(v.data());
    g.allgather(mine.data(), bytes, outs);
    for (int r = 0; r < n; ++r) {
      for (size_t i = 0; i < bytes; ++i)
        CHILD_CHECK(gathered[r][i] == static_cast<char>(r * 31 + i), "all_gather %zu bytes", bytes);
    }
    for (int root = 0; root < n; ++root) {
      std::vector<char> data(bytes, 0);
      if (me == root)
        for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<char>(root * 17 + i);
      g.broadcast(data.data(), bytes, root);
      for (size_t i = 0; i < bytes; ++i)
        CHILD_CHECK(data[i] == static_cast<char>(root * 17 + i), "broadcast %zu from %d", bytes,
                    root);
    }
    g.barrier();
  }
  return 0;
}

ShmGroupOptions smallBuffers(uint64_t twoPhase) {
  ShmGroupOptions o;
  o.bufferBytes = 256;  // every op spans many chunks
  o.twoPhaseMinBytes = twoPhase;
  o.timeout = 60s;
  return o;
}

class ShmGroupSizes : public ::testing::TestWithParam<int> {};

TEST_P(ShmGroupSizes, EveryOpDtypeAndReductionMatchesTheReferenceOneShot) {
  for (int code : runRanks(GetParam(), smallBuffers(1ull << 40), exerciseEverything))
    EXPECT_EQ(code, 0);
}

TEST_P(ShmGroupSizes, EveryOpDtypeAndReductionMatchesTheReferenceTwoPhase) {
  for (int code : runRanks(GetParam(), smallBuffers(1), exerciseEverything)) EXPECT_EQ(code, 0);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmGroupSizes, ::testing::Values(1, 2, 3, 4, 5, 8));

TEST(ShmGroup, DefaultBuffersLargeAllreduceBothAlgorithms) {
  ShmGroupOptions o;
  o.timeout = 60s;
  const auto body = [](ShmGroup& g) {
    const int n = g.options().size;
    const size_t count = (3u << 20) / 4 + 3;  // 3 MiB of float32: several 1 MiB chunks
    ReduceSpec sum;
    std::vector<char> in, want;
    std::vector<double> exact;
    makeInput(DType::kFloat32, g.options().rank, count, in, false);
    reference(DType::kFloat32, sum, n, count, false, want, exact);
    std::vector<char> out(in.size());
    g.allreduce(in.data(), out.data(), count, DType::kFloat32, sum);
    CHILD_CHECK(std::memcmp(out.data(), want.data(), want.size()) == 0, "3 MiB allreduce");
    return 0;
  };
  for (int code : runRanks(3, o, body)) EXPECT_EQ(code, 0);
}

// Large calls split among worker threads give the bits of one thread: the
// rank-order reference for allreduce and reduce-scatter, the inputs for
// all-gather and broadcast, one- and two-phase, in and out of place.
TEST(ShmGroup, WorkerThreadsGiveTheBitsOfOneThread) {
  for (int threads : {1, 3}) {
    for (uint64_t twoPhase : {uint64_t{1} << 40, uint64_t{16} << 10}) {
      ShmGroupOptions o;
      o.timeout = 60s;
      o.threads = threads;
      o.twoPhaseMinBytes = twoPhase;
      const auto body = [threads](ShmGroup& g) {
        const int n = g.options().size;
        const int me = g.options().rank;
        CHILD_CHECK(g.threads() == threads, "threads %d", g.threads());
        for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kInt64}) {
          const size_t count = (5u << 20) / dtypeBytes(d) / 2 + 7;  // 2.5 MiB: three chunks
          ReduceSpec sum;
          std::vector<char> in, want;
          std::vector<double> exact;
          makeInput(d, me, count, in, false);
          reference(d, sum, n, count, false, want, exact);
          std::vector<char> out(in.size());
          g.allreduce(in.data(), out.data(), count, d, sum);
          CHILD_CHECK(std::memcmp(out.data(), want.data(), want.size()) == 0, "allreduce %s",
                      dtypeName(d));
          g.allreduce(in.data(), in.data(), count, d, sum);  // in place
          CHILD_CHECK(std::memcmp(in.data(), want.data(), want.size()) == 0,
                      "in-place allreduce %s", dtypeName(d));
          // Reduce-scatter: rank r's input holds n slices; slice j of every
          // rank is reduced into rank j's output.
          std::vector<std::vector<char>> slices(n), wants(n);
          std::vector<const void*> ins;
          for (int j = 0; j < n; ++j) makeInput(d, me + 7 * j, count / n, slices[j], false);
          for (int j = 0; j < n; ++j) ins.push_back(slices[j].data());
          std::vector<char> scattered(count / n * dtypeBytes(d));
          g.reduceScatter(ins, scattered.data(), count / n, d, sum);
          // The reference of slice `me`: every rank r contributed makeInput(r + 7 me).
          std::vector<std::vector<char>> theirs(n);
          std::vector<const void*> srcs;
          for (int r = 0; r < n; ++r) {
            makeInput(d, r + 7 * me, count / n, theirs[r], false);
            srcs.push_back(theirs[r].data());
          }
          std::vector<char> expected(scattered.size());
          reduceIntoWith(ReduceIsa::kPortable, expected.data(), srcs.data(), n, count / n, d, sum);
          CHILD_CHECK(std::memcmp(scattered.data(), expected.data(), expected.size()) == 0,
                      "reduce_scatter %s", dtypeName(d));
        }
        const size_t bytes = (3u << 20) + 100;
        std::vector<char> mine(bytes), all(bytes * n);
        for (size_t i = 0; i < bytes; ++i) mine[i] = static_cast<char>(i * 31 + me * 7);
        std::vector<void*> outs;
        for (int r = 0; r < n; ++r) outs.push_back(all.data() + r * bytes);
        g.allgather(mine.data(), bytes, outs);
        for (int r = 0; r < n; ++r) {
          for (size_t i = 0; i < bytes; i += 4099) {
            CHILD_CHECK(all[r * bytes + i] == static_cast<char>(i * 31 + r * 7), "all_gather");
          }
        }
        g.allgather(all.data() + me * bytes, bytes, outs);  // in place
        CHILD_CHECK(all[me * bytes + 5] == static_cast<char>(5 * 31 + me * 7), "in place");
        g.broadcast(mine.data(), bytes, 1);
        for (size_t i = 0; i < bytes; i += 4099) {
          CHILD_CHECK(mine[i] == static_cast<char>(i * 31 + 7), "broadcast");
        }
        return 0;
      };
      for (int code : runRanks(3, o, body)) EXPECT_EQ(code, 0) << threads << " threads";
    }
  }
}

TEST(WorkerPool, RunsEveryPartOnceAndRethrowsAPartsError) {
  WorkerPool pool(4);
  EXPECT_EQ(pool.threads(), 4);
  for (int round = 0; round < 200; ++round) {
    std::vector<std::atomic<int>> hits(1 + round % 9);
    pool.run(hits.size(), [&](size_t p) { hits[p].fetch_add(1); });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1) << round;
  }
  EXPECT_THROW(pool.run(6,
                        [](size_t p) {
                          if (p == 4) throw std::runtime_error("part 4");
                        }),
               std::runtime_error);
  std::atomic<int> after{0};
  pool.run(5, [&](size_t) { after.fetch_add(1); });
  EXPECT_EQ(after.load(), 5);
}

TEST(ShmGroup, MismatchedCallsRaiseOnEveryRankAndTheGroupStaysUsable) {
  const auto body = [](ShmGroup& g) {
    const int me = g.options().rank;
    std::vector<float> x(me == 1 ? 5 : 4, 1.0f);
    try {
      g.allreduce(x.data(), x.data(), x.size(), DType::kFloat32, ReduceSpec{});
      return 2;
    } catch (const Error& e) {
      CHILD_CHECK(e.code() == ErrorCode::kInvalidUsage, "code");
      const std::string what = e.what();
      CHILD_CHECK(what.find("rank 1 called allreduce sum float32[5]") != std::string::npos &&
                      what.find("rank 0 called allreduce sum float32[4]") != std::string::npos,
                  "message: %s", what.c_str());
    }
    std::vector<float> y(4, static_cast<float>(me + 1));
    g.allreduce(y.data(), y.data(), y.size(), DType::kFloat32, ReduceSpec{});
    CHILD_CHECK(y[0] == 6.0f, "after the mismatch: %g", y[0]);
    // Calls that use different numbers of chunks (a barrier against an
    // allreduce, a size of 0 against 100): the ranks must still agree on
    // which buffer half the next chunks use.
    for (int round = 0; round < 2; ++round) {
      std::vector<float> z(100, 1.0f);
      try {
        if (round == 0 && me == 0) {
          g.barrier();
        } else {
          g.allreduce(z.data(), z.data(), me == 2 && round == 1 ? 0 : z.size(), DType::kFloat32,
                      ReduceSpec{});
        }
        return 5;
      } catch (const Error& e) {
        CHILD_CHECK(e.code() == ErrorCode::kInvalidUsage, "round %d: %s", round, e.what());
      }
      for (int i = 0; i < 5; ++i) {  // several chunks of 64 floats each, both halves
        std::vector<float> v(64 * 3 + i, static_cast<float>(me + i));
        g.allreduce(v.data(), v.data(), v.size(), DType::kFloat32, ReduceSpec{});
        const float want = static_cast<float>(3 * i + 3);
        for (float x : v) CHILD_CHECK(x == want, "round %d call %d: %g vs %g", round, i, x, want);
      }
    }
    return 0;
  };
  for (int code : runRanks(3, smallBuffers(1ull << 40), body)) EXPECT_EQ(code, 0);
}

TEST(ShmGroup, CoalescedPositionsAndTheFusedEpsArePartOfTheSignature) {
  const auto body = [](ShmGroup& g) {
    const int me = g.options().rank;
    // Rank 1's coalesced list is one tensor longer: its first tensor pairs
    // with rank 0's first only by size, which is not enough.
    std::vector<float> x(16, 1.0f);
    try {
      g.allreduce(x.data(), x.data(), x.size(), DType::kFloat32, ReduceSpec{},
                  ShmPart{0, me == 1 ? 3u : 2u});
      return 2;
    } catch (const Error& e) {
      CHILD_CHECK(e.code() == ErrorCode::kInvalidUsage, "code");
      const std::string what = e.what();
      CHILD_CHECK(what.find("tensor 1 of a coalesced list of 3") != std::string::npos &&
                      what.find("tensor 1 of a coalesced list of 2") != std::string::npos,
                  "message: %s", what.c_str());
    }
    std::vector<float> gathered(32);
    try {
      g.allgather(x.data(), 64, {gathered.data(), gathered.data() + 16},
                  ShmPart{me == 0 ? 1u : 0u, 2});
      return 3;
    } catch (const Error& e) {
      CHILD_CHECK(std::string(e.what()).find("tensor 2 of a coalesced list") != std::string::npos,
                  "message: %s", e.what());
    }
    // The fused call with another eps on rank 1.
    const size_t hidden = 8;
    std::vector<float> in(hidden, 1.0f), residual(hidden, 0.5f), weight(hidden, 1.0f);
    std::vector<float> normed(hidden), residualOut(hidden);
    NormRows norm;
    norm.residual = residual.data();
    norm.residualOut = residualOut.data();
    norm.weight = weight.data();
    norm.normed = normed.data();
    norm.hidden = hidden;
    norm.eps = me == 1 ? 1e-5 : 1e-6;
    try {
      g.allreduceAddRmsNorm(in.data(), 1, DType::kFloat32, norm);
      return 4;
    } catch (const Error& e) {
      const std::string what = e.what();
      CHILD_CHECK(what.find("eps 1e-05") != std::string::npos &&
                      what.find("eps 1e-06") != std::string::npos,
                  "message: %s", what.c_str());
    }
    // Equal places and eps: served, and the group stays usable.
    std::vector<float> y(16, static_cast<float>(me + 1));
    g.allreduce(y.data(), y.data(), y.size(), DType::kFloat32, ReduceSpec{}, ShmPart{1, 2});
    CHILD_CHECK(y[0] == 3.0f, "after the mismatches: %g", y[0]);
    norm.eps = 1e-6;
    g.allreduceAddRmsNorm(in.data(), 1, DType::kFloat32, norm);
    CHILD_CHECK(residualOut[0] == 2.5f, "fused after the mismatches: %g", residualOut[0]);
    return 0;
  };
  for (int code : runRanks(2, smallBuffers(1ull << 40), body)) EXPECT_EQ(code, 0);
}

TEST(ShmGroup, APeerWhoseMainThreadEndedWhileAnotherThreadRunsIsAlive) {
  ShmGroupOptions o = smallBuffers(1ull << 40);
  o.timeout = 60s;
  const auto body = [](ShmGroup& g) {
    if (g.options().rank == 0) {
      std::thread([&g] {
        std::this_thread::sleep_for(300ms);  // the peer sleeps, checking liveness meanwhile
        float x = 1.0f;
        try {
          g.allreduce(&x, &x, 1, DType::kFloat32, ReduceSpec{});
        } catch (const std::exception& e) {
          std::fprintf(stderr, "rank 0's thread: %s\n", e.what());
          ::_exit(3);
        }
        ::_exit(x == 3.0f ? 0 : 4);
      }).detach();
      ::syscall(SYS_exit, 0);  // ends this thread only (no unwinding, no exit_group)
    }
    float x = 2.0f;
    g.allreduce(&x, &x, 1, DType::kFloat32, ReduceSpec{});
    CHILD_CHECK(x == 3.0f, "sum %g", x);
    return 0;
  };
  for (int code : runRanks(2, o, body)) EXPECT_EQ(code, 0);
}

TEST(ShmGroup, ARankThatDestroysItsGroupIsNamedByItsPeersAtOnce) {
  ShmGroupOptions o = smallBuffers(1ull << 40);
  o.timeout = 60s;  // far longer than the test may take
  const size_t bytes = ShmGroup::regionBytes(3, o.bufferBytes);
  auto region = SharedRegion::create(bytes);
  ShmGroup::initRegion(region->base(), 3, o.bufferBytes, o.twoPhaseMinBytes);
  const pid_t parent = ::getpid();
  std::vector<pid_t> pids;
  for (int r = 0; r < 3; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      int status = 0;
      try {
        ShmGroupOptions options = o;
        options.rank = r;
        options.size = 3;
        auto group = std::make_unique<ShmGroup>(SharedRegion::attach(parent, region->fd(), bytes),
                                                options, std::vector<int32_t>(3, 0));
        float x = 1.0f;
        group->allreduce(&x, &x, 1, DType::kFloat32, ReduceSpec{});
        if (r == 2) {
          group.reset();  // leaves, and stays alive
          std::this_thread::sleep_for(3s);
          ::_exit(0);
        }
        const auto start = std::chrono::steady_clock::now();
        try {
          group->allreduce(&x, &x, 1, DType::kFloat32, ReduceSpec{});
          status = 10;
        } catch (const Error& e) {
          const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                               .count();
          const std::string what = e.what();
          if (e.code() != ErrorCode::kPeerLost || what.find("rank 2 left the group") ==
                                                      std::string::npos) {
            std::fprintf(stderr, "rank %d: %s\n", r, what.c_str());
            status = 11;
          } else if (s > 1.0) {
            std::fprintf(stderr, "rank %d raised after %.2f s\n", r, s);
            status = 12;
          }
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        status = 13;
      }
      ::_exit(status);
    }
    pids.push_back(pid);
  }
  for (pid_t p : pids) {
    int status = 0;
    ::waitpid(p, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
}

TEST(ShmGroup, CallsInAForkedChildRaiseEvenWhileTheParentHoldsTheLock) {
  ShmGroupOptions o = smallBuffers(1ull << 40);
  o.timeout = 60s;
  const auto body = [](ShmGroup& g) {
    const int me = g.options().rank;
    float x = 1.0f;
    g.allreduce(&x, &x, 1, DType::kFloat32, ReduceSpec{});
    if (me == 1) std::this_thread::sleep_for(500ms);  // rank 0's call waits, holding its lock
    std::thread waiting;
    if (me == 0) {
      waiting = std::thread([&g] {
        float y = 1.0f;
        g.allreduce(&y, &y, 1, DType::kFloat32, ReduceSpec{});
      });
      std::this_thread::sleep_for(100ms);
      const pid_t child = ::fork();
      if (child == 0) {
        float z = 5.0f;
        try {
          g.allreduce(&z, &z, 1, DType::kFloat32, ReduceSpec{});
          ::_exit(20);
        } catch (const Error& e) {
          const bool named = e.code() == ErrorCode::kInvalidUsage &&
                             std::string(e.what()).find("forked") != std::string::npos;
          ::_exit(named && z == 5.0f ? 0 : 21);
        }
      }
      int status = 0;
      ::waitpid(child, &status, 0);
      CHILD_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "forked child: %d", status);
      waiting.join();
    } else {
      float y = 1.0f;
      g.allreduce(&y, &y, 1, DType::kFloat32, ReduceSpec{});
    }
    // The child's attempt changed nothing: the group goes on.
    float w = static_cast<float>(me + 1);
    g.allreduce(&w, &w, 1, DType::kFloat32, ReduceSpec{});
    CHILD_CHECK(w == 3.0f, "after the fork: %g", w);
    return 0;
  };
  for (int code : runRanks(2, o, body)) EXPECT_EQ(code, 0);
}

TEST(ShmGroup, AKilledRankMakesTheOthersRaiseNamingIt) {
  ShmGroupOptions o = smallBuffers(1ull << 40);
  o.timeout = 60s;  // far longer than the test may take: death must be noticed
  const auto body = [](ShmGroup& g) {
    if (g.options().rank == 1) {
      ::pause();  // killed by the parent, which reaps it only at the end (a zombie)
      return 3;
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      g.barrier();
      return 2;
    } catch (const Error& e) {
      const auto took = std::chrono::steady_clock::now() - start;
      CHILD_CHECK(e.code() == ErrorCode::kPeerLost, "code %d: %s", static_cast<int>(e.code()),
                  e.what());
      CHILD_CHECK(took < 10s, "took too long");
      const std::string what = e.what();
      CHILD_CHECK(what.find("rank 1") != std::string::npos, "message: %s", what.c_str());
    }
    try {  // later calls fail at once
      g.barrier();
      return 4;
    } catch (const Error& e) {
      CHILD_CHECK(e.code() == ErrorCode::kPeerLost, "later call");
    }
    return 0;
  };
  // Children learn only the pids forked before them; rank 1's must be known
  // to rank 2, so the killed rank is 1 and rank 2 checks it (rank 0 learns it
  // through rank 2's failure in the header).
  const auto codes = runRanks(3, o, body, [](std::vector<pid_t>& pids) {
    std::this_thread::sleep_for(300ms);
    ::kill(pids[1], SIGKILL);
  });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(codes[1], 128 + SIGKILL);
  EXPECT_EQ(codes[2], 0);
}

TEST(ShmGroup, ARankThatNeverArrivesTimesOutAndThePeerLearnsIt) {
  ShmGroupOptions o = smallBuffers(1ull << 40);
  o.timeout = 1s;
  const auto body = [](ShmGroup& g) {
    if (g.options().rank == 1) {
      std::this_thread::sleep_for(3s);
      try {
        g.barrier();
        return 2;
      } catch (const Error& e) {
        CHILD_CHECK(e.code() == ErrorCode::kPeerLost, "late rank: %s", e.what());
        CHILD_CHECK(std::string(e.what()).find("timed out") != std::string::npos, "%s", e.what());
      }
      return 0;
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      g.barrier();
      return 3;
    } catch (const Error& e) {
      CHILD_CHECK(e.code() == ErrorCode::kTimeout, "%s", e.what());
      CHILD_CHECK(std::string(e.what()).find("ranks 1 did not reach barrier") != std::string::npos,
                  "%s", e.what());
      CHILD_CHECK(std::chrono::steady_clock::now() - start < 2s, "bounded by 2x the timeout");
    }
    return 0;
  };
  for (int code : runRanks(2, o, body)) EXPECT_EQ(code, 0);
}

TEST(ShmGroup, MoreRanksThanCoresProgressWithAndWithoutSpinning) {
  for (auto spin : {0us, 50us}) {
    ShmGroupOptions o;
    o.spin = spin;
    o.timeout = 60s;
    const auto body = [](ShmGroup& g) {
      std::vector<float> x(64);
      for (int i = 0; i < 2000; ++i) {
        std::fill(x.begin(), x.end(), 1.0f);
        g.allreduce(x.data(), x.data(), x.size(), DType::kFloat32, ReduceSpec{});
        CHILD_CHECK(x[63] == static_cast<float>(g.options().size), "iteration %d", i);
      }
      return 0;
    };
    for (int code : runRanks(8, o, body)) EXPECT_EQ(code, 0);
  }
}

TEST(ShmGroup, AnIdleWaiterSleepsInsteadOfBurningACore) {
  ShmGroupOptions o;
  o.timeout = 30s;
  const auto body = [](ShmGroup& g) {
    if (g.options().rank == 1) std::this_thread::sleep_for(1s);
    struct rusage before, after;
    ::getrusage(RUSAGE_SELF, &before);
    g.barrier();
    ::getrusage(RUSAGE_SELF, &after);
    const auto cpu = [](const struct rusage& u) {
      return u.ru_utime.tv_sec + u.ru_stime.tv_sec +
             (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
    };
    // Rank 0 waited ~1 s for rank 1: at most a few percent of it on the CPU.
    if (g.options().rank == 0)
      CHILD_CHECK(cpu(after) - cpu(before) < 0.05, "waiting 1 s cost %.3f s of CPU",
                  cpu(after) - cpu(before));
    return 0;
  };
  for (int code : runRanks(2, o, body)) EXPECT_EQ(code, 0);
}

TEST(ShmReduce, SixteenBitConversionsRoundToNearestEven) {
  EXPECT_EQ(floatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(floatToBf16(1.0f + 1.0f / 256), 0x3f80);  // tie: to even
  EXPECT_EQ(floatToBf16(1.0f + 3.0f / 256), 0x3f82);  // tie: to even (up)
  EXPECT_EQ(floatToBf16(std::nanf("")) & 0x7fc0, 0x7fc0);
  EXPECT_EQ(floatToFp16(1.0f), 0x3c00);
  EXPECT_EQ(floatToFp16(65504.0f), 0x7bff);
  EXPECT_EQ(floatToFp16(70000.0f), 0x7c00);                // overflow: inf
  EXPECT_EQ(floatToFp16(1.0f + 1.0f / 2048), 0x3c00);      // tie: to even
  EXPECT_EQ(floatToFp16(5.960464477539063e-08f), 0x0001);  // smallest subnormal
  EXPECT_EQ(floatToFp16(-2.0f), 0xc000);
  EXPECT_TRUE(std::isnan(fp16ToFloat(0x7e00)));
  EXPECT_EQ(fp16ToFloat(0x0001), 5.960464477539063e-08f);
  EXPECT_EQ(fp16ToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(bf16ToFloat(0xc040), -3.0f);
  for (uint32_t h = 0; h < 0x10000; ++h) {  // every finite half round-trips
    const float f = fp16ToFloat(static_cast<uint16_t>(h));
    if (!std::isnan(f)) ASSERT_EQ(floatToFp16(f), h) << h;
  }
}

}  // namespace
}  // namespace tpcomm::mq
