// The shared-memory collectives (message_queue/collectives/shm_group.hpp) with a forked
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

#include "common/error.hpp"
#include "message_queue/collectives/shm_group.hpp"
#include "shm_group_support.hpp"

namespace tpcomm::mq {
namespace {

using namespace std::chrono_literals;
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

// The two-phase allreduce's pipeline (shm_group.hpp: a rank copies in chunk
// j into the slot its peers may still copy chunk j - 2 out of) with one rank
// stopped and resumed at arbitrary points: every call still gives the
// rank-order reference, bit for bit, in place and not, SUM and PREMUL_SUM
// (whose own slice comes from the output). With a rank's own slice copied
// into its slot too, this test fails (seen: 2 runs of 2).
TEST(ShmGroup, APipelinedAllreduceWithARankHeldBackAtRandomPointsGivesTheReference) {
  ShmGroupOptions o;
  o.bufferBytes = 4096;  // 1,024 floats a chunk: every call below is a pipeline of 6
  o.twoPhaseMinBytes = 1;
  o.spin = 0us;  // more ranks than cores here: sleep at once
  o.timeout = 60s;
  const auto body = [](ShmGroup& g) {
    const int n = g.options().size, me = g.options().rank;
    const size_t count = 5 * 1024 + 700;  // a last chunk of other slices than the full ones
    for (int call = 0; call < 300; ++call) {
      ReduceSpec spec;
      spec.premultiply = call % 4 >= 2;
      spec.scale = 0.5;  // exact on these integers
      std::vector<char> in, want;
      std::vector<double> exact;
      makeInput(DType::kFloat32, me + call, count, in, false);
      // Every rank's input is makeInput(rank + call): the reference of
      // ranks call .. call + n - 1.
      std::vector<std::vector<char>> all(n);
      for (int r = 0; r < n; ++r) makeInput(DType::kFloat32, r + call, count, all[r], false);
      std::vector<float> expect(count, 0.0f);
      for (int r = 0; r < n; ++r) {
        const float* x = reinterpret_cast<const float*>(all[r].data());
        const float scale = spec.premultiply ? 0.5f : 1.0f;
        for (size_t i = 0; i < count; ++i) {
          expect[i] = r == 0 ? x[i] * scale : expect[i] + x[i] * scale;
        }
      }
      const bool inPlace = call % 2 == 0;
      std::vector<char> out = inPlace ? in : std::vector<char>(in.size(), 0x5a);
      g.allreduce(in.data(), out.data(), count, DType::kFloat32, spec);
      CHILD_CHECK(std::memcmp(out.data(), expect.data(), count * 4) == 0,
                  "call %d (%s, %s) differs from the rank-order reference", call,
                  inPlace ? "in place" : "out of place", spec.premultiply ? "premul" : "sum");
    }
    return 0;
  };
  for (int code : runRanks(3, o, body, holdingRankOneBack)) EXPECT_EQ(code, 0);
}

// Every phase of a large chunk (copy in, reduce, copy out) is split among
// all of a rank's threads: at 8 ranks of 2 threads the reduce phase moves
// (n + 1) / n of a slice, a ninth of the copies, and still gets both.
TEST(ShmGroup, EveryThreadGetsWorkInEveryPhaseOfALargeChunk) {
  struct Case {
    int ranks, threads;
  };
  for (const Case c : {Case{8, 2}, Case{2, 8}, Case{3, 4}}) {
    ShmGroupOptions o;
    o.threads = c.threads;
    o.bufferBytes = (256u << 10) * c.threads;  // 256 KiB a thread (the default from 4 threads)
    o.spin = 0us;
    o.timeout = 60s;
    const auto body = [c](ShmGroup& g) {
      const size_t chunk = g.options().bufferBytes / 4;
      const size_t count = 2 * chunk;  // two full chunks of float32
      ReduceSpec sum;
      std::vector<char> in, want;
      std::vector<double> exact;
      makeInput(DType::kFloat32, g.options().rank, count, in, false);
      reference(DType::kFloat32, sum, g.options().size, count, false, want, exact);
      std::vector<char> out(in.size());
      const uint64_t before = g.partsSplit();
      g.allreduce(in.data(), out.data(), count, DType::kFloat32, sum);
      CHILD_CHECK(std::memcmp(out.data(), want.data(), want.size()) == 0, "allreduce differs");
      // 2 chunks x 3 phases, each in one part a thread.
      const uint64_t parts = g.partsSplit() - before;
      CHILD_CHECK(parts == 2u * 3u * static_cast<uint64_t>(c.threads),
                  "%d ranks x %d threads: %llu parts handed out, want %d", c.ranks, c.threads,
                  static_cast<unsigned long long>(parts), 6 * c.threads);
      return 0;
    };
    for (int code : runRanks(c.ranks, o, body)) EXPECT_EQ(code, 0) << c.ranks << " x " << c.threads;
  }
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
      for (int i = 0; i < 5; ++i) {  // several chunks of 64 floats each, every slot
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

// A two-phase PREMUL_SUM in place that the ranks disagree on raises before
// it touched the input (its own slice is scaled into the output, which is
// the input here, only after the first step, where disagreement shows).
TEST(ShmGroup, ARefusedInPlacePremulSumLeavesItsInputAsItWas) {
  const auto body = [](ShmGroup& g) {
    const int me = g.options().rank;
    ReduceSpec premul;
    premul.premultiply = true;
    premul.scale = 0.5;
    std::vector<float> x(me == 1 ? 300 : 299, static_cast<float>(me + 1));
    try {
      g.allreduce(x.data(), x.data(), x.size(), DType::kFloat32, premul);
      return 2;
    } catch (const Error& e) {
      CHILD_CHECK(e.code() == ErrorCode::kInvalidUsage, "code: %s", e.what());
    }
    for (float v : x) CHILD_CHECK(v == static_cast<float>(me + 1), "input changed: %g", v);
    std::vector<float> y(300, static_cast<float>(me + 1));
    g.allreduce(y.data(), y.data(), y.size(), DType::kFloat32, premul);
    for (float v : y) CHILD_CHECK(v == 3.0f, "after the refusal: %g", v);  // (1 + 2 + 3) / 2
    return 0;
  };
  for (int code : runRanks(3, smallBuffers(1), body)) EXPECT_EQ(code, 0);
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
  // Also as a host's part of a hierarchical group, whose ranks 0 and 1 are
  // the group's ranks 4 and 7: errors name those.
  for (const std::vector<int>& names : {std::vector<int>{}, std::vector<int>{4, 7}}) {
    ShmGroupOptions o = smallBuffers(1ull << 40);
    o.timeout = 1s;
    o.rankNames = names;
    const auto body = [](ShmGroup& g) {
      const bool named = !g.options().rankNames.empty();
      if (g.options().rank == 1) {
        std::this_thread::sleep_for(3s);
        try {
          g.barrier();
          return 2;
        } catch (const Error& e) {
          CHILD_CHECK(e.code() == ErrorCode::kPeerLost, "late rank: %s", e.what());
          CHILD_CHECK(std::string(e.what()).find("timed out") != std::string::npos, "%s", e.what());
          CHILD_CHECK(!named || std::string(e.what()).find("rank 4 of the group timed out") !=
                                    std::string::npos,
                      "late rank: %s", e.what());
        }
        return 0;
      }
      const auto start = std::chrono::steady_clock::now();
      try {
        g.barrier();
        return 3;
      } catch (const Error& e) {
        CHILD_CHECK(e.code() == ErrorCode::kTimeout, "%s", e.what());
        const std::string missing =
            named ? "ranks 7 did not reach barrier" : "ranks 1 did not reach barrier";
        CHILD_CHECK(std::string(e.what()).find(missing) != std::string::npos, "%s", e.what());
        CHILD_CHECK(std::chrono::steady_clock::now() - start < 2s, "bounded by 2x the timeout");
      }
      return 0;
    };
    for (int code : runRanks(2, o, body)) EXPECT_EQ(code, 0);
  }
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
