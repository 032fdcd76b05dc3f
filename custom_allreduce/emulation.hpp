#pragma once
// Host stand-ins for the CUDA built-ins the kernels use, so that kernels.cuh
// compiles with the host compiler and its code runs on the CPU
// (tests/cpp/custom_allreduce/test_kernel_emulation.cpp). Test-only, never in the product:
//
//   - each rank is a process of its own; the buffers live in shared memory
//     mapped before the ranks fork, at the same address in every rank;
//   - a process runs one block at a time (block 0, 1, ...), so `__shared__`
//     variables can be plain statics; every rank runs its blocks in the same
//     order, so block b of every rank meets at the per-block barrier;
//   - a block's threads are OS threads and __syncthreads() a barrier among
//     them;
//   - the flag accesses are release stores and acquire loads, the timer is
//     the host's monotonic clock.
//
// It checks what the kernels compute (partitions, tails, epochs, sources,
// error codes), not GPU timing or the GPU memory model.
#ifndef TPCOMM_CAR_EMULATION
#error "custom_allreduce/emulation.hpp is only for the kernels' CPU emulation"
#endif

#include <pthread.h>
#include <vector_types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

// The CUDA headers define these as nothing for a host compiler (or not at
// all).
#undef __shared__
#define __shared__ static
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

inline thread_local uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

namespace tpcomm::car::emu {

inline pthread_barrier_t& blockBarrier() {
  static pthread_barrier_t barrier;
  return barrier;
}

// __syncthreads_or: call g of a block uses slot g % 3. Thread 0 clears the
// slot of call g + 1 before call g's barrier: every thread read that slot
// (as call g - 2) before it reached call g - 1's barrier, and nobody writes
// it before passing call g's.
inline std::atomic<int> orSlots[3];
inline thread_local unsigned orCalls = 0;

// Reads of a zero-copy table's `ready` word (loadReady): the kernels read it
// once per block, so that a block's threads cannot disagree about it.
inline std::atomic<uint64_t> readyReads{0};

// A slow rank, on demand of a test: this process's blocks sleep this long
// after passing a barrier of the given phase (before the work that follows),
// or at the points of a push one-shot: after its push (kPush: a reader held
// back before it reads and clears) and before it (kBeforePush: a rank whose
// values come late).
inline constexpr int kBeforePush = 6;
inline int leaveDelayMs[8] = {0, 0, 0, 0, 0, 0, 0, 0};
inline void afterBarrier(int phase) {
  if (leaveDelayMs[phase] > 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(leaveDelayMs[phase]));
}

inline uint64_t nowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

// Runs kernel(args) as `blocks` blocks of `threads` threads, one block after
// the other, as this process's rank.
template <typename Args>
void launch(void (*kernel)(Args), const Args& args, int blocks, int threads) {
  gridDim = dim3(static_cast<unsigned>(blocks));
  blockDim = dim3(static_cast<unsigned>(threads));
  pthread_barrier_init(&blockBarrier(), nullptr, static_cast<unsigned>(threads));
  for (int b = 0; b < blocks; ++b) {
    blockIdx = uint3{static_cast<unsigned>(b), 0, 0};
    for (auto& slot : orSlots) slot.store(0);  // each block's threads start at call 0
    std::vector<std::thread> block;
    for (int t = 0; t < threads; ++t) {
      block.emplace_back([&, t] {
        threadIdx = uint3{static_cast<unsigned>(t), 0, 0};
        kernel(args);
      });
    }
    for (auto& thread : block) thread.join();
  }
  pthread_barrier_destroy(&blockBarrier());
}

}  // namespace tpcomm::car::emu

inline void __syncthreads() { pthread_barrier_wait(&tpcomm::car::emu::blockBarrier()); }

inline int __syncthreads_or(int predicate) {
  using namespace tpcomm::car::emu;
  const unsigned call = orCalls++;
  if (threadIdx.x == 0) orSlots[(call + 1) % 3].store(0);
  if (predicate) orSlots[call % 3].store(1);
  pthread_barrier_wait(&blockBarrier());
  return orSlots[call % 3].load();
}

inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

template <typename T>
inline T __ldcg(const T* p) {
  return *p;
}
