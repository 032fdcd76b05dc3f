#include "message_queue/collectives/shm_reduce.hpp"

#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "common/error.hpp"
#include "message_queue/collectives/shm_reduce_vector.hpp"

// The loops below are written so that the compiler vectorises them (this file
// is built with -O3); on x86-64 each dtype's entry point is also cloned for
// x86-64-v3 (AVX2, F16C, FMA) and picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TPCOMM_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define TPCOMM_VECTOR_CLONES
#endif
#define TPCOMM_INLINE inline __attribute__((always_inline))

namespace tpcomm::mq {

namespace {

constexpr size_t kTile = 512;  // elements accumulated at once (2 KiB of float32)

TPCOMM_INLINE uint32_t bitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

TPCOMM_INLINE float floatOf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

TPCOMM_INLINE float bf16Load(uint16_t h) { return floatOf(static_cast<uint32_t>(h) << 16); }

TPCOMM_INLINE uint16_t bf16Store(float f) {
  const uint32_t u = bitsOf(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  // NaN stays a quiet NaN; a select, not a branch, for the vectoriser.
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

// IEEE half <-> single without branches: the exponent is rebased by a float
// multiply (normal numbers) or the mantissa is read through a magic float
// (subnormals), and the choice between the two is a select.
TPCOMM_INLINE float fp16Load(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t twice = w + w;  // exponent and mantissa, sign shifted out
  // Normal and inf/NaN: move the 5-bit exponent into the 8-bit field, then
  // scale by 2^-112 to undo the bias difference (inf/NaN stay inf/NaN).
  const float normal = floatOf((twice >> 4) + (0xe0u << 23)) * 0x1.0p-112f;
  // Subnormal: the mantissa as the low bits of a float in [0.5, 1), minus 0.5.
  const float subnormal = floatOf((twice >> 17) | (126u << 23)) - 0.5f;
  const uint32_t magnitude = twice < (1u << 27) ? bitsOf(subnormal) : bitsOf(normal);
  return floatOf(sign | magnitude);
}

TPCOMM_INLINE uint16_t fp16Store(float f) {
  // Scaling up then down rounds the mantissa to half precision at the right
  // place (round to nearest even) and saturates large values to infinity.
  float base = (__builtin_fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = bitsOf(f);
  const uint32_t twice = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = twice & 0xff000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = floatOf((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = bitsOf(base);
  const uint32_t exponent = (bits >> 13) & 0x00007c00u;
  const uint32_t mantissa = bits & 0x00000fffu;
  const uint32_t magnitude = twice > 0xff000000u ? 0x7e00u : exponent + mantissa;
  return static_cast<uint16_t>((sign >> 16) | magnitude);
}

// Storage type, accumulator, and the conversions between them.
struct F32 {
  using T = float;
  using Acc = float;
  static TPCOMM_INLINE Acc load(T v) { return v; }
  static TPCOMM_INLINE T store(Acc a) { return a; }
};
struct F64 {
  using T = double;
  using Acc = double;
  static TPCOMM_INLINE Acc load(T v) { return v; }
  static TPCOMM_INLINE T store(Acc a) { return a; }
};
struct BF16 {
  using T = uint16_t;
  using Acc = float;
  static TPCOMM_INLINE Acc load(T v) { return bf16Load(v); }
  static TPCOMM_INLINE T store(Acc a) { return bf16Store(a); }
};
struct FP16 {
  using T = uint16_t;
  using Acc = float;
  static TPCOMM_INLINE Acc load(T v) { return fp16Load(v); }
  static TPCOMM_INLINE T store(Acc a) { return fp16Store(a); }
};
template <typename Int, typename UInt>
struct Integer {
  using T = Int;
  using Acc = Int;
  static TPCOMM_INLINE Acc load(T v) { return v; }
  static TPCOMM_INLINE T store(Acc a) { return a; }
};
using I32 = Integer<int32_t, uint32_t>;
using I64 = Integer<int64_t, uint64_t>;

template <typename A>
struct Wrap {  // integers add and multiply modulo 2^bits (no signed overflow)
  static TPCOMM_INLINE A add(A a, A b) { return a + b; }
  static TPCOMM_INLINE A mul(A a, A b) { return a * b; }
};
template <>
struct Wrap<int32_t> {
  static TPCOMM_INLINE int32_t add(int32_t a, int32_t b) {
    return static_cast<int32_t>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b));
  }
  static TPCOMM_INLINE int32_t mul(int32_t a, int32_t b) {
    return static_cast<int32_t>(static_cast<uint32_t>(a) * static_cast<uint32_t>(b));
  }
};
template <>
struct Wrap<int64_t> {
  static TPCOMM_INLINE int64_t add(int64_t a, int64_t b) {
    return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
  }
  static TPCOMM_INLINE int64_t mul(int64_t a, int64_t b) {
    return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
  }
};

struct Sum {
  template <typename A>
  static TPCOMM_INLINE A apply(A a, A b) {
    return Wrap<A>::add(a, b);
  }
};
struct Product {
  template <typename A>
  static TPCOMM_INLINE A apply(A a, A b) {
    return Wrap<A>::mul(a, b);
  }
};
// MIN and MAX propagate NaN from any rank, as torch.minimum/maximum do (for
// integers `b != b` is false and compiles away).
struct Min {
  template <typename A>
  static TPCOMM_INLINE A apply(A a, A b) {
    const A r = b < a ? b : a;
    return b != b ? b : r;
  }
};
struct Max {
  template <typename A>
  static TPCOMM_INLINE A apply(A a, A b) {
    const A r = a < b ? b : a;
    return b != b ? b : r;
  }
};

// Elements [from, count).
template <typename D, typename Op>
TPCOMM_INLINE void reduceTyped(void* outRaw, const void* const* srcs, int n, size_t from,
                               size_t count, int divisor) {
  using T = typename D::T;
  using Acc = typename D::Acc;
  T* out = static_cast<T*>(outRaw);
  Acc acc[kTile];
  for (size_t base = from; base < count; base += kTile) {
    const size_t m = count - base < kTile ? count - base : kTile;
    const T* first = static_cast<const T*>(srcs[0]) + base;
    for (size_t i = 0; i < m; ++i) acc[i] = D::load(first[i]);
    for (int j = 1; j < n; ++j) {
      const T* src = static_cast<const T*>(srcs[j]) + base;
      for (size_t i = 0; i < m; ++i) acc[i] = Op::apply(acc[i], D::load(src[i]));
    }
    T* dst = out + base;
    if (divisor != 1) {
      const Acc d = static_cast<Acc>(divisor);
      for (size_t i = 0; i < m; ++i) dst[i] = D::store(acc[i] / d);
    } else {
      for (size_t i = 0; i < m; ++i) dst[i] = D::store(acc[i]);
    }
  }
}

template <typename D>
TPCOMM_INLINE void reduceAny(void* out, const void* const* srcs, int n, size_t from, size_t count,
                             const ReduceSpec& spec) {
  switch (spec.kind) {
    case ReduceKind::kSum:
      return reduceTyped<D, Sum>(out, srcs, n, from, count, spec.divisor);
    case ReduceKind::kProduct:
      return reduceTyped<D, Product>(out, srcs, n, from, count, 1);
    case ReduceKind::kMin:
      return reduceTyped<D, Min>(out, srcs, n, from, count, 1);
    case ReduceKind::kMax:
      return reduceTyped<D, Max>(out, srcs, n, from, count, 1);
  }
}

template <typename D, typename S>
TPCOMM_INLINE void scaleTyped(void* dstRaw, const void* srcRaw, size_t count, S scale) {
  using T = typename D::T;
  T* dst = static_cast<T*>(dstRaw);
  const T* src = static_cast<const T*>(srcRaw);
  for (size_t i = 0; i < count; ++i) dst[i] = D::store(D::load(src[i]) * scale);
}

// One entry point per dtype, so that each is cloned for the vector ISA; each
// reduces elements [f, c).
TPCOMM_VECTOR_CLONES void reduceF32(void* o, const void* const* s, int n, size_t f, size_t c,
                                    const ReduceSpec& p) {
  reduceAny<F32>(o, s, n, f, c, p);
}
TPCOMM_VECTOR_CLONES void reduceF64(void* o, const void* const* s, int n, size_t f, size_t c,
                                    const ReduceSpec& p) {
  reduceAny<F64>(o, s, n, f, c, p);
}
TPCOMM_VECTOR_CLONES void reduceBF16(void* o, const void* const* s, int n, size_t f, size_t c,
                                     const ReduceSpec& p) {
  reduceAny<BF16>(o, s, n, f, c, p);
}
TPCOMM_VECTOR_CLONES void reduceFP16(void* o, const void* const* s, int n, size_t f, size_t c,
                                     const ReduceSpec& p) {
  reduceAny<FP16>(o, s, n, f, c, p);
}
TPCOMM_VECTOR_CLONES void reduceI32(void* o, const void* const* s, int n, size_t f, size_t c,
                                    const ReduceSpec& p) {
  reduceAny<I32>(o, s, n, f, c, p);
}
TPCOMM_VECTOR_CLONES void reduceI64(void* o, const void* const* s, int n, size_t f, size_t c,
                                    const ReduceSpec& p) {
  reduceAny<I64>(o, s, n, f, c, p);
}
TPCOMM_VECTOR_CLONES void scaleFloats(void* d, const void* s, size_t c, DType dtype, double k) {
  switch (dtype) {
    case DType::kFloat32:
      return scaleTyped<F32>(d, s, c, static_cast<float>(k));
    case DType::kFloat64:
      return scaleTyped<F64>(d, s, c, k);
    case DType::kBFloat16:
      return scaleTyped<BF16>(d, s, c, static_cast<float>(k));
    case DType::kFloat16:
      return scaleTyped<FP16>(d, s, c, static_cast<float>(k));
    default:
      return;
  }
}

// The fused epilogue (reduceAddRmsNorm in shm_reduce.hpp) for one dtype:
// each row's sums as reduceTyped's Sum (rounded to T), the residual added
// and rounded, its squares summed in eight fixed lanes (a vector-friendly
// order that is the same on every rank), then the normed row.
template <typename D>
TPCOMM_INLINE void addRmsNormTyped(const void* const* srcs, int n, size_t rows,
                                   const NormRows& spec) {
  using T = typename D::T;
  using Acc = typename D::Acc;
  const size_t hidden = spec.hidden;
  const T* residual = static_cast<const T*>(spec.residual);
  T* residualOut = static_cast<T*>(spec.residualOut);
  const T* weight = static_cast<const T*>(spec.weight);
  T* normed = static_cast<T*>(spec.normed);
  Acc acc[kTile];
  T rounded[kTile];  // residualOut's tile: residual may be residualOut (in place)
  for (size_t row = 0; row < rows; ++row) {
    const size_t start = row * hidden;
    Acc lanes[8] = {};
    for (size_t base = 0; base < hidden; base += kTile) {
      const size_t m = hidden - base < kTile ? hidden - base : kTile;
      const T* first = static_cast<const T*>(srcs[0]) + start + base;
      for (size_t i = 0; i < m; ++i) acc[i] = D::load(first[i]);
      for (int j = 1; j < n; ++j) {
        const T* src = static_cast<const T*>(srcs[j]) + start + base;
        for (size_t i = 0; i < m; ++i) acc[i] = acc[i] + D::load(src[i]);
      }
      const T* res = residual + start + base;
      T* out = residualOut + start + base;
      for (size_t i = 0; i < m; ++i) {
        const T value = D::store(D::load(D::store(acc[i])) + D::load(res[i]));
        rounded[i] = value;
        const Acc v = D::load(value);
        acc[i] = v * v;
      }
      std::memcpy(out, rounded, m * sizeof(T));
      size_t i = 0;
      for (; i + 8 <= m; i += 8) {
        for (int k = 0; k < 8; ++k) lanes[k] += acc[i + k];
      }
      for (; i < m; ++i) lanes[i % 8] += acc[i];
    }
    const Acc squares = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
                        ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    const Acc inverse =
        Acc(1) / std::sqrt(squares / static_cast<Acc>(hidden) + static_cast<Acc>(spec.eps));
    const T* value = residualOut + start;
    T* dst = normed + start;
    for (size_t i = 0; i < hidden; ++i) {
      dst[i] = D::store(D::load(value[i]) * inverse * D::load(weight[i]));
    }
  }
}

TPCOMM_VECTOR_CLONES void addRmsNormF32(const void* const* s, int n, size_t r, const NormRows& p) {
  addRmsNormTyped<F32>(s, n, r, p);
}
TPCOMM_VECTOR_CLONES void addRmsNormF64(const void* const* s, int n, size_t r, const NormRows& p) {
  addRmsNormTyped<F64>(s, n, r, p);
}
TPCOMM_VECTOR_CLONES void addRmsNormBF16(const void* const* s, int n, size_t r, const NormRows& p) {
  addRmsNormTyped<BF16>(s, n, r, p);
}
TPCOMM_VECTOR_CLONES void addRmsNormFP16(const void* const* s, int n, size_t r, const NormRows& p) {
  addRmsNormTyped<FP16>(s, n, r, p);
}

}  // namespace

size_t dtypeBytes(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
  }
  return 1;
}

const char* dtypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
  }
  return "unknown";
}

const char* reduceKindName(ReduceKind kind) {
  switch (kind) {
    case ReduceKind::kSum:
      return "sum";
    case ReduceKind::kProduct:
      return "product";
    case ReduceKind::kMin:
      return "min";
    case ReduceKind::kMax:
      return "max";
  }
  return "unknown";
}

namespace {

// The reductions run in the IEEE default mode whatever the calling thread
// set: round to nearest even, no flush-to-zero, no denormals-are-zero (the
// MXCSR's rounding, FTZ and DAZ bits; restored on leaving). A rank whose
// thread set FTZ/DAZ (as some math libraries and -ffast-math start-up code
// do) then still gives its peers' bits. Costs one read of the register when
// the mode is the default already.
class DefaultFloatMode {
 public:
#if defined(__x86_64__)
  DefaultFloatMode() : saved_(_mm_getcsr()) {
    if ((saved_ & kModeBits) != 0) _mm_setcsr(saved_ & ~kModeBits);
  }
  ~DefaultFloatMode() {
    if ((saved_ & kModeBits) != 0) _mm_setcsr(saved_);
  }

 private:
  static constexpr unsigned kModeBits = 0x8000u | 0x6000u | 0x0040u;  // FTZ, rounding, DAZ
  unsigned saved_;
#endif
};

vec::Kernel kernelOf(ReduceIsa isa) {
  switch (isa) {
    case ReduceIsa::kAvx512:
      return vec::reduceAvx512;
    case ReduceIsa::kAvx2:
      return vec::reduceAvx2;
    case ReduceIsa::kPortable:
      break;
  }
  return nullptr;
}

// The best level this CPU runs, read once at load time (every level below
// it runs too: AVX-512 CPUs have AVX2 and F16C).
ReduceIsa detectBestIsa() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("f16c")) {
    return ReduceIsa::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return ReduceIsa::kAvx2;
#endif
  return ReduceIsa::kPortable;
}

const ReduceIsa kBestIsa = detectBestIsa();

bool cpuRuns(ReduceIsa isa) { return isa <= kBestIsa; }

// The level's kernel for whole vectors, then the portable loop (itself
// cloned for the CPU) for the rest and for the dtypes the kernel lacks.
void reduceWith(vec::Kernel kernel, void* out, const void* const* srcs, int n, size_t count,
                DType dtype, const ReduceSpec& spec, void* copy) {
  TPCOMM_CHECK(n >= 1, kInvalidUsage, "reduceInto: no sources");
  TPCOMM_CHECK(spec.divisor >= 1, kInvalidUsage, "reduceInto: divisor ", spec.divisor);
  const DefaultFloatMode mode;
  const int divisor = spec.kind == ReduceKind::kSum ? spec.divisor : 1;
  const size_t f =
      kernel != nullptr ? kernel(out, copy, srcs, n, count, dtype, spec.kind, divisor) : 0;
  if (f == count) return;
  switch (dtype) {
    case DType::kFloat32:
      reduceF32(out, srcs, n, f, count, spec);
      break;
    case DType::kFloat64:
      reduceF64(out, srcs, n, f, count, spec);
      break;
    case DType::kBFloat16:
      reduceBF16(out, srcs, n, f, count, spec);
      break;
    case DType::kFloat16:
      reduceFP16(out, srcs, n, f, count, spec);
      break;
    case DType::kInt32:
      reduceI32(out, srcs, n, f, count, spec);
      break;
    case DType::kInt64:
      reduceI64(out, srcs, n, f, count, spec);
      break;
  }
  // The portable loop's elements: a source at the same place as the copy
  // was read before `out` got them.
  if (copy != nullptr) {
    const size_t esize = dtypeBytes(dtype);
    std::memcpy(static_cast<char*>(copy) + f * esize, static_cast<const char*>(out) + f * esize,
                (count - f) * esize);
  }
}

}  // namespace

void reduceInto(void* out, const void* const* srcs, int n, size_t count, DType dtype,
                const ReduceSpec& spec) {
  reduceWith(kernelOf(kBestIsa), out, srcs, n, count, dtype, spec, nullptr);
}

ReduceIsa bestReduceIsa() { return kBestIsa; }

bool cpuRunsReduceIsa(ReduceIsa isa) { return cpuRuns(isa); }

const char* reduceIsaName(ReduceIsa isa) {
  switch (isa) {
    case ReduceIsa::kAvx512:
      return "avx512";
    case ReduceIsa::kAvx2:
      return "avx2";
    case ReduceIsa::kPortable:
      break;
  }
  return "portable";
}

void reduceIntoWith(ReduceIsa isa, void* out, const void* const* srcs, int n, size_t count,
                    DType dtype, const ReduceSpec& spec, void* copy) {
  TPCOMM_CHECK(cpuRuns(isa), kInvalidUsage, "this CPU cannot run the ", reduceIsaName(isa),
               " reductions");
  reduceWith(kernelOf(isa), out, srcs, n, count, dtype, spec, copy);
}

void copyScaled(void* dst, const void* src, size_t count, DType dtype, const ReduceSpec& spec) {
  const bool floating = dtype != DType::kInt32 && dtype != DType::kInt64;
  if (spec.premultiply && floating) {
    const DefaultFloatMode mode;
    scaleFloats(dst, src, count, dtype, spec.scale);
  } else if (dst != src) {
    std::memcpy(dst, src, count * dtypeBytes(dtype));
  }
}

void reduceAddRmsNorm(const void* const* srcs, int n, size_t rows, DType dtype,
                      const NormRows& spec) {
  TPCOMM_CHECK(n >= 1, kInvalidUsage, "reduceAddRmsNorm: no sources");
  TPCOMM_CHECK(spec.hidden > 0 || rows == 0, kInvalidUsage, "reduceAddRmsNorm: hidden size 0");
  const DefaultFloatMode mode;
  switch (dtype) {
    case DType::kFloat32:
      return addRmsNormF32(srcs, n, rows, spec);
    case DType::kFloat64:
      return addRmsNormF64(srcs, n, rows, spec);
    case DType::kBFloat16:
      return addRmsNormBF16(srcs, n, rows, spec);
    case DType::kFloat16:
      return addRmsNormFP16(srcs, n, rows, spec);
    default:
      TPCOMM_THROW(kInvalidUsage, "add + RMSNorm of ", dtypeName(dtype),
                   ": only float32, float64, bfloat16 and float16");
  }
}

float bf16ToFloat(uint16_t h) { return bf16Load(h); }
uint16_t floatToBf16(float f) { return bf16Store(f); }
float fp16ToFloat(uint16_t h) { return fp16Load(h); }
uint16_t floatToFp16(float f) { return fp16Store(f); }

}  // namespace tpcomm::mq
