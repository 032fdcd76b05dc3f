#pragma once
// tpcomm::mq::ShmGroup — collectives among the processes of one host through
// one shared-memory region: allreduce, all-gather, reduce-scatter, broadcast
// and barrier on raw buffers. Plain C++ (no torch); the coordinator maps
// tensors onto it (coordinator/cpu/cpu_shm_path.hpp). The public header of the
// shared-memory collectives, beside the ring's (ring.hpp).
//
// Region layout (one region per group, created by rank 0, see
// shared_region.hpp; offsets from its base):
//
//   +------------------------------+ 0
//   | Header                       |  magic, version, size, bufferBytes;
//   |                              |  abort word (first failing rank + cause);
//   |                              |  futex word + sleeper count
//   +------------------------------+ kControlOffset
//   | Control[size]                |  one cache line per rank: arrived (u64),
//   |                              |  signature[2] (3 x u64, by step parity)
//   +------------------------------+ dataOffset (page aligned)
//   | rank 0: slot 0 | slot 1      |  2 x bufferBytes per rank
//   | rank 1: slot 0 | slot 1      |
//   | ...                          |
//   +------------------------------+
//
// Protocol. Every rank counts synchronisation steps s = 1, 2, ... and data
// chunks k = 0, 1, ...; chunk k uses slot k % 2 of every rank's buffer.
//
//   action                      | by          | ordering
//   ----------------------------+-------------+-------------------------------
//   write own slot (chunk k)    | owner       | before arriving at its step s
//   arrive at step s            | every rank  | signature[s%2] relaxed, then
//                               |             | arrived = s (seq_cst store)
//   wait for step s             | every rank  | arrived[j] >= s (acquire) for
//                               |             | every j, then compare signatures
//   read peers' slots           | every rank  | after step s, done before the
//                               |             | rank arrives at its next step
//
// Most calls take one step a chunk (copy in, step, read): a slot is written
// again only by chunk k + 2, after its owner passed the first step of chunk
// k + 1, which every rank reaches only once it finished reading chunk k.
// A two-phase allreduce is a pipeline of one step a chunk too (K chunks:
// K + 1 steps). Between steps j and j + 1 every rank, r among them,
//
//   copies out chunk j - 2  reads every peer's slot (j - 2) % 2 at its owner's
//                           slice (the reduced slice the owner wrote there)
//   reduces chunk j - 1     reads every rank's slot (j - 1) % 2 at r's slice
//                           (r's own input in r's place), writes it into
//                           r's slot (j - 1) % 2 at r's slice and into r's
//                           output (r's slice of the output is done there)
//   copies in chunk j       writes r's slot j % 2 = (j - 2) % 2 everywhere
//                           but at r's slice
//
// No rank is a phase ahead or behind (each phase ends at a step every rank
// must reach), and in one phase every write to r's slots misses every read
// of them: a rank never copies in its own slice (it reduces that slice from
// its input, or, for PREMUL_SUM, from its scaled copy in its output), the
// only part of slot (j - 2) % 2 read in that phase, and reduces into its
// own slice only, the only part of slot (j - 1) % 2 its peers do not read.
// That needs a rank's slice to be the same part of every chunk: one slice
// size serves every chunk of a call, its shorter last one included.
// A call whose chunks fill at most half a slot starts at place
// (k / 2) mod P of its slots, k its first chunk (P places of the call's
// chunk size fit the slot's first MiB; ShmGroup::beginCall): consecutive
// chunks still lie in different slots and every chunk of a call at one
// place (the pipeline above needs that), and calls of one size rewrite a
// line only after they went through the places of both slots.
//
// Flags are never reset: step numbers only grow, so a stale value cannot
// pass a wait.
//
// Each step also carries a signature of the call (op, dtype, count, root,
// the fused call's eps, its place in a coalesced list);
// ranks that disagree all throw InvalidUsage at the same step, naming every
// rank's call, and the group stays usable. Waits poll (sched_yield after the
// first few polls, so more ranks than cores progress) for the spin window,
// then sleep on the futex word, which an arriving rank bumps only when the
// sleeper count says someone sleeps. Every wait ends at the timeout (Timeout)
// or when a rank it waits for has died (PeerLost, zombies included); either
// marks the group failed in the header, so every rank's next wait fails too
// instead of waiting out its own timeout, and later calls throw at once.
//
// Thread safety: calls on one ShmGroup are serialised by a mutex; ranks must
// issue the same calls in the same order (as with any collective).
// setTimeout, failure and abort may be called from any thread at any time.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "message_queue/collectives/shm_reduce.hpp"
#include "message_queue/collectives/worker_pool.hpp"
#include "message_queue/region/futex.hpp"
#include "message_queue/region/shared_region.hpp"

namespace tpcomm::mq {

struct ShmGroupOptions {
  int rank = 0;
  int size = 1;
  // Bytes of each of a rank's two slots (the chunk size); a multiple of 64.
  uint64_t bufferBytes = 1 << 20;
  // Allreduces of at least this many bytes reduce-scatter then all-gather
  // inside shared memory (each rank reduces 1/size of every chunk).
  uint64_t twoPhaseMinBytes = 16 << 10;
  // How long a wait polls before it sleeps on the futex, and whether it
  // yields the core while it polls (for more ranks than cores).
  std::chrono::microseconds spin{50};
  bool yield = true;
  // The reductions' vector kernels (every level gives the same bits); one
  // this CPU cannot run falls back to the best it can.
  ReduceIsa reduceIsa = bestReduceIsa();
  // Threads (this one included) that split the copies and reductions of a
  // large chunk: a chunk of at least 256 KiB a thread is split in as many
  // parts as threads for every phase of it (copy in, reduce, copy out); a
  // smaller one in as many parts as it has 256 KiB. 1: this thread only.
  // Results do not depend on it.
  int threads = 1;
  // The CPUs the threads - 1 worker threads are pinned to, one each (empty:
  // where the scheduler puts them), and how long a worker out of parts polls
  // for the next before it sleeps (WorkerPool; 0: sleeps at once).
  std::vector<int> workerCpus;
  std::chrono::microseconds workerSpin{0};
  // The NUMA node this rank's slots are bound to before it allocates them
  // (SharedRegion::bindToNode; -1: wherever this thread first touches them).
  int memoryNode = -1;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // The ranks as errors name them (one per rank: a host's part of a
  // hierarchical group names the whole group's ranks); empty: 0..size-1.
  std::vector<int> rankNames;
};

// A call's place in a coalesced list (tensor `index` of `of`): part of the
// call's signature, so that ranks whose lists differ in length are named
// instead of pairing calls of equal size.
struct ShmPart {
  uint32_t index = 0;
  uint32_t of = 1;
};

// What a rank's waits for its peers at the steps of its calls saw (the
// worker threads' hand-overs are not counted): how many found every peer
// there, were met while polling, or slept on the futex first, and the time
// spent polling and sleeping. Counted since the group was set up; a wait
// that raised while polling counts only in `waits`, one that raised after
// a sleep (a timeout, a lost peer) as slept. A reader on another thread
// may see a wait in `waits` before it sees its kind.
struct ShmWaitStats {
  uint64_t waits = 0;
  uint64_t atOnce = 0;
  uint64_t metPolling = 0;
  uint64_t slept = 0;
  uint64_t pollNs = 0;   // polling, whether a peer came during it or not
  uint64_t sleepNs = 0;  // from the first sleep to the wait's end
  // The late waits (met polling or after a sleep, failed ones included) by
  // how long they took:
  // late[0] under 2 us, late[b] from 2^b to 2^(b+1) us, the last one on.
  static constexpr int kLateBuckets = 17;
  uint64_t late[kLateBuckets] = {};
};

class ShmGroup {
 public:
  // Bytes of the region for `size` ranks; throws InvalidUsage if absurd.
  static size_t regionBytes(int size, uint64_t bufferBytes);
  // Writes the header of a fresh (zeroed) region; the creator calls it
  // before any peer attaches. Every rank's options must match it.
  static void initRegion(char* base, int size, uint64_t bufferBytes, uint64_t twoPhaseMinBytes);

  // `region` must have been initialised for options.size ranks, bufferBytes
  // and twoPhaseMinBytes; `pids[r]` is rank r's process, watched from here on
  // (PeerProcess in futex.hpp), so every peer must be alive now. Throws
  // System if the header does not match.
  //
  // Destroying the group tells the peers: their current and later calls
  // raise PeerLost naming this rank ("left the group"), instead of waiting
  // out the timeout. A process forked from this one cannot use the group:
  // its calls raise InvalidUsage before touching shared memory or the
  // group's lock, and its copy leaves without telling anyone.
  ShmGroup(std::unique_ptr<SharedRegion> region, const ShmGroupOptions& options,
           std::vector<int32_t> pids);
  ~ShmGroup();

  // out = reduction over ranks of `in` (count elements). `out` may be `in`.
  void allreduce(const void* in, void* out, size_t count, DType dtype, const ReduceSpec& spec,
                 const ShmPart& part = {});
  // The allreduce fused with a transformer layer's residual add and RMSNorm
  // (reduceAddRmsNorm in shm_reduce.hpp) over `rows` rows of norm.hidden
  // elements of `in`: the add and the norm run in the reduction's pass,
  // with this rank's own residual and weight. `in` may be normed or
  // residualOut; residualOut may be residual. Chunks hold whole rows:
  // InvalidUsage when a row exceeds bufferBytes (the caller composes then).
  void allreduceAddRmsNorm(const void* in, size_t rows, DType dtype, const NormRows& norm);
  // outs[r] = rank r's `in` (bytes each). outs[rank] may be `in`.
  void allgather(const void* in, size_t bytes, const std::vector<void*>& outs,
                 const ShmPart& part = {});
  // out = reduction over ranks of their ins[rank] (count elements each).
  void reduceScatter(const std::vector<const void*>& ins, void* out, size_t count, DType dtype,
                     const ReduceSpec& spec, const ShmPart& part = {});
  // data on every rank = data of `root` (bytes).
  void broadcast(void* data, size_t bytes, int root);
  void barrier();

  // The reductions' kernel level from the next call on (one this CPU cannot
  // run falls back to the best it can); any thread, any time.
  void setReduceIsa(ReduceIsa isa);
  // The waits' polling window and yielding from the next wait on.
  void setSpin(std::chrono::microseconds spin, bool yield);
  std::chrono::microseconds spin() const {
    return std::chrono::microseconds(spinUs_.load(std::memory_order_relaxed));
  }
  bool yields() const { return yield_.load(std::memory_order_relaxed); }
  // This rank's waits so far; any thread, any time.
  ShmWaitStats waitStats() const;
  int threads() const { return pool_ ? pool_->threads() : 1; }
  // Worker threads pinned as options.workerCpus asked.
  int pinnedWorkers() const { return pool_ ? pool_->pinned() : 0; }
  // Parts of chunks handed to the worker threads so far (WorkerPool's
  // partsSplit; 0 without workers).
  uint64_t partsSplit() const { return pool_ ? pool_->partsSplit() : 0; }
  // 0 when this rank's slots were bound to options.memoryNode, else why not
  // (an errno; -1: no node was asked for, or no whole page to bind).
  int memoryBinding() const { return memoryBinding_; }
  ReduceIsa reduceIsa() const { return reduceIsa_.load(std::memory_order_relaxed); }
  void setTimeout(std::chrono::milliseconds timeout);
  std::chrono::milliseconds timeout() const;
  const ShmGroupOptions& options() const { return options_; }
  // Empty while the group works; else why it stopped.
  std::string failure() const;
  // Marks the group failed on every rank (their waits end with PeerLost
  // naming this rank and, from the first rank to abort, `why`).
  void abort(const std::string& why);
  // Whether the region's memfd is sealed against execution.
  bool execSealed() const { return region_->execSealed(); }
  // Maps every peer's slots into this process now (set-up, once every
  // peer allocated its own), not on the first calls.
  void prefaultPeers();
  // Closes the region's descriptor once every peer mapped it (set-up).
  void closeDescriptor() { region_->closeDescriptor(); }

 private:
  struct Header;
  struct Control;
  struct Signature;
  Header& header() const;
  Control& control(int r) const;
  // Rank r's slots (kSlots x bufferBytes).
  char* slots(int r) const;
  // Where rank r's chunk `chunk` of the call under way lies: its slot
  // (chunk % kSlots), at the call's place there (beginCall).
  char* slot(int r, uint64_t chunk) const;
  // At a call's start, from the bytes of a slot each of its chunks uses
  // (every rank of the call agrees on them, or the call's first step
  // throws before anything is read): the call's place in the slots, the
  // same for every chunk of the call (the pipeline needs that).
  void beginCall(size_t slotBytes);
  // Every rank's slot of `chunk` from byteOffset on, in rank order, but
  // `own` in this rank's place where given (valid until this thread's next
  // call).
  const void* const* sourcesAt(uint64_t chunk, size_t byteOffset, const void* own = nullptr) const;
  // The parts a chunk of `bytes` (a rank's copy-in) is split in: one a
  // thread when each gets at least kSplitBytes of it, else one per
  // kSplitBytes it holds, at least 1. Every phase of the chunk uses them.
  size_t partsFor(size_t bytes) const;
  // fn(a, b) over `parts` parts of [0, count) elements of esize bytes (on
  // the pool's threads and this one), whole cache lines each; empty parts
  // are skipped.
  template <typename Fn>
  void split(size_t count, size_t esize, size_t parts, const Fn& fn);
  // The two-phase allreduce's pipeline (see the protocol above).
  void allreducePipelined(const char* in, char* out, size_t count, DType dtype,
                          const ReduceSpec& spec, const Signature& sig);

  // Arrives at the next step and waits for every rank; throws InvalidUsage
  // when signatures differ, Timeout/PeerLost as described above.
  void step(const Signature& signature);
  void waitAll(uint64_t s, const Signature& signature);
  // Publishes the first failure in the header (code, this rank, the rank
  // blamed or -1) and wakes every sleeper.
  void publishFailure(uint64_t code, int culprit);
  [[noreturn]] void fail(int code, int culprit, const std::string& message);
  // A published failure word as this rank tells it: who, what, and an
  // abort's reason when its rank wrote one.
  std::string describePublished(uint64_t word) const;
  // Rank `r` of this group as errors name it (ShmGroupOptions::rankNames).
  int named(int r) const {
    return r >= 0 && static_cast<size_t>(r) < options_.rankNames.size() ? options_.rankNames[r] : r;
  }
  void setFailure(const std::string& message);
  void throwIfFailed();
  // InvalidUsage in a process forked after the group was set up.
  void checkNotForked() const;
  bool forked() const;

  std::unique_ptr<SharedRegion> region_;
  ShmGroupOptions options_;
  std::vector<PeerProcess> peers_;
  std::unique_ptr<WorkerPool> pool_;  // null: every part on the calling thread
  uint64_t forkGeneration_;           // the process's forks seen when it was set up
  char* data_ = nullptr;
  int memoryBinding_ = -1;
  uint64_t steps_ = 0;
  uint64_t chunks_ = 0;
  size_t place_ = 0;  // beginCall's: the call's chunks' offset in their slots
  std::atomic<int64_t> timeoutMs_{0};
  std::atomic<int64_t> spinUs_{0};
  std::atomic<bool> yield_{true};
  // ShmWaitStats' fields, written by the calling thread (calls are
  // serialised), read by any.
  std::atomic<uint64_t> waits_{0}, waitsAtOnce_{0}, waitsPolled_{0}, waitsSlept_{0};
  std::atomic<uint64_t> pollNs_{0}, sleepNs_{0};
  std::atomic<uint64_t> late_[ShmWaitStats::kLateBuckets] = {};
  std::atomic<ReduceIsa> reduceIsa_{ReduceIsa::kPortable};
  std::mutex mutex_;                 // one call at a time (held while it waits)
  mutable std::mutex failureMutex_;  // guards failure_ (never held while waiting)
  std::string failure_;
};

}  // namespace tpcomm::mq
