#pragma once
// Device side of the signal protocol described in signal.hpp: release/acquire
// flag accesses (system or GPU scope) and the bounded per-block barrier.

#include <cstdint>

#include "custom_allreduce/signal.hpp"
#ifdef TPCOMM_CAR_EMULATION
#include "custom_allreduce/emulation.hpp"  // the kernels on the CPU (tests only)
#endif

namespace tpcomm::car {

using Pack = uint4;  // 16 bytes: what a thread moves at once

struct KernelArgs {
  const void* input;
  void* output;
  size_t count;
  char* buffers[kMaxRanks];  // each rank's buffer base, as this process reaches it
  // Null: every rank's input is in its staging region. Else (zero-copy, in
  // device memory, filled when graph_capture() exits): where each rank's
  // input is read from.
  const RegisteredInputs* registered;
  size_t stagingOffset;  // staging of even calls; odd calls' follows at + stagingBytes
  size_t stagingBytes;
  size_t resultOffset;
  size_t pushOffset;     // the push buffers (push_kernels.cuh)
  size_t pushSlotBytes;  // one source's slot in one round
  // Push rounds in rotation: kPushDepth (the buffers there are). The kernel
  // emulation runs 2 as well, to show that two are not enough.
  uint32_t pushDepth;
  int rank;
  int deviceScope;  // every rank on this GPU: flags at GPU scope (else system scope)
  int stage;        // copy the input into this rank's staging first
  float scale;      // the result is scale x the sum (AVG: 1/N)
  uint64_t timeoutNs;
  uint32_t* error;  // mapped host memory
  // The fused residual add + RMSNorm kernels only (fused_kernels.cuh):
  // `output` receives the normed rows; count is rows x hidden.
  const void* residual;  // this rank's residual, read before residualOut is written
  void* residualOut;     // sum + residual (may be `residual`)
  const void* weight;    // hidden elements
  size_t hidden;         // elements per row
  float eps;
  int packed;  // rows move as 16-byte packs (hidden and every pointer allow it)
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

// A release store at GPU scope: enough when every rank runs on this GPU (ranks as
// streams of one process, or processes sharing the GPU), where L2 is the
// point of coherence; a system-scope release also flushes towards the host
// and the peers over NVLink, which costs microseconds per barrier.
__device__ __forceinline__ void storeReleaseGpu(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// A flag poll: relaxed loads while waiting, then one fence once the flag
// was seen (the PTX model's acquire pattern: ld.relaxed, then fence.acq_rel
// at the same scope), so the spin does not pay an acquire per iteration.
__device__ __forceinline__ uint32_t pollFlag(const uint32_t* p, int deviceScope) {
  uint32_t v;
  if (deviceScope) {
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  } else {
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  }
  return v;
}
__device__ __forceinline__ void acquireFence(int deviceScope) {
  if (deviceScope) {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
  } else {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
  }
}

// A word another agent may write at any time (the error word in mapped host
// memory, the poison word, the zero-copy table's `ready`): a plain load that
// the compiler must not cache or hoist.
__device__ __forceinline__ uint32_t loadRelaxed(const uint32_t* p) {
  return *reinterpret_cast<const volatile uint32_t*>(p);
}
__device__ __forceinline__ uint32_t loadReady(const uint32_t* p) { return loadRelaxed(p); }
__device__ __forceinline__ void storeError(uint32_t* p, uint32_t code) {
  *reinterpret_cast<volatile uint32_t*>(p) = code;
  __threadfence_system();
}
#else
inline uint64_t globalTimer() { return emu::nowNs(); }
inline void storeRelease(uint32_t* p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
inline void storeReleaseGpu(uint32_t* p, uint32_t v) { storeRelease(p, v); }
inline uint32_t pollFlag(const uint32_t* p, int) {
  std::this_thread::yield();  // spinning ranks share the CPU with working ones
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
inline void acquireFence(int) { std::atomic_thread_fence(std::memory_order_acquire); }
inline uint32_t loadRelaxed(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
// Counted, so that the emulation can check that one thread per block reads it.
inline uint32_t loadReady(const uint32_t* p) {
  emu::readyReads.fetch_add(1);
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
inline void storeError(uint32_t* p, uint32_t code) { __atomic_store_n(p, code, __ATOMIC_SEQ_CST); }
#endif

__device__ __forceinline__ Signal* signalOf(const KernelArgs& a, int rank) {
  return reinterpret_cast<Signal*>(a.buffers[rank]);
}

// Records `code` in this rank's error word unless a failure is already there
// (blocks that race here each write a valid code; a plain store, as atomics
// on mapped host memory are not portable).
__device__ __forceinline__ void recordError(const KernelArgs& a, uint32_t code) {
  if (loadRelaxed(a.error) == 0) storeError(a.error, code);
}

// This rank gave up (`code` names whom it waited for): every rank's poison
// word gets the code with this rank as its reporter, unless one is set.
template <int N>
__device__ __forceinline__ void poisonGroup(const KernelArgs& a, uint32_t code) {
  const uint32_t poison = poisonCode(code, a.rank);
#pragma unroll
  for (int r = 0; r < N; ++r) {
    uint32_t* word = &signalOf(a, r)->poison.value;
    if (loadRelaxed(word) == 0) storeRelease(word, poison);
  }
  __threadfence_system();
}

// This call's epoch, read by every thread of the block before any thread
// may write it (commitEpoch runs after the block's first __syncthreads_or):
// every thread knows the call's staging parity at once, so the staging copy
// starts without waiting for thread 0.
__device__ __forceinline__ uint32_t nextEpoch(const KernelArgs& a) {
  return signalOf(a, a.rank)->epoch[blockIdx.x] + 1;
}

// This call's push round (push_kernels.cuh): the block's last round + 1,
// modulo the rotation's depth (kPushDepth); read like the epoch, committed
// with it.
__device__ __forceinline__ uint32_t nextRound(const KernelArgs& a) {
  return (signalOf(a, a.rank)->round[blockIdx.x] + 1) % a.pushDepth;
}
__device__ __forceinline__ uint32_t previousRound(const KernelArgs& a, uint32_t round) {
  return (round + a.pushDepth - 1) % a.pushDepth;
}


// Whether this thread may stage its share: not once the group is poisoned
// (every thread reads its rank's poison word, in device memory). A refused
// call would stage into the region of the next call's parity, which is the
// region a slow peer may still read for the call before: a poisoned group's
// queued kernels must leave it alone. A thread that sees the poison makes the
// block's barrier see it too (it reads the word after the block's barrier).
__device__ __forceinline__ bool mayStage(const KernelArgs& a) {
  return a.stage && loadRelaxed(&signalOf(a, a.rank)->poison.value) == 0;
}

// This rank's staging region for call `epoch`: even and odd calls alternate
// between two regions (signal.hpp, "Staging parity").
__device__ __forceinline__ char* stagingOf(const KernelArgs& a, int rank, uint32_t epoch) {
  return a.buffers[rank] + a.stagingOffset + (epoch & 1u) * a.stagingBytes;
}

// The start of a call, on thread 0 of each block (step 0 of signal.hpp):
// whether the call may run. Refused (1) when the group is poisoned or the
// zero-copy table was never filled (a graph replayed before graph_capture()
// exited); the error word then says why and the epoch stays, so nothing of
// this call reaches a peer's flags (its staging, if any, went to the region a
// healthy call would use next: see mayStage). An unfilled table poisons the group: this rank's
// epoch no longer matches its peers', so its next call must not pair with
// theirs, and they must not wait out their timeout for this one. The loads
// are independent, so their latencies overlap (and overlap the staging copy
// the other threads start meanwhile).
template <int N>
__device__ __forceinline__ int openCall(const KernelArgs& a) {
  Signal* own = signalOf(a, a.rank);
  const uint32_t poison = loadRelaxed(&own->poison.value);
  const uint32_t ready = a.registered == nullptr ? 1u : loadReady(&a.registered->ready);
  if (poison != 0) {
    recordError(a, poison);
    return 1;
  }
  if (ready == 0) {
    const uint32_t code = errorCode(0, kNotRegistered, blockIdx.x);
    recordError(a, code);
    poisonGroup<N>(a, code);
    return 1;
  }
  return 0;
}

// Once the call passed its start barrier, on thread 0 of each block (off the
// barrier's critical path: nothing reads the epochs before the rank's next
// kernel): stores the epoch and the push round (in device memory: each graph
// replay is a new call). A call that fails leaves the group poisoned, and
// only the reset, which zeroes every epoch, makes it usable again. Block 0
// also advances the epochs and rounds of the block indices this call does
// not use, so that every block index's epoch is the number of calls made: a
// call's staging parity and push round are then the same in every block and
// on every rank, whatever block counts earlier calls used. A flag of an
// unused block index stays behind its epoch, so it can never pass for a
// fresh one. Block 0 records the bytes per source this call pushed into its
// round (0 for every kernel but the push), which the next call clears
// (push_kernels.cuh).
__device__ __forceinline__ void commitEpoch(const KernelArgs& a, uint32_t epoch, uint32_t round,
                                            size_t pushedBytes = 0) {
  Signal* own = signalOf(a, a.rank);
  own->epoch[blockIdx.x] = epoch;
  own->round[blockIdx.x] = round;
  if (blockIdx.x == 0) {
    for (unsigned b = gridDim.x; b < static_cast<unsigned>(kMaxBlocks); ++b) {
      own->epoch[b] = epoch;
      own->round[b] = round;
    }
    own->pushed[round] = static_cast<uint32_t>(pushedBytes);
  }
}

// Where each rank's input is read from (after openCall accepted the call:
// the zero-copy table, when there is one, is filled). A table entry that
// names a rank's staging (CustomAllreduce::stagingOf, the even region) means
// that rank's staging of this call's parity.
template <int N>
__device__ __forceinline__ void sourcesOf(const KernelArgs& a, uint32_t epoch,
                                          const char* (&src)[N]) {
#pragma unroll
  for (int r = 0; r < N; ++r) {
    const char* staged = stagingOf(a, r, epoch);
    if (a.registered == nullptr) {
      src[r] = staged;
    } else {
      const char* entry = static_cast<const char*>(a.registered->input[r]);
      src[r] = entry == a.buffers[r] + a.stagingOffset ? staged : entry;
    }
  }
}

// Programmatic dependent launch (sm_90+; no-ops elsewhere and in the
// emulation). A kernel launched with it may start while the kernel before
// it on its stream still runs: waitForPreviousGrid() returns once that one
// has ended and its memory is visible, so every kernel calls it before it
// reads anything (its epoch, its input). launchDependents() lets the next
// kernel start its own launch early.
__device__ __forceinline__ void waitForPreviousGrid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void launchDependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#ifndef TPCOMM_CAR_EMULATION
// A 16-byte load another agent may be writing (the poll): not cached in L1,
// not hoisted; each 32-bit word is single-copy atomic.
__device__ __forceinline__ Pack loadPushed(const Pack* p, int deviceScope) {
  Pack v;
  if (deviceScope) {
    asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
  } else {
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
  }
  return v;
}
// A 16-byte store into a peer's push slot (or a clear of one's own).
__device__ __forceinline__ void storePushed(Pack* p, Pack v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}
#else
inline Pack loadPushed(const Pack* p, int) {
  Pack v;
  v.x = __atomic_load_n(&p->x, __ATOMIC_RELAXED);
  v.y = __atomic_load_n(&p->y, __ATOMIC_RELAXED);
  v.z = __atomic_load_n(&p->z, __ATOMIC_RELAXED);
  v.w = __atomic_load_n(&p->w, __ATOMIC_RELAXED);
  return v;
}
inline void storePushed(Pack* p, Pack v) {
  __atomic_store_n(&p->x, v.x, __ATOMIC_RELAXED);
  __atomic_store_n(&p->y, v.y, __ATOMIC_RELAXED);
  __atomic_store_n(&p->z, v.z, __ATOMIC_RELAXED);
  __atomic_store_n(&p->w, v.w, __ATOMIC_RELAXED);
}
#endif

// Slot `source` of round `round` in rank `owner`'s push buffers.
__device__ __forceinline__ Pack* pushSlot(const KernelArgs& a, int owner, uint32_t round,
                                          int source) {
  return reinterpret_cast<Pack*>(
      a.buffers[owner] + a.pushOffset +
      (static_cast<size_t>(round) * kMaxRanks + static_cast<size_t>(source)) * a.pushSlotBytes);
}

// The bytes per source that the call before this one pushed into this
// rank's round previousRound(round) (0 after any other kernel).
__device__ __forceinline__ uint32_t stalePushBytes(const KernelArgs& a, uint32_t round) {
  return loadRelaxed(&signalOf(a, a.rank)->pushed[previousRound(a, round)]);
}

// Zeroes what the previous call pushed into this rank's previous round
// (every kernel does, whatever kind it is: push_kernels.cuh, "Why three
// rounds"), split over the whole grid.
template <int N>
__device__ __forceinline__ void clearStalePush(const KernelArgs& a, uint32_t round,
                                               uint32_t bytes) {
  if (bytes == 0) return;
  const uint32_t previous = previousRound(a, round);
  const size_t packs = bytes / kPackBytes;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
#pragma unroll
  for (int s = 0; s < N; ++s) {
    Pack* slot = pushSlot(a, a.rank, previous, s);
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < packs; i += stride) {
      storePushed(slot + i, Pack{0u, 0u, 0u, 0u});
    }
  }
}

__device__ __forceinline__ int lowestBit(uint32_t bits) {
#ifdef TPCOMM_CAR_EMULATION
  return __builtin_ctz(bits);
#else
  return __ffs(static_cast<int>(bits)) - 1;
#endif
}

// Every rank's block `blockIdx.x` reaches `phase` of call `epoch`. Returns
// false (on every thread of the block) when a peer did not arrive within the
// timeout, another block of this rank already failed, or the group is
// poisoned (checked while waiting and once more after the wait); the error
// word then says which. A block that times out poisons the group.
// The verdict is combined by __syncthreads_or, not a shared variable: a
// shared flag reset by the next barrier could be reset before a slow thread
// of this one read it (a race the CPU emulation's thread checker found).
template <int N>
__device__ bool barrier(const KernelArgs& a, int phase, uint32_t epoch, bool synced = false) {
  int failed = 0;
  // This block's writes before the release below (`synced`: the caller's
  // __syncthreads_or just did that, and the block wrote nothing since).
  if (!synced) __syncthreads();
  if (threadIdx.x < N) {
    const int peer = threadIdx.x;
    uint32_t* theirs = &signalOf(a, peer)->flags[blockIdx.x][phase][a.rank].value;
    const uint32_t* mine = &signalOf(a, a.rank)->flags[blockIdx.x][phase][peer].value;
    const uint32_t* poison = &signalOf(a, a.rank)->poison.value;
    if (a.deviceScope) {
      storeReleaseGpu(theirs, epoch);
    } else {
      storeRelease(theirs, epoch);
    }
    // The clock is read only once a wait is long (its first check starts the
    // timeout, a few microseconds into the wait).
    uint64_t start = 0;
    bool timing = false;
    uint32_t spins = 0;
    while (static_cast<int32_t>(pollFlag(mine, a.deviceScope) - epoch) < 0) {
      if ((++spins & 1023) == 0) {
        const uint64_t now = globalTimer();
        if (!timing) {
          start = now;
          timing = true;
        }
        const bool late = static_cast<int64_t>(now - start) > static_cast<int64_t>(a.timeoutNs);
        const uint32_t poisoned = loadRelaxed(poison);
        if (late || poisoned != 0 || loadRelaxed(a.error) != 0) {
          if (poisoned != 0) {
            recordError(a, poisoned);
          } else if (late) {
            const uint32_t code = errorCode(peer, phase, blockIdx.x);
            recordError(a, code);
            poisonGroup<N>(a, code);
          } else {
            // This rank's host aborted the group (its error word): poison
            // this rank's own word at once (the host's copies may still be on
            // their way), so that its queued kernels neither stage nor run.
            uint32_t* own = &signalOf(a, a.rank)->poison.value;
            if (loadRelaxed(own) == 0) storeRelease(own, poisonCode(loadRelaxed(a.error), a.rank));
          }
          failed = 1;
          break;
        }
      }
    }
    if (!failed) {
      acquireFence(a.deviceScope);  // the peer's writes before its flag are visible now
      const uint32_t poisoned = loadRelaxed(poison);
      if (poisoned != 0) {
        recordError(a, poisoned);
        failed = 1;
      }
    }
  }
#ifdef TPCOMM_CAR_EMULATION
  emu::afterBarrier(phase);  // a slow rank, when a test asks for one
#endif
  return __syncthreads_or(failed) == 0;
}

}  // namespace tpcomm::car
