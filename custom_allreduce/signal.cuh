#pragma once
// Device side of the signal protocol described in signal.hpp: release/acquire
// flag accesses at system scope and the bounded per-block barrier.

#include <cstdint>

#include "custom_allreduce/signal.hpp"
#ifdef TPCOMM_CAR_EMULATION
#include "custom_allreduce/emulation.hpp"  // the kernels on the CPU (tests only)
#endif

namespace tpcomm::car {

struct KernelArgs {
  const void* input;
  void* output;
  size_t count;
  char* buffers[kMaxRanks];  // each rank's buffer base, as this process reaches it
  // Null: every rank's input is in its staging region. Else (zero-copy, in
  // device memory, filled when graph_capture() exits): where each rank's
  // input is read from.
  const RegisteredInputs* registered;
  size_t stagingOffset;
  size_t resultOffset;
  int rank;
  int stage;    // copy the input into this rank's staging first
  float scale;  // the result is scale x the sum (AVG: 1/N)
  uint64_t timeoutNs;
  uint32_t* error;  // mapped host memory
};

#ifndef TPCOMM_CAR_EMULATION
__device__ __forceinline__ uint64_t globalTimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void storeRelease(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t loadAcquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// The error word (mapped host memory): any thread may read it while another
// writes it.
__device__ __forceinline__ uint32_t loadError(const uint32_t* p) {
  return *reinterpret_cast<const volatile uint32_t*>(p);
}
__device__ __forceinline__ void storeError(uint32_t* p, uint32_t code) {
  *reinterpret_cast<volatile uint32_t*>(p) = code;
  __threadfence_system();
}
#else
inline uint64_t globalTimer() { return emu::nowNs(); }
inline void storeRelease(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline uint32_t loadAcquire(const uint32_t* p) {
  std::this_thread::yield();  // spinning ranks share the CPU with working ones
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
inline uint32_t loadError(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
inline void storeError(uint32_t* p, uint32_t code) { __atomic_store_n(p, code, __ATOMIC_SEQ_CST); }
#endif

__device__ __forceinline__ Signal* signalOf(const KernelArgs& a, int rank) {
  return reinterpret_cast<Signal*>(a.buffers[rank]);
}

// Where each rank's input is read from. False (on every thread) when the
// zero-copy table was never filled: the graph was replayed before
// graph_capture() exited; the error word then says so.
template <int N>
__device__ __forceinline__ bool sourcesOf(const KernelArgs& a, const char* (&src)[N]) {
  if (a.registered == nullptr) {
#pragma unroll
    for (int r = 0; r < N; ++r) src[r] = a.buffers[r] + a.stagingOffset;
    return true;
  }
  if (a.registered->ready == 0) {
    if (threadIdx.x == 0 && loadError(a.error) == 0) {
      storeError(a.error, errorCode(0, kNotRegistered, blockIdx.x));
    }
    return false;
  }
#pragma unroll
  for (int r = 0; r < N; ++r) src[r] = static_cast<const char*>(a.registered->input[r]);
  return true;
}

// This block's call number: one more than last time, kept in device memory
// so graph replays advance it.
__device__ __forceinline__ uint32_t nextEpoch(const KernelArgs& a) {
  __shared__ uint32_t epoch;
  if (threadIdx.x == 0) {
    uint32_t* slot = &signalOf(a, a.rank)->epoch[blockIdx.x];
    epoch = *slot + 1;
    *slot = epoch;
  }
  __syncthreads();
  return epoch;
}

// Every rank's block `blockIdx.x` reaches `phase` of call `epoch`. Returns
// false (on every thread of the block) when a peer did not arrive within the
// timeout or another block already failed; the error word then names it.
// The verdict is combined by __syncthreads_or, not a shared variable: a
// shared flag reset by the next barrier could be reset before a slow thread
// of this one read it (a race the CPU emulation's thread checker found).
template <int N>
__device__ bool barrier(const KernelArgs& a, int phase, uint32_t epoch) {
  int failed = 0;
  __syncthreads();  // this block's writes before the release below
  if (threadIdx.x < N) {
    const int peer = threadIdx.x;
    storeRelease(&signalOf(a, peer)->flags[blockIdx.x][phase][a.rank].value, epoch);
    const uint32_t* mine = &signalOf(a, a.rank)->flags[blockIdx.x][phase][peer].value;
    const uint64_t start = globalTimer();
    uint32_t spins = 0;
    while (static_cast<int32_t>(loadAcquire(mine) - epoch) < 0) {
      if ((++spins & 1023) == 0) {
        const bool late = globalTimer() - start > a.timeoutNs;
        if (late || loadError(a.error) != 0) {
          // A plain store: atomics on mapped host memory are not portable.
          // Blocks that race here each write a valid code.
          if (late && loadError(a.error) == 0)
            storeError(a.error, errorCode(peer, phase, blockIdx.x));
          failed = 1;
          break;
        }
      }
    }
  }
  return __syncthreads_or(failed) == 0;
}

}  // namespace tpcomm::car
