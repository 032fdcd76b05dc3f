#pragma once
// CPU collectives of a group whose ranks sit on several hosts: shared memory
// inside each host (an mq::ShmGroup over the host's ranks), torch's Gloo
// between hosts (sub-groups made collectively at set-up). Internal to
// coordinator/.
//
// Hosts are ordered by their lowest group rank; a host's ranks by group rank
// ("local rank" = index among them; local rank 0 is the host's leader).
//
//   allreduce   1. shared-memory allreduce inside each host (the host's
//                  partial; PREMUL_SUM's factor applied here)
//               2. between hosts (below), by the leaders (leaders path), or
//                  (slices path: every host has the same L >= 2 ranks, the
//                  count divides by L, the call is at least
//                  TPCOMM_CPU_HIER_SLICE_BYTES) by local rank i for slice i
//                  with its peers of local rank i on every host, all slices
//                  at once
//               3. leaders path: shared-memory broadcast from the leader;
//                  slices path: shared-memory all-gather of the slices
//   all-gather  shared memory inside each host, the leaders all-gather their
//               hosts' parts over Gloo, shared-memory broadcast of the rest
//   reduce-     up to TPCOMM_CPU_HIER_GATHER_BYTES: the allreduce above over
//   scatter     the whole input, each rank keeps its part; larger: the
//               host's partial in shared memory, a reduce-scatter between
//               the leaders (each host receives only its ranks' parts), a
//               shared-memory broadcast of the host's parts
//   broadcast   shared memory on the root's host, Gloo among leaders (up to
//               the gather size the root's leader sends it whole to each
//               host; larger: a scatter then an all-gather), shared memory
//               on the other hosts
//   barrier     shared memory, Gloo among leaders, shared memory
//
// Between hosts (H of them, in host order), each step is Gloo sends and
// receives, which run in the calling thread (Gloo's collectives hop to a
// worker thread and back, several times the cost of a small message, and
// cannot check that the hosts' calls agree). Every step starts with a
// gather of the hosts' call descriptions, in fixed-size blocks (the 64 B
// description and up to TPCOMM_CPU_HIER_INLINE_BYTES of payload, 32 by
// default, agreed at set-up) whatever the call, so that
// mismatched calls are found before Gloo sees messages of different sizes
// (which it answers by ending the process); the gather is Bruck's:
// ceil(log2 H) rounds, round k sending min(2^k, H - 2^k) blocks to the host
// 2^k below and receiving as many from the host 2^k above. Then:
//
//   payload (bytes)      | allreduce                          | bytes a host sends
//   ---------------------+------------------------------------+-------------------
//   <= inline (32 B)     | in the description blocks; every   | (H - 1) x 96 B
//                        | host reduces all H in host order   |
//   <= gather size       | every host sends its partial to    | (H - 1) x
//                        | every other; each reduces in order |   (payload + 96 B)
//   larger               | reduce-scatter: host h gets chunk h| 2 (H - 1) / H
//                        | of every host, reduces it in host  |   x payload
//                        | order; all-gather of the chunks    |
//
// Every algorithm reduces each element over the hosts' partials in host
// order with the same kernels, so the result is the same bits whichever
// one a call takes.
//
// Results are bitwise identical on every rank and on both allreduce paths:
// each element is reduced in rank order within a host (shm_reduce.hpp's
// rules), then the hosts' partials in host order. Every step between hosts
// begins with the gather of the call's description (op, dtype, count, root,
// reduction, coalesced part, call number); a leader that receives another
// description raises InvalidUsage naming both calls and the hosts, before
// any message whose size depends on the call. A failed step between
// hosts (a host gone: its connections close) raises PeerLost naming the
// other hosts and their ranks; either way the rank aborts its host's
// shared-memory group with that text, so that its host's ranks raise it too.
// The shared-memory waits inside a host are bounded by twice the group's
// timeout, so that a step between hosts (bounded by the timeout) reports
// first. After a failure every call raises the first failure.

#include <array>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "coordinator/cpu/cpu_shm_path.hpp"
#include "message_queue/collectives/shm_group.hpp"

namespace tpcomm::coord {

// Makes a backend for (store, rank, size, timeout): the device backend, and
// the Gloo sub-groups of a group across hosts.
using BackendFactory = std::function<c10::intrusive_ptr<c10d::Backend>(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout)>;

struct HostLayout {
  std::vector<std::string> names;         // per host: its name (host identity before '#')
  std::vector<int> hostOf;                // per group rank
  std::vector<std::vector<int>> ranksOn;  // per host: its group ranks, ascending
  int rank = 0;

  // From every rank's host identity (hostIdentity()), as every rank computes
  // it from the same all-gathered list.
  static HostLayout of(const std::vector<std::string>& identities, int rank);
  int hosts() const { return static_cast<int>(ranksOn.size()); }
  int host() const { return hostOf[rank]; }
  int localRank() const;
  int localSize() const { return static_cast<int>(ranksOn[host()].size()); }
  // Whether every host has the same number of ranks.
  bool even() const;
  // "host 'b' (ranks 2, 3)"
  std::string describeHost(int h) const;
  // "2 hosts: 'a' (ranks 0, 1), 'b' (ranks 2, 3)"
  std::string describe() const;
};

class HierGroup {
 public:
  struct Parts {
    HostLayout layout;
    std::unique_ptr<mq::ShmGroup> local;        // null where the host has one rank of the group
    c10::intrusive_ptr<c10d::Backend> leaders;  // the hosts' leaders: leaders only
    // This local rank's peers (same local rank) on every host: even layouts
    // with two or more ranks per host; the leaders' group for local rank 0.
    c10::intrusive_ptr<c10d::Backend> slices;
    uint64_t sliceMinBytes = 256 << 10;
    // Allreduce payloads between hosts up to this size gather every host's
    // partial; larger ones reduce-scatter then all-gather.
    uint64_t gatherMaxBytes = 4096;
    // Payload bytes that ride in the description blocks (every rank agreed).
    uint64_t inlineBytes = 32;
    // Ranks of the group on this machine's cores (hosts that are namespaces
    // of one kernel share them): the local group's waiting policy.
    int machineRanks = 1;
    // The reductions' kernel level every rank of the group agreed on.
    mq::ReduceIsa reduceIsa = mq::bestReduceIsa();
    std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  };
  explicit HierGroup(Parts parts);
  ~HierGroup();
  HierGroup(const HierGroup&) = delete;
  HierGroup& operator=(const HierGroup&) = delete;

  const HostLayout& layout() const { return parts_.layout; }
  mq::ShmGroup* local() const { return parts_.local.get(); }

  // As mq::ShmGroup's calls, over the whole group: `spec` is the whole
  // group's reduction (AVG's divisor the group's size). `out` may be `in`.
  void allreduce(const void* in, void* out, size_t count, mq::DType dtype,
                 const mq::ReduceSpec& spec, const mq::ShmPart& part = {});
  void allgather(const void* in, size_t bytes, const std::vector<void*>& outs,
                 const mq::ShmPart& part = {});
  void reduceScatter(const std::vector<const void*>& ins, void* out, size_t count, mq::DType dtype,
                     const mq::ReduceSpec& spec, const mq::ShmPart& part = {});
  void broadcast(void* data, size_t bytes, int root);
  void barrier();

  // Which allreduce path a call of `count` elements of `dtype` takes:
  // "leaders" or "slices".
  const char* allreducePath(size_t count, mq::DType dtype) const;
  uint64_t sliceMinBytes() const { return parts_.sliceMinBytes; }
  uint64_t gatherMaxBytes() const { return parts_.gatherMaxBytes; }
  uint64_t inlineBytes() const { return parts_.inlineBytes; }
  // How a step between hosts of `bytes` of payload reduces: "gather" or
  // "reduce_scatter" (the table above).
  const char* betweenHostsAlgorithm(size_t bytes) const {
    return bytes <= parts_.gatherMaxBytes ? "gather" : "reduce_scatter";
  }
  int machineRanks() const { return parts_.machineRanks; }
  // The reductions' kernel level (inside the host and between hosts); every
  // rank of the group sets the same, as ShmGroup::setReduceIsa.
  void setReduceIsa(mq::ReduceIsa isa);
  mq::ReduceIsa reduceIsa() const { return reduceIsa_.load(std::memory_order_relaxed); }
  void setTimeout(std::chrono::milliseconds timeout);
  // Empty while the group works; else its first failure.
  std::string failure() const;
  // Fails every later call, and the host's shared-memory group.
  void abort(const std::string& why);

  struct Call;  // a call's description, as it travels between hosts

 private:
  // The allreduce, described as `op` (allreduce or reduce-scatter); the
  // caller holds mutex_.
  void reduceAll(uint32_t op, const void* in, void* out, size_t count, mq::DType dtype,
                 const mq::ReduceSpec& spec, const mq::ShmPart& part);
  // The next call's description as a reduction `op` of `count` elements.
  Call reductionCall(uint32_t op, size_t count, mq::DType dtype, const mq::ReduceSpec& spec,
                     const mq::ShmPart& part);
  // Step 1 of a reduction: the host's partial in `out` (shared memory; the
  // ranks' PREMUL_SUM factors applied, AVG's divisor left for later).
  void hostPartial(const void* in, void* out, size_t count, mq::DType dtype,
                   const mq::ReduceSpec& spec, const mq::ShmPart& part);
  void throwIfFailed() const;
  // The next call's description, numbered (the caller holds mutex_).
  Call nextCall(uint32_t op);
  // Runs a shared-memory step of this host, naming the host on failure.
  template <typename Fn>
  void onHost(const Fn& fn);
  // What a step between hosts received: host h's payload at
  // buffer + ((h - rotation) mod hosts) * stride + offset (Bruck's gather
  // leaves host me + i at block i).
  struct Received {
    at::Tensor buffer;
    size_t stride = 0;
    size_t offset = 0;
    int rotation = 0;
    int hosts = 1;
    const char* source(int h) const {
      const int at = ((h - rotation) % hosts + hosts) % hosts;
      return static_cast<const char*>(buffer.data_ptr()) + at * stride + offset;
    }
  };
  // Steps between hosts over `backend` (one rank per host, in host order;
  // cpu_hier_steps.cpp), through Gloo's point-to-point sends and receives.
  // Each starts by gathering every host's description of the call and
  // checking it against this rank's (the table above).
  // Every host's `bytes` of payload.
  Received gatherBetweenHosts(c10d::Backend& backend, const Call& call, const void* payload,
                              size_t bytes);
  // `data` (count elements, this host's partial) becomes the hosts' partials
  // reduced in host order.
  void allreduceBetweenHosts(c10d::Backend& backend, const Call& call, void* data, size_t count,
                             mq::DType dtype, const mq::ReduceSpec& spec);
  // `whole` (this host's partial of every rank's part, rank order, `bytes`
  // per rank) reduced over the hosts for this host's ranks only, into
  // `mine` (this host's ranks' parts, in their order). Leaders.
  void reduceScatterBetweenHosts(const Call& call, const char* whole, size_t count,
                                 mq::DType dtype, const mq::ReduceSpec& spec, char* mine);
  void broadcastBetweenHosts(const Call& call, void* data, size_t bytes, int rootHost);
  [[noreturn]] void failBetweenHosts(const Call& call, const std::exception& e);
  void checkCalls(const Call& mine, const std::vector<Call>& theirs);
  void reduceHosts(const Received& received, void* out, size_t count, mq::DType dtype,
                   const mq::ReduceSpec& spec);

  // A buffer of at least `bytes` kept for the next calls (a fresh large
  // allocation is mapped anew and faulted in on every call). Calls hold
  // mutex_; each slot has one use per call.
  enum Slot {
    kSendSlot,
    kDescriptionsSlot,
    kPayloadsSlot,
    kGatheredSlot,
    kBlockSlot,
    kHostPartsSlot,
    kSlots
  };
  at::Tensor scratch(int slot, size_t bytes);

  // Declared before parts_ so that they outlive the Gloo sub-groups.
  std::array<at::Tensor, kSlots> scratch_;
  std::vector<char> wholeInput_;  // reduceScatter's input, in rank order
  Parts parts_;
  std::atomic<mq::ReduceIsa> reduceIsa_{mq::ReduceIsa::kPortable};
  uint64_t calls_ = 0;  // calls so far (the description's call number)
  std::mutex mutex_;    // one call at a time
  mutable std::mutex failureMutex_;
  std::string failure_;
};

struct HierSetup {
  std::unique_ptr<HierGroup> group;  // null when the group does not use it
  std::string reason;                // why not
};

// Collective over the whole group (every rank calls it after setUpCpuShm
// found its ranks on several hosts, `identities` being every rank's host):
// the host's Gloo sub-group and its shared-memory group (setUpCpuShm over
// that sub-group), the leaders' and the slices' Gloo sub-groups from
// `factory` over `store` (prefixed "tpcomm-hier/"), then an all-gather over
// `cpu` of every rank's failure, so that all use the path or none does.
// Not used when every rank is alone on its host (nothing to share).
// Throws InvalidUsage on every rank when `requiredBy` (the ranks with
// TPCOMM_CPU_SHM=1) is not empty and it failed.
// (cpu_hier_setup.cpp, with HostLayout.)
HierSetup setUpHier(c10d::Backend& cpu, const BackendFactory& factory,
                    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                    const std::vector<std::string>& identities, const CpuShmConfig& config,
                    std::chrono::milliseconds timeout, const std::string& requiredBy);

}  // namespace tpcomm::coord
