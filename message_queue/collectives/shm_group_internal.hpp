#pragma once
// What shm_group.cpp (layout, signatures, steps, waits, failures) and
// shm_group_collectives.cpp (the collectives' data movement) share.
// Internal to message_queue/.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "message_queue/collectives/shm_group.hpp"

namespace tpcomm::mq {

constexpr size_t kLine = 64;
constexpr size_t kControlOffset = 1024;
constexpr size_t kReasonBytes = 512;  // an abort's text, as peers read it
constexpr size_t kPage = 4096;
// Chunk slots of each rank's buffer, used in turn (chunk k in slot k % 2).
// Two suffice for the two-phase allreduce's pipeline because no rank ever
// writes its own slice of a slot while copying in (shm_group.hpp).
constexpr size_t kSlots = 2;
// The least of a chunk (bytes a rank copies in) a worker thread's part
// holds (a smaller part costs more to hand over than it saves). Every phase
// of a chunk is split in the same parts, so the reduce phase of a two-phase
// allreduce, which moves (n + 1) / n of a slice, gives every thread work
// as the copies do, whatever the number of ranks.
constexpr size_t kSplitBytes = 256 << 10;
// A call whose chunk fills at most half a slot takes the next place in its
// slot (ShmGroup::beginCall), from chunks of kMovingMinBytes on, within the
// first kMovingWindowBytes of the slot: two slots of it a rank outgrow a
// core's L2 (the lines a peer read have left it when they are written
// again) and a group's buffers stay within a last-level cache even where
// TPCOMM_CPU_SHM_BUFFER_BYTES is large.
constexpr size_t kMovingMinBytes = 4 << 10;
constexpr size_t kMovingWindowBytes = 1 << 20;
static_assert(kMovingMinBytes >= kPage, "a moving call's places are whole pages");

enum class Op : uint8_t {
  kBarrier = 1,
  kAllreduce,
  kAllgather,
  kReduceScatter,
  kBroadcast,
  kAllreduceAddRmsNorm
};

const char* opName(Op op);

inline int reductionCode(const ReduceSpec& spec) {
  return static_cast<int>(spec.kind) | (spec.divisor != 1 ? 4 : 0) | (spec.premultiply ? 8 : 0);
}

inline size_t alignUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

inline size_t dataOffset(int size) { return alignUp(kControlOffset + kLine * size, kPage); }

// Elements of each rank's slice in a two-phase chunk of n elements: whole
// cache lines, so ranks never write the same line.
inline size_t sliceElements(size_t n, int size, size_t elementBytes) {
  const size_t perLine = kLine / elementBytes;
  return alignUp((n + size - 1) / size, perLine);
}

// What every rank of one call must agree on: op, dtype, reduction and root
// in `head`, the element (or byte) count in full in `count`, and in `extra`
// the fused call's eps (its bits) or the call's place in a coalesced list
// (top bit set, then index and length; 0 for a call on its own).
struct ShmGroup::Signature {
  uint64_t head = 0;
  uint64_t count = 0;
  uint64_t extra = 0;
  Signature(int op, int dtype, int reduction, int root, uint64_t n, uint64_t x = 0)
      : head((static_cast<uint64_t>(op) << 56) | (static_cast<uint64_t>(dtype & 0xff) << 48) |
             (static_cast<uint64_t>(reduction & 0xff) << 40) |
             static_cast<uint64_t>(static_cast<uint32_t>(root))),
        count(n),
        extra(x) {}
  Signature(uint64_t h, uint64_t c, uint64_t x) : head(h), count(c), extra(x) {}
  static uint64_t ofPart(const ShmPart& part) {
    if (part.of <= 1) return 0;
    return (1ull << 63) | (static_cast<uint64_t>(part.index & 0x7fffffff) << 32) | part.of;
  }
  static uint64_t ofEps(double eps) {
    uint64_t bits;
    std::memcpy(&bits, &eps, sizeof(bits));
    return bits;
  }
  bool operator==(const Signature& o) const {
    return head == o.head && count == o.count && extra == o.extra;
  }
  // "allreduce sum float32[4]": the call as an error message names it.
  std::string describe() const;
  // " (tensor 2 of a coalesced list of 3)", or "" for a call on its own.
  std::string partOf() const;
};

}  // namespace tpcomm::mq
