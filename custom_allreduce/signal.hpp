#pragma once
// The signal area at the start of every rank's buffer, and the protocol the
// kernels run over it (host-visible layout; device code in signal.cuh).
//
//   flags[block][phase][peer]   written by `peer` (a release store), read by
//                               this rank (an acquire load); one 128-byte slot
//                               each, so no two writers share a cache line.
//                               System scope, or GPU scope when every rank
//                               of the group runs on one GPU (deviceScopeFor)
//   probe[peer]                 the eligibility check's write probe
//   poison                      nonzero once any rank's kernel gave up: the
//                               failure code, written by the rank that gave up
//                               into every rank's buffer
//   epoch[block]                this rank's call counter per block index
//   round[block]                this rank's push round per block index (the
//                               call count modulo kPushDepth)
//   pushed[k]                   bytes per source rank that peers pushed into
//                               this rank's push buffer k (0..kPushDepth-1)
//                               in the call that used it; the next call
//                               clears that many (push_kernels.cuh)
//
// The push buffers follow the Signal in the same area (BufferLayout::
// pushOffset; zeroed with it): push[k][source] for k < kPushDepth, one slot
// of BufferLayout::pushSlotBytes per source rank. Their protocol, which has
// no flags at all, is at the top of push_kernels.cuh.
//
// Per call, block b of every rank:
//
//   step | does                                          | then
//   -----+-----------------------------------------------+--------------------
//   0    | every thread reads e = epoch[b] + 1; thread 0 |
//        | reads poison and the zero-copy table's        |
//        | `ready` (once per block; the verdict reaches  |
//        | every thread through __syncthreads_or); once  |
//        | the start barrier passed, thread 0 stores e   |
//        | back (in device memory: each graph replay is  |
//        | a new call), block 0 for the unused block     |
//        | indices too                                   |
//   1    | copies its share of the input to its staging  |
//        | of parity e & 1 (overlapping step 0's loads)  |
//   2    | start: writes e to flags[b][start][me] of     | peers' staging
//        | every peer; waits flags[b][start][p] >= e     | shares are complete
//   3    | one-shot: sums all stagings -> output; done   |
//        | (zero-copy: end barrier, as peers read this   |
//        | rank's own input, which its caller may        |
//        | rewrite once the kernel ends)                 |
//        | two-shot: sums part `me` -> own result,       |
//        | middle barrier, gathers parts -> output; no   |
//        | end barrier (see below)                       |
//
// Block b of every rank touches the same elements in every step (one fixed
// partition of the packs over blocks and threads), so a per-block barrier
// orders everything that block reads. Flags only grow (no flag is ever
// reset between calls), so a stale flag cannot pass for a fresh one. Every
// wait is bounded by %globaltimer.
//
// Staging parity. Each rank has two staging regions; call e stages into
// region e & 1. Every block index's epoch is the number of calls made (block
// 0 advances the indices a call does not use), so the parity is the same in
// every block and on every rank whatever block counts the calls use. A
// rank's launches are serialised (host side, launch order), so when its call
// e + 1 starts staging, its kernel e has passed call e's start barrier in
// every block: each peer had started its kernel e, so each peer's kernel
// e - 1, the last one that read region (e + 1) & 1 of ours, had ended.
// Call e's readers of region e & 1 are never disturbed by call e + 1, which
// writes the other region. Hence the one-shot needs no end barrier, and the
// two-shot's staging is safe without one too (its result region: below).
// This assumes that call e passed its start barrier: a kernel whose call
// failed or was refused leaves the group poisoned (this rank's own poison
// word at least, written by the kernel that gave up), and a poisoned rank's
// kernels stage nothing. Zero-copy or not is the same on every rank of a
// call (only a zero-copy one-shot waits at the end barrier).
//
// Why two-shot needs no end barrier: a peer's block reaching the start
// barrier of call k+1 means that peer's whole kernel k has finished,
// including its gather of our result region. Our result region is rewritten
// only after that start barrier. Both hold whatever block counts k and k+1
// use.
//
// Failure: a block that waits in vain writes an error code (bit 31 |
// phase << 16 | block << 8 | peer) to its rank's error word (mapped host
// memory) and the same code, with its own rank in bits 24..27 (rank + 1), to
// every rank's poison word. A kernel that finds its poison word set (at
// entry, while waiting, after a barrier) copies it to its error word and
// stops without touching its output: queued kernels and graph replays after
// a failure end at once with the original cause instead of handing a slow
// peer wrong data or waiting out their own timeout. Poison stays until the
// group's collective reset (every rank synchronised, CPU barrier, signals
// zeroed, CPU barrier).
//
// Abort (the group broke: an abort, a peer's refusal or failure on another
// route): the host writes abortCode(rank) into its own error word (mapped
// host memory, so its kernels that wait see it at once) and the poisoned
// form into every rank's poison word (a 4-byte copy per rank on a private
// stream; the copy engines run beside the spinning kernels). Running kernels
// of every rank stop in their barrier, queued ones at entry.

#include <cstdint>

#include "custom_allreduce/custom_allreduce.hpp"

namespace tpcomm::car {

inline constexpr int kPhases = 3;
enum Phase : int { kStart = 0, kMiddle = 1, kEnd = 2 };
// Not a barrier: the "phase" of the error code a kernel writes when its
// zero-copy table was never filled.
inline constexpr int kNotRegistered = 3;
// Not a barrier either: the "phase" of the code the host writes when the
// group is aborted (CustomAllreduce::abort); its peer field is the rank that
// aborted.
inline constexpr int kAborted = 4;
// Not a barrier: the "phase" of a push one-shot that waited in vain for a
// peer's values (push_kernels.cuh).
inline constexpr int kPush = 5;
// Push buffers per rank, used in rotation by call count: call e writes
// buffer e % 3 while its owner clears buffer (e - 1) % 3 (push_kernels.cuh
// proves why two are not enough).
inline constexpr int kPushDepth = 3;

struct alignas(128) FlagSlot {
  uint32_t value;
  uint32_t pad[31];
};

struct Signal {
  FlagSlot flags[kMaxBlocks][kPhases][kMaxRanks];
  FlagSlot probe[kMaxRanks];
  FlagSlot poison;
  uint32_t epoch[kMaxBlocks];
  uint32_t round[kMaxBlocks];
  uint32_t pushed[kPushDepth];
};

inline constexpr uint32_t kErrorBit = 1u << 31;

inline constexpr uint32_t errorCode(int peer, int phase, int block) {
  return kErrorBit | (static_cast<uint32_t>(phase) << 16) | (static_cast<uint32_t>(block) << 8) |
         static_cast<uint32_t>(peer);
}

// The code `reporter` writes into every rank's poison word.
inline constexpr uint32_t poisonCode(uint32_t code, int reporter) {
  return (code & ~(0xfu << 24)) | (static_cast<uint32_t>(reporter + 1) << 24);
}
// The code a rank's abort writes into its own error word (and, with itself
// as reporter, into every rank's poison word).
inline constexpr uint32_t abortCode(int rank) { return errorCode(rank, kAborted, 0); }
inline constexpr bool isAbort(uint32_t code) { return ((code >> 16) & 0x7f) == kAborted; }
// Which rank gave up (-1: this rank's own code).
inline constexpr int reporterOf(uint32_t code) { return static_cast<int>((code >> 24) & 0xf) - 1; }

}  // namespace tpcomm::car
