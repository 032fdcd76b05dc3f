#pragma once
// The description of a collective across hosts, as it travels between the
// hosts with every step (cpu_hier_path.hpp). Internal to coordinator/cpu.

#include <cstdint>
#include <cstring>
#include <string>

#include "common/error.hpp"
#include "coordinator/cpu/cpu_hier_path.hpp"
#include "message_queue/collectives/shm_reduce.hpp"

namespace tpcomm::coord {

// ---- the call's description --------------------------------------------------

namespace hier {

constexpr uint64_t kCallMagic = 0x7470636f6d6d6831ULL;  // "tpcommh1"
constexpr size_t kCallBytes = 64;
// Payloads up to TPCOMM_CPU_HIER_INLINE_BYTES (HierGroup::Parts::
// inlineBytes, 32 by default, at most 4096) travel in the blocks of the
// description gather (ceil(log2 H) rounds): blocks of 96 B by default, so a
// 4 B allreduce sends (H - 1) x 96 B of blocks a host, at 8 hosts about
// 1.9 KB on the wire with Gloo's and TCP's headers and acknowledgements.
// Larger payloads follow in one more round, once every host described the
// same call.

enum class HierOp : uint32_t { kAllreduce = 1, kAllgather, kReduceScatter, kBroadcast, kBarrier };

inline const char* hierOpName(uint32_t op) {
  switch (static_cast<HierOp>(op)) {
    case HierOp::kAllreduce:
      return "allreduce";
    case HierOp::kAllgather:
      return "all_gather";
    case HierOp::kReduceScatter:
      return "reduce_scatter";
    case HierOp::kBroadcast:
      return "broadcast";
    case HierOp::kBarrier:
      return "barrier";
  }
  return "unknown call";
}

// The reduction's code in a description: kind, AVG, PREMUL_SUM.
inline uint32_t reductionCode(const mq::ReduceSpec& spec) {
  return static_cast<uint32_t>(spec.kind) | (spec.divisor != 1 ? 16u : 0u) |
         (spec.premultiply ? 32u : 0u);
}

}  // namespace hier

struct HierGroup::Call {
  uint64_t magic = hier::kCallMagic;
  uint64_t number = 0;
  uint32_t op = 0;
  uint32_t dtype = 0xff;  // none
  uint64_t count = 0;     // elements (bytes for all-gather and broadcast)
  int64_t root = -1;
  uint32_t reduction = 0xff;  // none
  uint32_t partIndex = 0;
  uint32_t partOf = 1;
  uint32_t pad[3] = {0, 0, 0};

  std::string describe() const {
    if (magic != hier::kCallMagic) return "something that is not a tpcomm call";
    std::string out = hier::hierOpName(op);
    if (reduction != 0xff) {
      std::string how = mq::reduceKindName(static_cast<mq::ReduceKind>(reduction & 15));
      if (reduction & 16) how = "avg";
      if (reduction & 32) how = "premul_sum";
      out += " " + how;
    }
    if (dtype != 0xff) {
      out += detail::concat(" ", mq::dtypeName(static_cast<mq::DType>(dtype)), "[", count, "]");
    } else if (static_cast<hier::HierOp>(op) != hier::HierOp::kBarrier) {
      out += detail::concat(" of ", count, " B");
    }
    if (root >= 0) out += detail::concat(" root=", root);
    if (partOf > 1) out += detail::concat(" (tensor ", partIndex + 1, " of ", partOf, ")");
    return out + detail::concat(" (call #", number, ")");
  }
  bool operator==(const Call& o) const { return std::memcmp(this, &o, sizeof(Call)) == 0; }
};
static_assert(sizeof(HierGroup::Call) == hier::kCallBytes, "a call's description is one cache line");

}  // namespace tpcomm::coord
