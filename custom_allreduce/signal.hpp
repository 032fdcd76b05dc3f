#pragma once
// The signal area at the start of every rank's buffer, and the protocol the
// kernels run over it (host-visible layout; device code in signal.cuh).
//
//   flags[block][phase][peer]   written by `peer` (st.release.sys), read by
//                               this rank (ld.acquire.sys); one 128-byte slot
//                               each, so no two writers share a cache line
//   probe[peer]                 the eligibility check's write probe
//   epoch[block]                this rank's call counter per block index
//
// Per call, block b of every rank:
//
//   step | does                                          | then
//   -----+-----------------------------------------------+--------------------
//   0    | e = ++epoch[b] (in device memory: each graph  |
//        | replay is a new call)                         |
//   1    | copies its share of the input to its staging  |
//   2    | start: writes e to flags[b][start][me] of     | peers' staging
//        | every peer; waits flags[b][start][p] >= e     | shares are complete
//   3    | one-shot: sums all stagings -> output         |
//        | two-shot: sums part `me` -> own result,       |
//        | middle barrier, gathers parts -> output       |
//   4    | end: as start, phase end                      | peers are done
//        |                                               | reading our buffers
//
// Block b of every rank touches the same elements in every step (one fixed
// partition of the packs over blocks and threads), so a per-block barrier
// orders everything that block reads. Flags only grow (no flag is ever
// reset between calls), so a stale flag cannot pass for a fresh one. Every
// wait is bounded by %globaltimer: on timeout the block writes an error
// code (bit 31 | phase << 16 | block << 8 | peer) to the error word and
// exits; the host raises naming the peer.

#include <cstdint>

#include "custom_allreduce/custom_allreduce.hpp"

namespace tpcomm::car {

inline constexpr int kPhases = 3;
enum Phase : int { kStart = 0, kMiddle = 1, kEnd = 2 };
// Not a barrier: the "phase" of the error code a kernel writes when its
// zero-copy table was never filled.
inline constexpr int kNotRegistered = 3;

struct alignas(128) FlagSlot {
  uint32_t value;
  uint32_t pad[31];
};

struct Signal {
  FlagSlot flags[kMaxBlocks][kPhases][kMaxRanks];
  FlagSlot probe[kMaxRanks];
  uint32_t epoch[kMaxBlocks];
};

inline constexpr uint32_t kErrorBit = 1u << 31;

inline constexpr uint32_t errorCode(int peer, int phase, int block) {
  return kErrorBit | (static_cast<uint32_t>(phase) << 16) | (static_cast<uint32_t>(block) << 8) |
         static_cast<uint32_t>(peer);
}

}  // namespace tpcomm::car
