// The reductions of the shared-memory collectives (message_queue/collectives/shm_reduce.hpp)
// at every instruction-set level this CPU runs, against a reference written
// here: rank-order accumulation in float32, one rounding through the scalar
// conversions. Inputs are every 16-bit pattern (NaN, infinities and
// subnormals included) or float32 bit patterns of every class; counts around
// the vector widths; unaligned and in-place buffers.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "message_queue/collectives/shm_reduce.hpp"

namespace tpcomm::mq {
namespace {

float loadAt(DType d, const char* p, size_t i) {
  if (d == DType::kFloat32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return d == DType::kBFloat16 ? bf16ToFloat(h) : fp16ToFloat(h);
}

uint32_t bitsAt(DType d, const char* p, size_t i) {
  uint32_t u = 0;
  std::memcpy(&u, p + dtypeBytes(d) * i, dtypeBytes(d));
  return u;
}

void storeAt(DType d, char* p, size_t i, float f) {
  if (d == DType::kFloat32) {
    std::memcpy(p + 4 * i, &f, 4);
    return;
  }
  const uint16_t h = d == DType::kBFloat16 ? floatToBf16(f) : floatToFp16(f);
  std::memcpy(p + 2 * i, &h, 2);
}

float apply(ReduceKind kind, float a, float b) {
  switch (kind) {
    case ReduceKind::kSum:
      return a + b;
    case ReduceKind::kProduct:
      return a * b;
    case ReduceKind::kMin:
      return std::isnan(b) ? b : (b < a ? b : a);
    case ReduceKind::kMax:
      return std::isnan(b) ? b : (a < b ? b : a);
  }
  return 0;
}

// Rank r's element i: 16-bit types walk every bit pattern (a different
// start per rank); float32 mixes small values with patterns of every class.
std::vector<char> input(DType d, int r, size_t count, size_t pad) {
  std::vector<char> out((count + pad) * dtypeBytes(d));
  std::mt19937 rng(1234 + r);
  for (size_t i = 0; i < count + pad; ++i) {
    if (d != DType::kFloat32) {
      const uint16_t h = static_cast<uint16_t>(i * 2654435761u / 7 + r * 40503u + i);
      std::memcpy(out.data() + 2 * i, &h, 2);
      continue;
    }
    uint32_t u = rng();
    if (i % 5 != 0) {
      const float f = static_cast<float>(static_cast<int>(u % 2001) - 1000) / 64.0f;
      std::memcpy(&u, &f, 4);
    }
    std::memcpy(out.data() + 4 * i, &u, 4);
  }
  return out;
}

struct Case {
  DType dtype;
  ReduceKind kind;
  int divisor;
};

void checkLevel(ReduceIsa isa, const Case& c, int n, size_t count, size_t misalign, bool inPlace) {
  const size_t esize = dtypeBytes(c.dtype);
  std::vector<std::vector<char>> in;
  for (int r = 0; r < n; ++r) in.push_back(input(c.dtype, r, count, misalign));
  std::vector<char> expected(count * esize);
  for (size_t i = 0; i < count; ++i) {
    float acc = loadAt(c.dtype, in[0].data() + misalign * esize, i);
    for (int r = 1; r < n; ++r)
      acc = apply(c.kind, acc, loadAt(c.dtype, in[r].data() + misalign * esize, i));
    if (c.divisor != 1) acc = acc / static_cast<float>(c.divisor);
    storeAt(c.dtype, expected.data(), i, acc);
  }
  std::vector<const void*> srcs;
  for (int r = 0; r < n; ++r) srcs.push_back(in[r].data() + misalign * esize);
  std::vector<char> outBuffer((count + misalign) * esize);
  void* out = inPlace ? const_cast<void*>(srcs[n - 1]) : outBuffer.data() + misalign * esize;
  ReduceSpec spec;
  spec.kind = c.kind;
  spec.divisor = c.divisor;
  reduceIntoWith(isa, out, srcs.data(), n, count, c.dtype, spec);
  const uint32_t nanBits = c.dtype == DType::kFloat16 ? 0x7e00 : 0x7fc0;
  for (size_t i = 0; i < count; ++i) {
    const uint32_t want = bitsAt(c.dtype, expected.data(), i);
    const uint32_t got = bitsAt(c.dtype, static_cast<const char*>(out), i);
    const bool wantNaN = std::isnan(loadAt(c.dtype, expected.data(), i));
    if (wantNaN) {
      // Which NaN's sign survives a sum of two NaNs is the hardware's choice;
      // a 16-bit NaN is always the quiet one without payload.
      ASSERT_TRUE(std::isnan(loadAt(c.dtype, static_cast<const char*>(out), i)))
          << reduceIsaName(isa) << " element " << i;
      if (c.dtype != DType::kFloat32) ASSERT_EQ(got & 0x7fff, nanBits) << i;
      continue;
    }
    ASSERT_EQ(got, want) << reduceIsaName(isa) << " " << dtypeName(c.dtype) << " "
                         << reduceKindName(c.kind) << "/" << c.divisor << " n=" << n
                         << " count=" << count << " misalign=" << misalign
                         << " in place=" << inPlace << ": element " << i;
  }
  // n == 1: the result is the last source already, so a copy over it
  // would prove nothing.
  if (inPlace || n == 1) return;
  // With a copy over the last source (the two-phase allreduce's own slice:
  // into its slot, and into the output where its input was): the bits of
  // the call without one, in both, and nothing past either.
  constexpr size_t kGuard = 64;
  std::vector<char> slot(count * esize + kGuard, 0x5a);
  std::vector<char> own = in[n - 1];
  own.resize(own.size() + kGuard, 0x33);
  srcs[n - 1] = own.data() + misalign * esize;
  reduceIntoWith(isa, slot.data(), srcs.data(), n, count, c.dtype, spec,
                 const_cast<void*>(srcs[n - 1]));
  ASSERT_EQ(std::memcmp(slot.data(), out, count * esize), 0)
      << "with a copy: " << reduceIsaName(isa) << " " << dtypeName(c.dtype) << " n=" << n
      << " count=" << count << " misalign=" << misalign;
  ASSERT_EQ(std::memcmp(srcs[n - 1], out, count * esize), 0)
      << "the copy: " << reduceIsaName(isa) << " " << dtypeName(c.dtype) << " n=" << n
      << " count=" << count << " misalign=" << misalign;
  for (size_t i = 0; i < kGuard; ++i) {
    ASSERT_EQ(slot[count * esize + i], 0x5a) << "stored past the end of out";
    ASSERT_EQ(own[own.size() - kGuard + i], 0x33) << "stored past the end of the copy";
  }
}

std::vector<ReduceIsa> levels() {
  std::vector<ReduceIsa> out;
  for (ReduceIsa isa : {ReduceIsa::kPortable, ReduceIsa::kAvx2, ReduceIsa::kAvx512}) {
    if (cpuRunsReduceIsa(isa)) out.push_back(isa);
  }
  return out;
}

TEST(ShmReduceLevels, EveryLevelGivesTheReferenceBitsForEveryPatternCountAndLayout) {
  std::printf("levels this CPU runs:");
  for (ReduceIsa isa : levels()) std::printf(" %s", reduceIsaName(isa));
  std::printf(" (reduceInto uses %s)\n", reduceIsaName(bestReduceIsa()));
  const Case cases[] = {
      {DType::kFloat32, ReduceKind::kSum, 1},     {DType::kFloat32, ReduceKind::kSum, 3},
      {DType::kFloat32, ReduceKind::kProduct, 1}, {DType::kFloat32, ReduceKind::kMin, 1},
      {DType::kFloat32, ReduceKind::kMax, 1},     {DType::kBFloat16, ReduceKind::kSum, 1},
      {DType::kBFloat16, ReduceKind::kSum, 3},    {DType::kBFloat16, ReduceKind::kProduct, 1},
      {DType::kBFloat16, ReduceKind::kMin, 1},    {DType::kBFloat16, ReduceKind::kMax, 1},
      {DType::kFloat16, ReduceKind::kSum, 1},     {DType::kFloat16, ReduceKind::kSum, 3},
      {DType::kFloat16, ReduceKind::kProduct, 1}, {DType::kFloat16, ReduceKind::kMin, 1},
      {DType::kFloat16, ReduceKind::kMax, 1},
  };
  for (ReduceIsa isa : levels()) {
    for (const Case& c : cases) {
      for (int n : {1, 2, 3, 5}) {
        for (size_t count : {0, 1, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129, 1000}) {
          checkLevel(isa, c, n, count, 0, false);
          checkLevel(isa, c, n, count, 1, false);
          checkLevel(isa, c, n, count, 3, true);
        }
        checkLevel(isa, c, n, 65536 + 13, 0, false);  // every 16-bit pattern on every rank
      }
    }
  }
}

// float64 and the integers: every level against the portable loop (itself
// checked against a rank-order reference in test_shm_group.cpp), every
// reduction, counts around the vector widths, unaligned, in place; NaNs
// and infinities in one rank's float64 input.
TEST(ShmReduceLevels, Float64AndIntegersMatchThePortableLoopAtEveryLevel) {
  std::mt19937_64 rng(99);
  for (DType d : {DType::kFloat64, DType::kInt32, DType::kInt64}) {
    const size_t esize = dtypeBytes(d);
    for (int n : {1, 2, 3, 5}) {
      for (size_t count : {0, 1, 3, 4, 7, 8, 9, 15, 16, 17, 31, 33, 64, 65, 1000, 4099}) {
        std::vector<std::vector<char>> in(n, std::vector<char>((count + 1) * esize));
        for (int r = 0; r < n; ++r) {
          for (size_t i = 0; i <= count; ++i) {
            char* p = in[r].data() + i * esize;
            if (d == DType::kFloat64) {
              const double specials[] = {NAN, -NAN, INFINITY, -INFINITY, -0.0, 5e-324};
              double v = static_cast<double>(static_cast<int64_t>(rng() % 4001) - 2000) / 8;
              if (r == 1 && i % 7 == 3) v = specials[i % 6];
              std::memcpy(p, &v, 8);
            } else if (d == DType::kInt32) {
              const int32_t v = static_cast<int32_t>(rng());
              std::memcpy(p, &v, 4);
            } else {
              const int64_t v = static_cast<int64_t>(rng());
              std::memcpy(p, &v, 8);
            }
          }
        }
        for (auto [kind, divisor] : {std::pair{ReduceKind::kSum, 1}, {ReduceKind::kSum, 3},
                                     {ReduceKind::kProduct, 1}, {ReduceKind::kMin, 1},
                                     {ReduceKind::kMax, 1}}) {
          ReduceSpec spec;
          spec.kind = kind;
          spec.divisor = divisor;
          for (size_t misalign : {0, 1}) {
            std::vector<const void*> srcs;
            for (int r = 0; r < n; ++r) srcs.push_back(in[r].data() + misalign * esize);
            std::vector<char> want(count * esize);
            reduceIntoWith(ReduceIsa::kPortable, want.data(), srcs.data(), n, count, d, spec);
            for (ReduceIsa isa : levels()) {
              std::vector<char> got(count * esize);
              reduceIntoWith(isa, got.data(), srcs.data(), n, count, d, spec);
              ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size()), 0)
                  << reduceIsaName(isa) << " " << dtypeName(d) << " " << reduceKindName(kind)
                  << "/" << divisor << " n=" << n << " count=" << count;
              std::vector<char> copy = in[0];  // in place over source 0
              std::vector<const void*> inPlace = srcs;
              inPlace[0] = copy.data() + misalign * esize;
              reduceIntoWith(isa, const_cast<void*>(inPlace[0]), inPlace.data(), n, count, d,
                             spec);
              ASSERT_EQ(std::memcmp(inPlace[0], want.data(), want.size()), 0)
                  << "in place " << reduceIsaName(isa) << " " << dtypeName(d);
              // With a copy over the last source (the two-phase allreduce's
              // own slice: into its slot, and into the output where its input
              // was): the same bits in both (n == 1 proves nothing: the
              // result is the source).
              if (n == 1) continue;
              std::vector<char> slot(count * esize, 0x5a);
              std::vector<char> own = in[n - 1];
              std::vector<const void*> withCopy = srcs;
              withCopy[n - 1] = own.data() + misalign * esize;
              reduceIntoWith(isa, slot.data(), withCopy.data(), n, count, d, spec,
                             const_cast<void*>(withCopy[n - 1]));
              ASSERT_EQ(std::memcmp(slot.data(), want.data(), want.size()), 0)
                  << "with a copy " << reduceIsaName(isa) << " " << dtypeName(d) << " n=" << n
                  << " count=" << count;
              ASSERT_EQ(std::memcmp(withCopy[n - 1], want.data(), want.size()), 0)
                  << "the copy " << reduceIsaName(isa) << " " << dtypeName(d) << " n=" << n
                  << " count=" << count;
            }
          }
        }
      }
    }
  }
}

TEST(ShmReduceLevels, AskingForALevelTheCpuLacksIsAClearError) {
  for (ReduceIsa isa : {ReduceIsa::kAvx2, ReduceIsa::kAvx512}) {
    if (cpuRunsReduceIsa(isa)) continue;
    float x = 1;
    const void* src = &x;
    EXPECT_THROW(reduceIntoWith(isa, &x, &src, 1, 1, DType::kFloat32, ReduceSpec()),
                 std::exception);
  }
  EXPECT_TRUE(cpuRunsReduceIsa(ReduceIsa::kPortable));
}

#if defined(__x86_64__)
TEST(ShmReduceLevels, TheCallersFlushToZeroAndRoundingModesDoNotChangeTheBits) {
  // Subnormal float32 sums (DAZ would read them as 0, FTZ write 0) and a
  // sum that rounds differently toward zero.
  const float a[] = {1e-40f, -3e-39f, 1.0f, 1e-38f};
  const float b[] = {1e-40f, 1e-39f, 0x1.0p-24f + 0x1.0p-47f, -9.99e-39f};
  std::vector<float> in0, in1;
  for (int i = 0; i < 64; ++i) {
    in0.push_back(a[i % 4]);
    in1.push_back(b[i % 4]);
  }
  const void* srcs[] = {in0.data(), in1.data()};
  for (ReduceIsa isa : levels()) {
    std::vector<float> want(64), got(64);
    reduceIntoWith(isa, want.data(), srcs, 2, 64, DType::kFloat32, ReduceSpec());
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(saved | 0x8000u | 0x0040u | 0x6000u);  // FTZ, DAZ, round toward zero
    reduceIntoWith(isa, got.data(), srcs, 2, 64, DType::kFloat32, ReduceSpec());
    const unsigned after = _mm_getcsr();
    _mm_setcsr(saved);
    EXPECT_EQ(after, saved | 0x8000u | 0x0040u | 0x6000u) << "the caller's mode is restored";
    EXPECT_EQ(std::memcmp(want.data(), got.data(), 64 * sizeof(float)), 0)
        << reduceIsaName(isa) << ": " << want[0] << " vs " << got[0] << ", " << want[2] << " vs "
        << got[2];
    EXPECT_NE(want[0], 0.0f);  // the subnormal sum survived
  }
}
#endif

}  // namespace
}  // namespace tpcomm::mq
