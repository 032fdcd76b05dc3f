#include "message_queue/collectives/shm_reduce_vector.hpp"

// Each level's kernels are compiled for that level only (a GCC target
// region), and run only where the CPU has it (shm_reduce.cpp checks at load
// time). Other compilers get none: the portable loop does everything.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

// GCC 12's AVX-512 headers start some intrinsics from a self-initialised
// "undefined" vector, which -Wmaybe-uninitialized reports once inlined.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace tpcomm::mq::vec {

#pragma GCC push_options
#pragma GCC target("avx2,f16c")

namespace avx2 {

struct VF {  // 8 floats
  using Vec = __m256;
  using Scalar = float;
  static constexpr size_t kWidth = 8;
  static constexpr bool kDivide = true, kProduct = true, kMinMax = true;
  static Vec set1(float x) { return _mm256_set1_ps(x); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
  // first < second ? first : second (minps), and its mirror.
  static Vec minFirst(Vec a, Vec b) { return _mm256_min_ps(a, b); }
  static Vec maxFirst(Vec a, Vec b) { return _mm256_max_ps(a, b); }
  // `probe` where it is NaN, else `otherwise`.
  static Vec keepNaN(Vec probe, Vec otherwise) {
    return _mm256_blendv_ps(otherwise, probe, _mm256_cmp_ps(probe, probe, _CMP_UNORD_Q));
  }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  // 16 bfloat16: the even elements as the low halves, the odd ones as the
  // high halves of 32-bit lanes.
  static void loadBF16Pairs(const uint16_t* p, Vec& even, Vec& odd) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(0xffff0000u)));
  }
  // round(v) to nearest even in the upper 16 bits (NaN: 0x7fc0 there).
  static __m256i roundBF16(Vec v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000),
                              _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  static void storeBF16Pairs(uint16_t* p, Vec even, Vec odd) {
    const __m256i low = _mm256_srli_epi32(roundBF16(even), 16);
    const __m256i high = _mm256_and_si256(roundBF16(odd), _mm256_set1_epi32(0xffff0000u));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_or_si256(low, high));
  }
  static Vec loadFP16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void storeFP16(uint16_t* p, Vec v) {
    // A NaN as the portable store writes it: its sign, quiet, no payload
    // (vcvtps2ph would keep the payload's top bits).
    const Vec canonical =
        _mm256_or_ps(_mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN))),
                     _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)));
    const Vec quiet = _mm256_blendv_ps(v, canonical, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(quiet, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

struct VD {  // 4 doubles
  using Vec = __m256d;
  using Scalar = double;
  static constexpr size_t kWidth = 4;
  static constexpr bool kDivide = true, kProduct = true, kMinMax = true;
  static Vec set1(double x) { return _mm256_set1_pd(x); }
  static Vec add(Vec a, Vec b) { return _mm256_add_pd(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_pd(a, b); }
  static Vec div(Vec a, Vec b) { return _mm256_div_pd(a, b); }
  static Vec minFirst(Vec a, Vec b) { return _mm256_min_pd(a, b); }
  static Vec maxFirst(Vec a, Vec b) { return _mm256_max_pd(a, b); }
  static Vec keepNaN(Vec probe, Vec otherwise) {
    return _mm256_blendv_pd(otherwise, probe, _mm256_cmp_pd(probe, probe, _CMP_UNORD_Q));
  }
  static Vec load(const double* p) { return _mm256_loadu_pd(p); }
  static void store(double* p, Vec v) { _mm256_storeu_pd(p, v); }
};

struct VI32 {  // 8 int32, wrapping; no division (AVG goes to the portable loop)
  using Vec = __m256i;
  using Scalar = int32_t;
  static constexpr size_t kWidth = 8;
  static constexpr bool kDivide = false, kProduct = true, kMinMax = true;
  static Vec set1(int32_t x) { return _mm256_set1_epi32(x); }
  static Vec add(Vec a, Vec b) { return _mm256_add_epi32(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm256_mullo_epi32(a, b); }
  static Vec div(Vec a, Vec) { return a; }  // never called (kDivide)
  static Vec minFirst(Vec a, Vec b) { return _mm256_min_epi32(a, b); }
  static Vec maxFirst(Vec a, Vec b) { return _mm256_max_epi32(a, b); }
  static Vec keepNaN(Vec, Vec otherwise) { return otherwise; }
  static Vec load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const Vec*>(p)); }
  static void store(int32_t* p, Vec v) { _mm256_storeu_si256(reinterpret_cast<Vec*>(p), v); }
};

struct VI64 {  // 4 int64, wrapping: AVX2 adds them; no multiply, min or max
  using Vec = __m256i;
  using Scalar = int64_t;
  static constexpr size_t kWidth = 4;
  static constexpr bool kDivide = false, kProduct = false, kMinMax = false;
  static Vec set1(int64_t x) { return _mm256_set1_epi64x(x); }
  static Vec add(Vec a, Vec b) { return _mm256_add_epi64(a, b); }
  static Vec mul(Vec a, Vec) { return a; }       // never called (kProduct)
  static Vec div(Vec a, Vec) { return a; }       // never called (kDivide)
  static Vec minFirst(Vec a, Vec) { return a; }  // never called (kMinMax)
  static Vec maxFirst(Vec a, Vec) { return a; }  // never called (kMinMax)
  static Vec keepNaN(Vec, Vec otherwise) { return otherwise; }
  static Vec load(const int64_t* p) { return _mm256_loadu_si256(reinterpret_cast<const Vec*>(p)); }
  static void store(int64_t* p, Vec v) { _mm256_storeu_si256(reinterpret_cast<Vec*>(p), v); }
};

#include "message_queue/collectives/shm_reduce_vector_body.inl"

}  // namespace avx2

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c")

namespace avx512 {

inline __mmask16 nans(__m512 v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }

struct VF {  // 16 floats
  using Vec = __m512;
  using Scalar = float;
  static constexpr size_t kWidth = 16;
  static constexpr bool kDivide = true, kProduct = true, kMinMax = true;
  static Vec set1(float x) { return _mm512_set1_ps(x); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  static Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
  static Vec minFirst(Vec a, Vec b) { return _mm512_min_ps(a, b); }
  static Vec maxFirst(Vec a, Vec b) { return _mm512_max_ps(a, b); }
  static Vec keepNaN(Vec probe, Vec otherwise) {
    return _mm512_mask_mov_ps(otherwise, nans(probe), probe);
  }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static void loadBF16Pairs(const uint16_t* p, Vec& even, Vec& odd) {
    const __m512i x = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(0xffff0000u)));
  }
  static __m512i roundBF16(Vec v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
    return _mm512_mask_mov_epi32(r, nans(v), _mm512_set1_epi32(0x7fc00000));
  }
  static void storeBF16Pairs(uint16_t* p, Vec even, Vec odd) {
    const __m512i low = _mm512_srli_epi32(roundBF16(even), 16);
    const __m512i high = _mm512_and_si512(roundBF16(odd), _mm512_set1_epi32(0xffff0000u));
    _mm512_storeu_si512(p, _mm512_or_si512(low, high));
  }
  static Vec loadFP16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void storeFP16(uint16_t* p, Vec v) {
    // A NaN as the portable store writes it: its sign, quiet, no payload.
    const Vec canonical = _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)),
                        _mm512_set1_epi32(0x7fc00000)));
    const Vec quiet = _mm512_mask_mov_ps(v, nans(v), canonical);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(quiet, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

struct VD {  // 8 doubles
  using Vec = __m512d;
  using Scalar = double;
  static constexpr size_t kWidth = 8;
  static constexpr bool kDivide = true, kProduct = true, kMinMax = true;
  static Vec set1(double x) { return _mm512_set1_pd(x); }
  static Vec add(Vec a, Vec b) { return _mm512_add_pd(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_pd(a, b); }
  static Vec div(Vec a, Vec b) { return _mm512_div_pd(a, b); }
  static Vec minFirst(Vec a, Vec b) { return _mm512_min_pd(a, b); }
  static Vec maxFirst(Vec a, Vec b) { return _mm512_max_pd(a, b); }
  static Vec keepNaN(Vec probe, Vec otherwise) {
    return _mm512_mask_mov_pd(otherwise, _mm512_cmp_pd_mask(probe, probe, _CMP_UNORD_Q), probe);
  }
  static Vec load(const double* p) { return _mm512_loadu_pd(p); }
  static void store(double* p, Vec v) { _mm512_storeu_pd(p, v); }
};

struct VI32 {  // 16 int32, wrapping; no division (AVG goes to the portable loop)
  using Vec = __m512i;
  using Scalar = int32_t;
  static constexpr size_t kWidth = 16;
  static constexpr bool kDivide = false, kProduct = true, kMinMax = true;
  static Vec set1(int32_t x) { return _mm512_set1_epi32(x); }
  static Vec add(Vec a, Vec b) { return _mm512_add_epi32(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm512_mullo_epi32(a, b); }
  static Vec div(Vec a, Vec) { return a; }  // never called (kDivide)
  static Vec minFirst(Vec a, Vec b) { return _mm512_min_epi32(a, b); }
  static Vec maxFirst(Vec a, Vec b) { return _mm512_max_epi32(a, b); }
  static Vec keepNaN(Vec, Vec otherwise) { return otherwise; }
  static Vec load(const int32_t* p) { return _mm512_loadu_si512(p); }
  static void store(int32_t* p, Vec v) { _mm512_storeu_si512(p, v); }
};

struct VI64 {  // 8 int64, wrapping (vpmullq is AVX512DQ); no division
  using Vec = __m512i;
  using Scalar = int64_t;
  static constexpr size_t kWidth = 8;
  static constexpr bool kDivide = false, kProduct = true, kMinMax = true;
  static Vec set1(int64_t x) { return _mm512_set1_epi64(x); }
  static Vec add(Vec a, Vec b) { return _mm512_add_epi64(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm512_mullo_epi64(a, b); }
  static Vec div(Vec a, Vec) { return a; }  // never called (kDivide)
  static Vec minFirst(Vec a, Vec b) { return _mm512_min_epi64(a, b); }
  static Vec maxFirst(Vec a, Vec b) { return _mm512_max_epi64(a, b); }
  static Vec keepNaN(Vec, Vec otherwise) { return otherwise; }
  static Vec load(const int64_t* p) { return _mm512_loadu_si512(p); }
  static void store(int64_t* p, Vec v) { _mm512_storeu_si512(p, v); }
};

#include "message_queue/collectives/shm_reduce_vector_body.inl"

}  // namespace avx512

#pragma GCC pop_options

size_t reduceAvx2(void* out, void* copy, const void* const* srcs, int n, size_t count,
                  DType dtype, ReduceKind kind, int divisor) {
  return avx2::reduce(out, copy, srcs, n, count, dtype, kind, divisor);
}

size_t reduceAvx512(void* out, void* copy, const void* const* srcs, int n, size_t count,
                    DType dtype, ReduceKind kind, int divisor) {
  return avx512::reduce(out, copy, srcs, n, count, dtype, kind, divisor);
}

}  // namespace tpcomm::mq::vec

#else  // not x86-64 with GCC: the portable loop does everything

namespace tpcomm::mq::vec {

size_t reduceAvx2(void*, void*, const void* const*, int, size_t, DType, ReduceKind, int) {
  return 0;
}
size_t reduceAvx512(void*, void*, const void* const*, int, size_t, DType, ReduceKind, int) {
  return 0;
}

}  // namespace tpcomm::mq::vec

#endif
