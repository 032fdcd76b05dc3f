#pragma once
// One-shot and two-shot allreduce kernels (sum; float32 accumulation; ranks
// added in order 0..N-1). See signal.hpp for the protocol. Elements move as
// 16-byte packs; the count's remainder (< one pack) is handled element-wise
// by thread 0.. of block 0 in every step, which keeps the per-block ownership
// the barrier relies on.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstring>

#include "custom_allreduce/signal.cuh"

namespace tpcomm::car {

template <typename T>
struct Elements {
  static constexpr int kPerPack = sizeof(Pack) / sizeof(T);
};

__device__ __forceinline__ float toFloat(float x) { return x; }
__device__ __forceinline__ float toFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float toFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T fromFloat(float x);
template <>
__device__ __forceinline__ float fromFloat<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half fromFloat<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 fromFloat<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Loads bypassing L1: the data was written by another SM or GPU.
__device__ __forceinline__ Pack loadPack(const Pack* p) { return __ldcg(p); }

// The rank-order float32 sum of N packs (rank 0 first), times `scale`,
// rounded once to T. The pack's bytes move between a Pack and its elements
// by memcpy (register moves once compiled): reading a Pack through a T* is
// undefined behaviour that an optimiser may exploit (the CPU emulation's
// did: it returned a Pack it considered never written).
template <typename T, int N>
__device__ __forceinline__ Pack rankOrderSum(const Pack (&v)[N], float scale) {
  constexpr int kPer = Elements<T>::kPerPack;
  float acc[kPer];
#pragma unroll
  for (int r = 0; r < N; ++r) {
    T e[kPer];
    memcpy(e, &v[r], sizeof(Pack));
#pragma unroll
    for (int k = 0; k < kPer; ++k) acc[k] = r == 0 ? toFloat(e[k]) : acc[k] + toFloat(e[k]);
  }
  T o[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) o[k] = fromFloat<T>(acc[k] * scale);
  Pack out;
  memcpy(&out, o, sizeof(Pack));
  return out;
}

// Sum over ranks of pack `index` of every rank's source, times `scale`.
template <typename T, int N>
__device__ __forceinline__ Pack sumPack(const char* const (&src)[N], size_t index, float scale) {
  Pack v[N];
#pragma unroll
  for (int r = 0; r < N; ++r) v[r] = loadPack(reinterpret_cast<const Pack*>(src[r]) + index);
  return rankOrderSum<T, N>(v, scale);
}

template <typename T, int N>
__device__ __forceinline__ T sumElement(const char* const (&src)[N], size_t index, float scale) {
  float acc = 0.f;
#pragma unroll
  for (int r = 0; r < N; ++r) {
    const float v = toFloat(__ldcg(reinterpret_cast<const T*>(src[r]) + index));
    acc = r == 0 ? v : acc + v;
  }
  return fromFloat<T>(acc * scale);
}

// Copies [begin, end) packs of the input into `staging` (this rank's
// region for the call) with the block/thread partition every step uses.
__device__ __forceinline__ void stagePacks(const KernelArgs& a, char* staging, size_t begin,
                                           size_t end) {
  const Pack* in = reinterpret_cast<const Pack*>(a.input);
  Pack* to = reinterpret_cast<Pack*>(staging);
  for (size_t i = begin + blockIdx.x * blockDim.x + threadIdx.x; i < end;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    to[i] = in[i];
  }
}

template <typename T>
__device__ __forceinline__ void stageTail(const KernelArgs& a, char* staging, size_t first,
                                          size_t tail) {
  if (blockIdx.x == 0 && threadIdx.x < tail) {
    const T* in = reinterpret_cast<const T*>(a.input);
    reinterpret_cast<T*>(staging)[first + threadIdx.x] = in[first + threadIdx.x];
  }
}

// One synchronisation: stage, start barrier, sum every rank's staging. No
// end barrier when every input is staged: the next call stages into the
// other region (signal.hpp, "Staging parity"), and the call after it
// starts only once every peer is done with this one. Zero-copy keeps the
// end barrier: peers read this rank's own input, which the caller may
// rewrite as soon as this kernel ends. (An output that overlaps the input
// on a zero-copy one-shot call is never asked for: the host stages such
// inputs, since peers would read this rank's input while it writes.)
template <typename T, int N>
__global__ void __launch_bounds__(kThreads) oneShotKernel(KernelArgs a) {
  constexpr int kPer = Elements<T>::kPerPack;
  const size_t packs = a.count / kPer;
  const size_t tail = a.count % kPer;
  waitForPreviousGrid();
  const uint32_t epoch = nextEpoch(a);
  const uint32_t round = nextRound(a);
  const uint32_t stale = stalePushBytes(a, round);
  int refused = 0;
  if (threadIdx.x == 0) refused = openCall<N>(a);
  if (mayStage(a)) {
    char* staging = stagingOf(a, a.rank, epoch);
    stagePacks(a, staging, 0, packs);
    stageTail<T>(a, staging, packs * kPer, tail);
  }
  if (__syncthreads_or(refused)) return;
  const char* src[N];
  sourcesOf<N>(a, epoch, src);
  if (!barrier<N>(a, kStart, epoch, true)) return;
  if (threadIdx.x == 0) commitEpoch(a, epoch, round);  // off the barrier's critical path
  launchDependents();
  Pack* out = reinterpret_cast<Pack*>(a.output);
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < packs;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    out[i] = sumPack<T, N>(src, i, a.scale);
  }
  if (blockIdx.x == 0 && threadIdx.x < tail) {
    const size_t i = packs * kPer + threadIdx.x;
    reinterpret_cast<T*>(a.output)[i] = sumElement<T, N>(src, i, a.scale);
  }
  clearStalePush<N>(a, round, stale);
  if (a.registered != nullptr) barrier<N>(a, kEnd, epoch);
}

// Part p of the packs: [partBegin(p), partBegin(p + 1)).
__device__ __forceinline__ size_t partBegin(size_t packs, int n, int p) {
  const size_t per = (packs + n - 1) / n;
  const size_t begin = per * p;
  return begin < packs ? begin : packs;
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads) twoShotKernel(KernelArgs a) {
  constexpr int kPer = Elements<T>::kPerPack;
  const size_t packs = a.count / kPer;
  const size_t tail = a.count % kPer;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t thread = blockIdx.x * blockDim.x + threadIdx.x;
  waitForPreviousGrid();
  const uint32_t epoch = nextEpoch(a);
  const uint32_t round = nextRound(a);
  const uint32_t stale = stalePushBytes(a, round);
  int refused = 0;
  if (threadIdx.x == 0) refused = openCall<N>(a);
  // Stage part by part, so that block b stages exactly the packs block b of
  // part p's owner reduces.
  if (mayStage(a)) {
    char* staging = stagingOf(a, a.rank, epoch);
    for (int p = 0; p < N; ++p) {
      stagePacks(a, staging, partBegin(packs, N, p), partBegin(packs, N, p + 1));
    }
    stageTail<T>(a, staging, packs * kPer, tail);
  }
  if (__syncthreads_or(refused)) return;
  const char* src[N];
  sourcesOf<N>(a, epoch, src);
  if (!barrier<N>(a, kStart, epoch, true)) return;
  if (threadIdx.x == 0) commitEpoch(a, epoch, round);  // off the barrier's critical path
  launchDependents();
  // Reduce this rank's part into its result region (the tail belongs to
  // the last rank).
  Pack* result = reinterpret_cast<Pack*>(a.buffers[a.rank] + a.resultOffset);
  const size_t end = partBegin(packs, N, a.rank + 1);
  for (size_t i = partBegin(packs, N, a.rank) + thread; i < end; i += stride) {
    result[i] = sumPack<T, N>(src, i, a.scale);
  }
  if (a.rank == N - 1 && blockIdx.x == 0 && threadIdx.x < tail) {
    const size_t i = packs * kPer + threadIdx.x;
    reinterpret_cast<T*>(result)[i] = sumElement<T, N>(src, i, a.scale);
  }
  if (!barrier<N>(a, kMiddle, epoch)) return;
  // Gather every part from its owner's result region. Every rank's reads of
  // the sources (zero-copy: possibly `out` itself) ended before the middle
  // barrier, so writing `out` here is safe even in place.
  Pack* out = reinterpret_cast<Pack*>(a.output);
  for (int p = 0; p < N; ++p) {
    const Pack* src = reinterpret_cast<const Pack*>(a.buffers[p] + a.resultOffset);
    const size_t stop = partBegin(packs, N, p + 1);
    for (size_t i = partBegin(packs, N, p) + thread; i < stop; i += stride) {
      out[i] = loadPack(src + i);
    }
  }
  if (blockIdx.x == 0 && threadIdx.x < tail) {
    const size_t i = packs * kPer + threadIdx.x;
    const T* src = reinterpret_cast<const T*>(a.buffers[N - 1] + a.resultOffset);
    reinterpret_cast<T*>(a.output)[i] = __ldcg(src + i);
  }
  clearStalePush<N>(a, round, stale);
  // No end barrier: see signal.hpp ("Why two-shot needs no end barrier").
}

}  // namespace tpcomm::car
