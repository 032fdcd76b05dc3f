#pragma once
// The push one-shot: no flag, no barrier. Every rank writes its values
// straight into a slot of every peer's push buffer, and the values say
// themselves that they have arrived: zero bits mean "not written yet", and a
// sender never sends a zero word (it sends every zero as -0; the reader reads
// -0 as +0). A call costs one one-way latency instead of a flag round trip.
//
// Push buffers of one rank (BufferLayout: pushOffset, pushSlotBytes):
//
//   push[k][s]   k = the call's round (0..kPushDepth-1), s = the source rank;
//                written only by rank s (16-byte stores of encoded packs),
//                read and cleared only by the owner
//   pushed[k]    (in the Signal) bytes per source that call k's round wrote
//
// Rounds. Every kernel of a group (push, one-shot, two-shot, fused, a
// barrier-only call) advances its round by one on every rank (round[block] in
// the Signal, committed with the epoch, unused block indices by block 0), so
// call e of every rank is in round e mod 3.
//
// Call e in round k, on rank r, per pack i of this thread (the same packs as
// the thread pushes; blocks and threads partition the packs as every rank
// does for the same call):
//
//   step | does
//   -----+-----------------------------------------------------------------
//   0    | reads its epoch, round, pushed[k - 1] and poison word (a
//        | poisoned rank pushes nothing: the call is refused, below)
//   1    | encodes its packs and stores them into push[k][r] of every peer
//   2    | clears its own push[k - 1][s] for every s (pushed[k - 1] bytes;
//        | its own slot too, which the fused push writes) with stores of zero
//   3    | thread 0 commits epoch and round; block 0 records pushed[k]
//   4    | polls its own push[k][s] for every s != r until no word is zero,
//        | then sums the N packs in rank order (its own from its input,
//        | encoded and decoded the same way) and writes the output
//
// Why three rounds. While rank r is in call e (reading round k and clearing
// round k - 1), a peer p can be at most in call e + 1: p's kernel e + 1
// starts after its kernel e ended, which needed r's values of call e, but p
// cannot finish call e + 1 before r pushes its values of call e + 1, which
// r does only after its kernel e ended. So p writes into round k + 1 of r
// while r reads round k: the round r clears (k - 1 = k + 2) is written next
// in call e + 2, which needs r's call e + 1. With two rounds the round r
// clears would be the one p is writing for call e + 1, and a value p wrote
// could be zeroed (the reader then waits in vain). Every kernel clears
// round k - 1 (not only pushes), so a push that follows a barrier kernel
// never finds values of three calls ago: a round is always clear by the
// time it comes round again. The proof is run in the CPU emulation with a
// reader held back (KernelEmulationFull.PushSurvivesSlowReadersAndMixedCalls).
//
// Why a zero never passes for a value: the owner's clear of round k - 1 in
// call e, its kernel e's end, its call e + 1 values reaching the peers, and
// the peers' writes of call e + 2 into that round follow each other, so no
// clear lands after a value it would erase. Bits are not changed by the
// transport beyond zeros: NaN payloads and every non-zero value arrive as
// sent. The only arithmetic change: an element that is -0 on every rank sums
// to +0 (IEEE addition would give -0); any other mix of zeros gives +0 in
// IEEE addition too, and non-zero sums are unaffected.
//
// Failure. A thread that waits longer than the timeout for a peer's pack
// records errorCode(peer, kPush, block) and poisons the group, as a barrier
// does; the poison word, the error word (the host's abort) and the timer are
// checked every 256 polls. A failed call may have written the packs whose
// values had all arrived (a failed barrier kernel, too, may have written
// the blocks that passed their barrier); the call raises either way. A
// call that finds the group poisoned at entry commits and writes nothing
// (its threads that read the poison word before it was set may have pushed:
// harmless, as the group stays poisoned until the reset, which zeroes every
// push buffer with the Signal, so rounds restart clean).

#include "custom_allreduce/fused_kernels.cuh"

namespace tpcomm::car {

// The wire form of a 32-bit word: no zero word is ever sent. float32: +0
// becomes -0. 16-bit types (two per word): each +0 half becomes -0, so the
// word cannot be zero.
template <typename T>
__device__ __forceinline__ uint32_t encodeWord(uint32_t w) {
  if constexpr (sizeof(T) == 4) {
    return w == 0 ? 0x80000000u : w;
  } else {
    const uint32_t lo = (w & 0xffffu) == 0 ? 0x8000u : (w & 0xffffu);
    const uint32_t hi = (w >> 16) == 0 ? 0x8000u : (w >> 16);
    return lo | (hi << 16);
  }
}
// Back from the wire: -0 (as every zero was sent) is read as +0.
template <typename T>
__device__ __forceinline__ uint32_t decodeWord(uint32_t w) {
  if constexpr (sizeof(T) == 4) {
    return w == 0x80000000u ? 0u : w;
  } else {
    const uint32_t lo = (w & 0xffffu) == 0x8000u ? 0u : (w & 0xffffu);
    const uint32_t hi = (w >> 16) == 0x8000u ? 0u : (w >> 16);
    return lo | (hi << 16);
  }
}
template <typename T>
__device__ __forceinline__ Pack encodePack(Pack v) {
  return Pack{encodeWord<T>(v.x), encodeWord<T>(v.y), encodeWord<T>(v.z), encodeWord<T>(v.w)};
}
template <typename T>
__device__ __forceinline__ Pack decodePack(Pack v) {
  return Pack{decodeWord<T>(v.x), decodeWord<T>(v.y), decodeWord<T>(v.z), decodeWord<T>(v.w)};
}
__device__ __forceinline__ bool arrived(Pack v) {
  return v.x != 0 && v.y != 0 && v.z != 0 && v.w != 0;
}

// Pack i of `count` elements at `base` (16-byte aligned); the last pack may
// be partial: its missing elements read as zero bits (sent as -0, never
// summed into an output).
// A pack of the first min(valid, per pack) elements at `from` (any
// alignment), the rest zero bits.
template <typename T>
__device__ __forceinline__ Pack gatherElements(const T* from, size_t valid) {
  constexpr int kPer = Elements<T>::kPerPack;
  T e[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    if (static_cast<size_t>(k) < valid) {
      e[k] = from[k];
    } else {
      memset(&e[k], 0, sizeof(T));
    }
  }
  Pack v;
  memcpy(&v, e, sizeof(Pack));
  return v;
}

template <typename T>
__device__ __forceinline__ Pack loadElements(const void* base, size_t i, size_t count) {
  constexpr int kPer = Elements<T>::kPerPack;
  if ((i + 1) * kPer <= count) return reinterpret_cast<const Pack*>(base)[i];
  return gatherElements<T>(reinterpret_cast<const T*>(base) + i * kPer, count - i * kPer);
}

template <typename T>
__device__ __forceinline__ void storeElements(void* base, size_t i, size_t count, Pack v) {
  constexpr int kPer = Elements<T>::kPerPack;
  if ((i + 1) * kPer <= count) {
    reinterpret_cast<Pack*>(base)[i] = v;
    return;
  }
  T e[kPer];
  memcpy(e, &v, sizeof(Pack));
  T* to = reinterpret_cast<T*>(base) + i * kPer;
  const size_t valid = count - i * kPer;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    if (static_cast<size_t>(k) < valid) to[k] = e[k];
  }
}

// Step 1: this rank's pack i into slot `rank` of round `round` of every
// peer (and of its own buffer when `kOwn`: the fused push reads every
// rank's pack from its buffer).
template <typename T, int N, bool kOwn = false>
__device__ __forceinline__ void pushPack(const KernelArgs& a, uint32_t round, size_t i, Pack v) {
  const Pack wire = encodePack<T>(v);
#pragma unroll
  for (int p = 0; p < N; ++p) {
    if (kOwn || p != a.rank) storePushed(pushSlot(a, p, round, a.rank) + i, wire);
  }
}

// Step 4's wait for pack i: polls this rank's round `round` until the pack
// of every source in `missing` (a bit per rank) has arrived, into v. False
// (the error word and, for a timeout, every rank's poison word say why)
// when a peer did not come in time, the group is poisoned, or the host
// aborted.
template <int N>
__device__ __forceinline__ bool awaitPack(const KernelArgs& a, uint32_t round, size_t i,
                                          uint32_t missing, Pack (&v)[N]) {
  uint32_t spins = 0;
  uint64_t start = 0;
  bool timing = false;
  while (true) {
#pragma unroll
    for (int r = 0; r < N; ++r) {
      if (missing & (1u << r)) {
        v[r] = loadPushed(pushSlot(a, a.rank, round, r) + i, a.deviceScope);
        if (arrived(v[r])) missing &= ~(1u << r);
      }
    }
    if (missing == 0) return true;
#ifdef TPCOMM_CAR_EMULATION
    std::this_thread::yield();  // spinning ranks share the CPU with working ones
#endif
    if ((++spins & 255) != 0) continue;
    const uint64_t now = globalTimer();
    if (!timing) {
      start = now;
      timing = true;
    }
    const uint32_t* poison = &signalOf(a, a.rank)->poison.value;
    const bool late = static_cast<int64_t>(now - start) > static_cast<int64_t>(a.timeoutNs);
    const uint32_t poisoned = loadRelaxed(poison);
    if (!late && poisoned == 0 && loadRelaxed(a.error) == 0) continue;
    if (poisoned != 0) {
      recordError(a, poisoned);
    } else if (late) {
      const uint32_t code = errorCode(lowestBit(missing), kPush, blockIdx.x);
      recordError(a, code);
      poisonGroup<N>(a, code);
    } else {
      // This rank's host aborted (its error word): poison this rank's own
      // word at once, so that its queued kernels push nothing.
      uint32_t* ownWord = &signalOf(a, a.rank)->poison.value;
      if (loadRelaxed(ownWord) == 0) storeRelease(ownWord, poisonCode(loadRelaxed(a.error), a.rank));
    }
    return false;
  }
}

// The rank-order sum of N wire packs, decoded, times the call's scale.
template <typename T, int N>
__device__ __forceinline__ Pack sumWire(const KernelArgs& a, const Pack (&v)[N]) {
  Pack d[N];
#pragma unroll
  for (int r = 0; r < N; ++r) d[r] = decodePack<T>(v[r]);
  return rankOrderSum<T, N>(d, a.scale);
}

// Steps 0-3, shared by the plain and the fused push. Returns false (on every
// thread of the block) when the call is refused: the group is poisoned.
// `pushAll(round)` pushes this thread's packs.
template <int N, typename PushAll>
__device__ __forceinline__ bool openPush(const KernelArgs& a, uint32_t epoch, uint32_t round,
                                         size_t pushedBytes, PushAll&& pushAll) {
#ifdef TPCOMM_CAR_EMULATION
  if (threadIdx.x == 0) emu::afterBarrier(emu::kBeforePush);  // a rank that comes late
  __syncthreads();
#endif
  const uint32_t stale = stalePushBytes(a, round);
  const uint32_t poisoned = loadRelaxed(&signalOf(a, a.rank)->poison.value);
  if (poisoned == 0) pushAll();
#ifdef TPCOMM_CAR_EMULATION
  __syncthreads();
  if (threadIdx.x == 0) emu::afterBarrier(kPush);  // a reader held back
  __syncthreads();
#endif
  launchDependents();  // a kernel launched after this one may start its prologue
  clearStalePush<N>(a, round, stale);
  if (__syncthreads_or(poisoned != 0)) {
    if (threadIdx.x == 0) recordError(a, loadRelaxed(&signalOf(a, a.rank)->poison.value));
    return false;
  }
  // Every thread of the block read the epoch and round before the barrier.
  if (threadIdx.x == 0) commitEpoch(a, epoch, round, pushedBytes);
  return true;
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads) pushOneShotKernel(KernelArgs a) {
  constexpr int kPer = Elements<T>::kPerPack;
  waitForPreviousGrid();
  const size_t packs = (a.count + kPer - 1) / kPer;
  const uint32_t epoch = nextEpoch(a);
  const uint32_t round = nextRound(a);
  const size_t first = blockIdx.x * blockDim.x + threadIdx.x;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const bool open = openPush<N>(a, epoch, round, packs * kPackBytes, [&] {
    for (size_t i = first; i < packs; i += stride) {
      pushPack<T, N>(a, round, i, loadElements<T>(a.input, i, a.count));
    }
  });
  if (!open) return;
  for (size_t i = first; i < packs; i += stride) {
    Pack v[N];
    if (!awaitPack<N>(a, round, i, ((1u << N) - 1u) & ~(1u << a.rank), v)) return;
    // The input is read again (not kept from the push): in place, this
    // thread writes pack i of the output only after this read. Its own
    // pack goes through the wire form too, so every rank sums the same bits.
#pragma unroll
    for (int r = 0; r < N; ++r) {
      if (r == a.rank) v[r] = encodePack<T>(loadElements<T>(a.input, i, a.count));
    }
    storeElements<T>(a.output, i, a.count, sumWire<T, N>(a, v));
  }
}

// The fused allreduce + residual add + RMSNorm on the push protocol
// (fused_kernels.cuh has the arithmetic): block b owns rows b, b + G, ...
// as the fused one-shot does. A row occupies ceil(hidden / pack) packs of
// every slot (its last pack padded), so the layout is the same on every
// rank whether its own pointers allow packs or not. Every rank pushes into
// its own slot too; a first pass waits until every pack of the block's rows
// has arrived, so nothing is written unless the whole call arrived, then the
// epilogue reads every rank's pack from this rank's buffer (in place is
// safe: the input is not read again).
template <typename T, int N>
struct PushedSums {
  const KernelArgs* a;
  uint32_t round;
  size_t perRow;  // packs per row in a slot
  __device__ __forceinline__ Pack sumAt(size_t slotPack) const {
    Pack v[N];
#pragma unroll
    for (int r = 0; r < N; ++r) v[r] = loadPushed(pushSlot(*a, a->rank, round, r) + slotPack, a->deviceScope);
    return sumWire<T, N>(*a, v);
  }
  // Pack i of the flat tensor (packed rows: hidden is a multiple of the pack).
  __device__ __forceinline__ Pack pack(size_t i) const { return sumAt(i); }
  // Element i of the flat tensor.
  __device__ __forceinline__ T element(size_t i) const {
    constexpr int kPer = Elements<T>::kPerPack;
    const size_t row = i / a->hidden, column = i % a->hidden;
    const Pack s = sumAt(row * perRow + column / kPer);
    T e[kPer];
    memcpy(e, &s, sizeof(Pack));
    return e[column % kPer];
  }
};

// Pack j of row `row` of this rank's input (padded with zero bits past the
// row's end), by packs when `packed`, else element by element.
// (A row that does not start on a pack boundary is read element by
// element: a 16-byte load there would be misaligned.)
template <typename T>
__device__ __forceinline__ Pack rowPack(const KernelArgs& a, size_t row, size_t j) {
  constexpr int kPer = Elements<T>::kPerPack;
  if (a.packed) return reinterpret_cast<const Pack*>(a.input)[row * (a.hidden / kPer) + j];
  return gatherElements<T>(reinterpret_cast<const T*>(a.input) + row * a.hidden + j * kPer,
                           a.hidden - j * kPer);
}

// The fused push's epilogue when every row is at most one pack per thread
// and this rank's pointers allow packs (the common case: hidden 4096 in
// bfloat16 is 512 packs): a thread keeps its pack's sum in registers and
// loads its residual and weight while it waits, so the row costs one wait,
// one block reduction and the two stores. Row by row, nothing of a row is
// written before all of its values arrived. The arithmetic and the order of
// the squares are normRow's (a thread sums its one pack front to back, then
// blockSum), so the bits are those of the other paths on every rank.
template <typename T, int N>
__device__ void fusedPushRows(const KernelArgs& a, uint32_t round, size_t rows) {
  constexpr int kPer = Elements<T>::kPerPack;
  const size_t per = a.hidden / kPer;
  const size_t j = threadIdx.x;
  const bool active = j < per;
  const Pack* residual = reinterpret_cast<const Pack*>(a.residual);
  Pack* residualOut = reinterpret_cast<Pack*>(a.residualOut);
  Pack* out = reinterpret_cast<Pack*>(a.output);
  Pack weight{};
  if (active) weight = reinterpret_cast<const Pack*>(a.weight)[j];
  for (size_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const size_t i = row * per + j;
    Pack v[N];
    Pack res{};
    int failed = 0;
    if (active) {
      res = residual[i];  // while the values travel
      failed = awaitPack<N>(a, round, i, (1u << N) - 1u, v) ? 0 : 1;
    }
    if (__syncthreads_or(failed)) return;
    float squares = 0.f;
    T oe[kPer];
    if (active) {
      const Pack sum = sumWire<T, N>(a, v);
      T se[kPer], re[kPer];
      memcpy(se, &sum, sizeof(Pack));
      memcpy(re, &res, sizeof(Pack));
#pragma unroll
      for (int k = 0; k < kPer; ++k) squares += addResidual<T>(se[k], re[k], &oe[k]);
    }
    const float inverse = 1.f / sqrtf(blockSum(squares) / static_cast<float>(a.hidden) + a.eps);
    if (active) {
      Pack o;
      memcpy(&o, oe, sizeof(Pack));
      residualOut[i] = o;
      T we[kPer], ne[kPer];
      memcpy(we, &weight, sizeof(Pack));
#pragma unroll
      for (int k = 0; k < kPer; ++k) ne[k] = normed<T>(oe[k], inverse, we[k]);
      memcpy(&o, ne, sizeof(Pack));
      out[i] = o;
    }
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kThreads) fusedPushKernel(KernelArgs a) {
  constexpr int kPer = Elements<T>::kPerPack;
  waitForPreviousGrid();
  const size_t rows = a.count / a.hidden;
  const size_t perRow = (a.hidden + kPer - 1) / kPer;
  const uint32_t epoch = nextEpoch(a);
  const uint32_t round = nextRound(a);
  const bool open = openPush<N>(a, epoch, round, rows * perRow * kPackBytes, [&] {
    for (size_t row = blockIdx.x; row < rows; row += gridDim.x) {
      for (size_t j = threadIdx.x; j < perRow; j += blockDim.x) {
        pushPack<T, N, true>(a, round, row * perRow + j, rowPack<T>(a, row, j));
      }
    }
  });
  if (!open) return;
  if (a.packed && perRow <= blockDim.x) {
    fusedPushRows<T, N>(a, round, rows);
    return;
  }
  int failed = 0;
  for (size_t row = blockIdx.x; row < rows && !failed; row += gridDim.x) {
    for (size_t j = threadIdx.x; j < perRow; j += blockDim.x) {
      Pack v[N];
      if (!awaitPack<N>(a, round, row * perRow + j, (1u << N) - 1u, v)) {
        failed = 1;
        break;
      }
    }
  }
  if (__syncthreads_or(failed)) return;
  const PushedSums<T, N> sums{&a, round, perRow};
  for (size_t row = blockIdx.x; row < rows; row += gridDim.x) normRow<T>(a, sums, row);
}

}  // namespace tpcomm::car
