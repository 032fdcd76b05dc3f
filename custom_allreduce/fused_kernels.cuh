#pragma once
// Allreduce fused with the residual add and RMSNorm of a transformer layer:
//
//   residualOut = round(sum over ranks of in) + residual      (rounded to T)
//   output      = residualOut / sqrt(mean(residualOut^2) + eps) x weight
//
// row by row (a row is `hidden` elements), statistics in float32. The sum is
// the plain kernels' (float32, ranks in order 0..N-1, rounded to T), so
// residualOut has the bits the separate allreduce and add give.
//
// Row ownership. Every phase of a fused kernel partitions the rows, never
// the packs: block b of every rank stages, reduces and normalises the same
// rows, so block b's barriers (signal.hpp) cover everything block b reads,
// and a row's statistics are one block's reduction with no extra barrier.
//
//   one-shot  rows b, b + G, ... (G blocks): stage, start barrier, sum every
//             rank's staging into the epilogue; no end barrier (the next
//             call stages into the other region: signal.hpp, "Staging
//             parity")
//   two-shot  rows split into N parts as packs are in twoShotKernel; in each
//             part, block b owns rows b, b + G, ... of it. Stage every part's
//             rows of block b, start barrier, sum our part's rows into our
//             result region, middle barrier, then for every part read the
//             owner's sums into the epilogue. No end barrier, for the reason
//             signal.hpp gives for the plain two-shot.
//
// The epilogue uses this rank's own residual and weight, so ranks whose
// residuals differ each get their own residualOut, as the separate
// operations give. Rows move as 16-byte packs when `packed` (hidden is a
// multiple of the pack and every pointer of this rank aligned), else element
// by element; ranks may differ in that (alignment is per rank), so both
// paths sum a row's squares in one order and the normed rows stay bitwise
// equal across ranks.

#include "custom_allreduce/kernels.cuh"

namespace tpcomm::car {

// First row of part p of `rows` rows split into n parts.
__device__ __forceinline__ size_t rowPartBegin(size_t rows, int n, int p) {
  return partBegin(rows, n, p);
}

// Copies row `row` of the input into `staging` (this rank's region for the
// call).
template <typename T>
__device__ __forceinline__ void stageRow(const KernelArgs& a, char* staging, size_t row) {
  constexpr int kPer = Elements<T>::kPerPack;
  if (a.packed) {
    const size_t per = a.hidden / kPer;
    const Pack* in = reinterpret_cast<const Pack*>(a.input) + row * per;
    Pack* to = reinterpret_cast<Pack*>(staging) + row * per;
    for (size_t i = threadIdx.x; i < per; i += blockDim.x) to[i] = in[i];
  } else {
    const T* in = reinterpret_cast<const T*>(a.input) + row * a.hidden;
    T* to = reinterpret_cast<T*>(staging) + row * a.hidden;
    for (size_t i = threadIdx.x; i < a.hidden; i += blockDim.x) to[i] = in[i];
  }
}

// The sum of the block's threads' `v` (blockDim.x a power of two), the
// same on every thread; a fixed tree, so the same inputs give the same bits.
__device__ __forceinline__ float blockSum(float v) {
  __shared__ float partial[kThreads];
  partial[threadIdx.x] = v;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  const float total = partial[0];
  __syncthreads();  // every thread read it before the next row writes
  return total;
}

// Where the sums of a row come from: every rank's staging (summed here) or
// the owners' result regions (two-shot, summed already).
template <typename T, int N>
struct StagedSums {
  const char* src[N];
  float scale;
  __device__ __forceinline__ Pack pack(size_t i) const { return sumPack<T, N>(src, i, scale); }
  __device__ __forceinline__ T element(size_t i) const { return sumElement<T, N>(src, i, scale); }
};

template <typename T, int N>
struct ResultSums {
  const char* region;  // the part owner's result region
  __device__ __forceinline__ Pack pack(size_t i) const {
    return loadPack(reinterpret_cast<const Pack*>(region) + i);
  }
  __device__ __forceinline__ T element(size_t i) const {
    return __ldcg(reinterpret_cast<const T*>(region) + i);
  }
};

// Writes row `row`'s sums into this rank's result region (two-shot).
template <typename T, int N>
__device__ __forceinline__ void sumRow(const KernelArgs& a, const StagedSums<T, N>& sums,
                                       size_t row) {
  constexpr int kPer = Elements<T>::kPerPack;
  char* result = a.buffers[a.rank] + a.resultOffset;
  if (a.packed) {
    const size_t per = a.hidden / kPer;
    for (size_t i = threadIdx.x; i < per; i += blockDim.x) {
      reinterpret_cast<Pack*>(result)[row * per + i] = sums.pack(row * per + i);
    }
  } else {
    for (size_t i = threadIdx.x; i < a.hidden; i += blockDim.x) {
      reinterpret_cast<T*>(result)[row * a.hidden + i] = sums.element(row * a.hidden + i);
    }
  }
}

// residualOut = sum + residual (rounded to T), returning the square of
// what was stored, as float.
template <typename T>
__device__ __forceinline__ float addResidual(T sum, T residual, T* out) {
  *out = fromFloat<T>(toFloat(sum) + toFloat(residual));
  const float v = toFloat(*out);
  return v * v;
}

template <typename T>
__device__ __forceinline__ T normed(T value, float inverse, T weight) {
  return fromFloat<T>(toFloat(value) * inverse * toFloat(weight));
}

// The epilogue of row `row`, with its sums from `sums`: every thread of the
// block calls it (the statistics are a block reduction).
template <typename T, typename Sums>
__device__ void normRow(const KernelArgs& a, const Sums& sums, size_t row) {
  constexpr int kPer = Elements<T>::kPerPack;
  float squares = 0.f;
  if (a.packed) {
    const size_t per = a.hidden / kPer;
    const size_t first = row * per;
    const Pack* residual = reinterpret_cast<const Pack*>(a.residual) + first;
    Pack* residualOut = reinterpret_cast<Pack*>(a.residualOut) + first;
    for (size_t i = threadIdx.x; i < per; i += blockDim.x) {
      const Pack s = sums.pack(first + i);
      const Pack r = residual[i];
      T se[kPer], re[kPer], oe[kPer];
      memcpy(se, &s, sizeof(Pack));
      memcpy(re, &r, sizeof(Pack));
#pragma unroll
      for (int k = 0; k < kPer; ++k) squares += addResidual<T>(se[k], re[k], &oe[k]);
      Pack o;
      memcpy(&o, oe, sizeof(Pack));
      residualOut[i] = o;
    }
    const float inverse = 1.f / sqrtf(blockSum(squares) / static_cast<float>(a.hidden) + a.eps);
    const Pack* weight = reinterpret_cast<const Pack*>(a.weight);
    Pack* out = reinterpret_cast<Pack*>(a.output) + first;
    for (size_t i = threadIdx.x; i < per; i += blockDim.x) {
      const Pack v = residualOut[i];  // this thread's own store above
      const Pack w = weight[i];
      T ve[kPer], we[kPer], oe[kPer];
      memcpy(ve, &v, sizeof(Pack));
      memcpy(we, &w, sizeof(Pack));
#pragma unroll
      for (int k = 0; k < kPer; ++k) oe[k] = normed<T>(ve[k], inverse, we[k]);
      Pack o;
      memcpy(&o, oe, sizeof(Pack));
      out[i] = o;
    }
    return;
  }
  // Element by element, but in the pack path's order (thread t sums packs
  // t, t + blockDim, ..., each front to back): a rank whose residual or
  // weight is not pack-aligned takes this path while its peers take the
  // other, and the row's statistics must be the same float32 sum on both.
  const size_t first = row * a.hidden;
  const T* residual = reinterpret_cast<const T*>(a.residual) + first;
  T* residualOut = reinterpret_cast<T*>(a.residualOut) + first;
  for (size_t start = threadIdx.x * kPer; start < a.hidden; start += blockDim.x * kPer) {
    const size_t end = start + kPer < a.hidden ? start + kPer : a.hidden;
    for (size_t i = start; i < end; ++i) {
      squares += addResidual<T>(sums.element(first + i), residual[i], &residualOut[i]);
    }
  }
  const float inverse = 1.f / sqrtf(blockSum(squares) / static_cast<float>(a.hidden) + a.eps);
  const T* weight = reinterpret_cast<const T*>(a.weight);
  T* out = reinterpret_cast<T*>(a.output) + first;
  for (size_t i = threadIdx.x; i < a.hidden; i += blockDim.x) {
    out[i] = normed<T>(residualOut[i], inverse, weight[i]);
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads) fusedOneShotKernel(KernelArgs a) {
  const size_t rows = a.count / a.hidden;
  waitForPreviousGrid();
  const uint32_t epoch = nextEpoch(a);
  const uint32_t round = nextRound(a);
  const uint32_t stale = stalePushBytes(a, round);
  int refused = 0;
  if (threadIdx.x == 0) refused = openCall<N>(a);
  if (mayStage(a)) {
    char* staging = stagingOf(a, a.rank, epoch);
    for (size_t row = blockIdx.x; row < rows; row += gridDim.x) stageRow<T>(a, staging, row);
  }
  if (__syncthreads_or(refused)) return;
  StagedSums<T, N> sums;
  sourcesOf<N>(a, epoch, sums.src);
  sums.scale = a.scale;
  if (!barrier<N>(a, kStart, epoch, true)) return;
  if (threadIdx.x == 0) commitEpoch(a, epoch, round);  // off the barrier's critical path
  launchDependents();
  for (size_t row = blockIdx.x; row < rows; row += gridDim.x) normRow<T>(a, sums, row);
  clearStalePush<N>(a, round, stale);
  // No end barrier: the input is always staged (see oneShotKernel).
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads) fusedTwoShotKernel(KernelArgs a) {
  const size_t rows = a.count / a.hidden;
  waitForPreviousGrid();
  const uint32_t epoch = nextEpoch(a);
  const uint32_t round = nextRound(a);
  const uint32_t stale = stalePushBytes(a, round);
  int refused = 0;
  if (threadIdx.x == 0) refused = openCall<N>(a);
  if (mayStage(a)) {
    char* staging = stagingOf(a, a.rank, epoch);
    for (int p = 0; p < N; ++p) {
      const size_t end = rowPartBegin(rows, N, p + 1);
      for (size_t row = rowPartBegin(rows, N, p) + blockIdx.x; row < end; row += gridDim.x) {
        stageRow<T>(a, staging, row);
      }
    }
  }
  if (__syncthreads_or(refused)) return;
  StagedSums<T, N> sums;
  sourcesOf<N>(a, epoch, sums.src);
  sums.scale = a.scale;
  if (!barrier<N>(a, kStart, epoch, true)) return;
  if (threadIdx.x == 0) commitEpoch(a, epoch, round);  // off the barrier's critical path
  launchDependents();
  clearStalePush<N>(a, round, stale);
  const size_t ownEnd = rowPartBegin(rows, N, a.rank + 1);
  for (size_t row = rowPartBegin(rows, N, a.rank) + blockIdx.x; row < ownEnd; row += gridDim.x) {
    sumRow<T, N>(a, sums, row);
  }
  if (!barrier<N>(a, kMiddle, epoch)) return;
  // Every rank's reads of our staging ended before the middle barrier, so
  // the outputs may be written now even where they are the input.
  for (int p = 0; p < N; ++p) {
    const ResultSums<T, N> owner{a.buffers[p] + a.resultOffset};
    const size_t end = rowPartBegin(rows, N, p + 1);
    for (size_t row = rowPartBegin(rows, N, p) + blockIdx.x; row < end; row += gridDim.x) {
      normRow<T>(a, owner, row);
    }
  }
}

}  // namespace tpcomm::car
