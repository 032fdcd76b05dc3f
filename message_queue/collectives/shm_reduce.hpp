#pragma once
// Element-wise reductions of the shared-memory collectives (shm_group.hpp).
// Internal to message_queue/; plain C++, no torch.
//
// Every reduction reads its sources in the order given (rank order) and
// accumulates in `Acc<T>`: float32 for float32, bfloat16 and float16 (one
// rounding at the end), float64 for float64, and wrapping unsigned
// arithmetic for the integers (as two's-complement hardware and Gloo do),
// in the IEEE default floating-point mode whatever the calling thread set
// (round to nearest even, no flush-to-zero or denormals-are-zero; restored
// after). The same inputs therefore give the same bits on every rank and
// every run.

#include <cstddef>
#include <cstdint>
#include <string>

namespace tpcomm::mq {

enum class DType : uint8_t { kFloat32, kFloat64, kBFloat16, kFloat16, kInt32, kInt64 };
enum class ReduceKind : uint8_t { kSum, kProduct, kMin, kMax };

size_t dtypeBytes(DType dtype);
const char* dtypeName(DType dtype);
const char* reduceKindName(ReduceKind kind);

struct ReduceSpec {
  ReduceKind kind = ReduceKind::kSum;
  // AVG: the sum divided by `divisor` before the one rounding (truncating
  // division for integers, as NCCL's ncclAvg). 1: no division.
  int divisor = 1;
  // PREMUL_SUM: each rank scales its own input by this while copying it in
  // (in float32 for 16-bit types and float32, float64 for float64).
  bool premultiply = false;
  double scale = 1.0;
};

// out[i] = reduce(srcs[0][i], ..., srcs[n-1][i]) for i < count. `out` may be
// one of the sources (each element's sources are read before it is written).
void reduceInto(void* out, const void* const* srcs, int n, size_t count, DType dtype,
                const ReduceSpec& spec);

// The instruction-set levels the reductions have kernels for: every dtype
// accumulates in AVX2 (with F16C) or AVX-512 registers where the CPU has
// them (the last elements, integer AVG and AVX2's int64 PRODUCT/MIN/MAX
// through the portable loop); every level gives the same bits, but for
// which NaN's sign or payload a SUM or PRODUCT of two NaNs keeps.
// Ordered: a CPU that runs a level runs every level below it.
enum class ReduceIsa : uint8_t { kPortable, kAvx2, kAvx512 };
// The best level this CPU runs: the one reduceInto uses.
ReduceIsa bestReduceIsa();
bool cpuRunsReduceIsa(ReduceIsa isa);
const char* reduceIsaName(ReduceIsa isa);
// reduceInto with the kernels of `isa` (tests compare the levels);
// InvalidUsage when this CPU cannot run it. Where `copy` is not null, the
// result goes there too (the two-phase allreduce's own slice: into its slot
// for the peers, into the output for itself): at the vector levels stored
// from the same registers, elsewhere (the portable loop's elements, the
// reductions a level has no kernel for) copied from `out` afterwards.
// `copy` may be one of the sources, at the same place as `out` in it, but
// must not overlap `out`.
void reduceIntoWith(ReduceIsa isa, void* out, const void* const* srcs, int n, size_t count,
                    DType dtype, const ReduceSpec& spec, void* copy = nullptr);

// dst[i] = src[i] * spec.scale, rounded to dtype (PREMUL_SUM's copy-in), or
// a plain copy when !spec.premultiply. Floating dtypes only scale.
void copyScaled(void* dst, const void* src, size_t count, DType dtype, const ReduceSpec& spec);

// Rows of `hidden` elements for the fused allreduce + residual add + RMSNorm;
// each pointer at the first row. residualOut may be residual.
struct NormRows {
  const void* residual = nullptr;
  void* residualOut = nullptr;
  const void* weight = nullptr;  // hidden elements
  void* normed = nullptr;
  size_t hidden = 0;
  double eps = 1e-6;
};

// For each of `rows` rows: sum = the SUM reduceInto gives (one rounding),
// residualOut = round(sum + residual), normed = round(residualOut /
// sqrt(mean(residualOut^2) + eps) x weight) with the statistics in the
// accumulator type (float32; float64 for float64), summed in a fixed order,
// so that the same inputs give the same bits on every rank. With n == 1 the
// source is the sum already. Floating dtypes only (InvalidUsage otherwise).
void reduceAddRmsNorm(const void* const* srcs, int n, size_t rows, DType dtype,
                      const NormRows& spec);

// The conversions the 16-bit reductions use, exposed for tests: round to
// nearest even, NaN kept NaN.
float bf16ToFloat(uint16_t h);
uint16_t floatToBf16(float f);
float fp16ToFloat(uint16_t h);
uint16_t floatToFp16(float f);

}  // namespace tpcomm::mq
