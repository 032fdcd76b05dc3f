#pragma once
// The shared-memory path for CPU tensors (message_queue/collectives/shm_group.hpp) as the
// coordinator uses it: the collective set-up over the group's CPU backend,
// and which calls the path takes. Internal to coordinator/.
//
// Set-up (collective: every rank of the group calls it at the same point of
// its call sequence, the group's first CPU collective), three allgathers of
// fixed-size records over the CPU backend, so every rank decides from the
// same data and reaches the same verdict:
//   1. TPCOMM_CPU_SHM mode, host identity, pid, and the settings that shape
//      the protocol (buffer bytes, two-phase crossover): refused when any
//      rank turned the path off or settings differ; ranks on several hosts
//      end the set-up here with every rank's host
//   2. rank 0 creates the region (memfd) and sends its pid, descriptor and
//      nonce, or why it failed; the others map it through /proc and check
//      the nonce
//   3. whether every rank mapped it
// A rank that fails a step still takes part in every later round.

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "coordinator/cpu/cpu_placement.hpp"
#include "coordinator/pending.hpp"
#include "message_queue/collectives/shm_group.hpp"

namespace tpcomm::coord {

// TPCOMM_CPU_SHM_BUFFER_BYTES=0 (the default): each rank's chunk is this
// much per worker thread of the rank (the largest any rank of the group
// asks for), and at least kAutoBufferMinBytes. Each step of a chunk
// pipeline costs far more than its synchronisation: on an AMD EPYC (Zen 4,
// AVX-512, 2 cores) at 2 ranks, 256 KiB chunks took 100-110 us for 1 MiB
// and 410-430 us for 4 MiB, 1 MiB chunks 41-62 us and 155-220 us, and
// 16-64 MiB were 20-30% faster with 1 MiB chunks too (bench cpu --peers
// beside DeepSpeed's op, 2026-11-30). Many threads a rank still get 256 KiB
// each, as measured before on 16 cores; on a 2-core Zen 3 whose L3 other
// tenants thrashed, 256 KiB chunks had held 64 MiB at 6.8-7.1 ms against
// 11-12 with 1 MiB, before a rank stored its own slice from its registers
// (not measured there since). The minimum shrinks where 1 MiB would make
// the group's region exceed kAutoRegionBytes (more than 8 ranks).
inline constexpr int64_t kAutoBufferBytesPerThread = 256 << 10;
inline constexpr int64_t kAutoBufferMinBytes = 1 << 20;
inline constexpr int64_t kAutoRegionBytes = 16 << 20;

// The default chunk of a group of `size` ranks whose ranks ask for at most
// `threads` threads: the larger of 256 KiB a thread and the minimum above.
int64_t autoBufferBytes(int size, int64_t threads);

struct CpuShmConfig {
  std::string mode = "auto";  // TPCOMM_CPU_SHM: auto, 0, 1
  int64_t bufferBytes = 0;  // TPCOMM_CPU_SHM_BUFFER_BYTES (0: the auto size above)
  int64_t twoPhaseBytes = 16 << 10;
  int64_t spinUs = -1;             // -1: spinPolicy's choice
  bool yield = false;              // TPCOMM_CPU_SHM_YIELD
  std::string reduceIsa = "auto";  // TPCOMM_CPU_REDUCE_ISA
  int64_t threads = 0;             // TPCOMM_CPU_SHM_THREADS (0: the rank's share)
  // TPCOMM_CPU_SHM_WORKER_SPIN_US: how long workers pinned to CPUs of their
  // own poll for a large call's next part (WorkerPool) before sleeping.
  int64_t workerSpinUs = 50;
  int64_t hierSliceBytes = 4 << 20;  // TPCOMM_CPU_HIER_SLICE_BYTES
  int64_t hierGatherBytes = 4096;    // TPCOMM_CPU_HIER_GATHER_BYTES
  int64_t hierInlineBytes = 32;      // TPCOMM_CPU_HIER_INLINE_BYTES
  // Ranks of a larger group on this machine's cores (a group across hosts
  // that are namespaces of one kernel): the waiting policy and the threads
  // count them (0: the group's size alone).
  int machineRanks = 0;
  // The ranks as errors name them: a host's part of a hierarchical group
  // gives its ranks in the whole group (empty: 0..size-1).
  std::vector<int> rankNames;
  static CpuShmConfig fromSettings();
};

// One rank's place as describe() shows it (cpu_placement.hpp).
struct RankShare {
  std::string allowed;  // the CPUs it may use ("0-7")
  std::string cpus;     // its share of them
  int node = 0;         // its NUMA node
  int threads = 1;
  int pinnedWorkers = 0;  // worker threads pinned to its share
  std::string memory;     // where its slots went: "bound to node 0", "first touch (...)"
};

struct CpuShmSetup {
  std::unique_ptr<mq::ShmGroup> group;  // null when the group does not use the path
  std::string reason;                   // why not (empty when it does)
  // Where the ranks sit on several hosts (and nothing else refused the
  // path): every rank's host identity, for hierarchical collectives
  // (cpu_hier_path.hpp); `requiredBy`: the ranks with TPCOMM_CPU_SHM=1
  // ("0,2"), empty if none.
  std::vector<std::string> hosts;
  std::string requiredBy;
  mq::ReduceIsa reduceIsa = mq::ReduceIsa::kPortable;  // the level every rank runs
  // How many of the ranks can each have a CPU of their own among those
  // their affinity masks allow (capped by a cgroup quota): spinPolicy's
  // `cpus`; the ranks outnumber it when some must share a CPU.
  int cpus = 0;
  // Where every rank runs and keeps its slots (set up only).
  std::vector<RankShare> ranks;
};

// Throws InvalidUsage on every rank when mode is "1" and the set-up failed
// (ranks on several hosts excepted: see CpuShmSetup::hosts).
CpuShmSetup setUpCpuShm(c10d::Backend& cpu, int rank, int size, const std::string& hostId,
                        const CpuShmConfig& config, std::chrono::milliseconds timeout);

// The reductions' kernel level for a TPCOMM_CPU_REDUCE_ISA value: the level
// named if this CPU runs it, else the best it runs.
mq::ReduceIsa reduceIsaOf(const std::string& setting);

// How a group of `size` ranks on this host waits for its peers: polling
// `spin` (then sleeping on a futex, which gives the core away until a peer
// wakes it), yielding the core each round or not. spinUs -1: 1000 us when
// the ranks do not outnumber `cpus` (the CPUs they may run on together; 0:
// this process's usableCpus()), so that a peer up to about 1 ms late is met
// without a sleep and a wake-up (measured: python -m tpcomm.bench cpu
// --late); else 0 (a few polls, then the futex: a peer that needs this core
// gets it at once). Another spinUs: that window. `yield`
// (TPCOMM_CPU_SHM_YIELD, default off): sched_yield between polls. Off, since
// on a machine with other runnable work (a server's own processes, other
// jobs) a yield hands the core to them for a whole time slice: with two busy
// processes beside 2 ranks on 2 cores, a 4-byte allreduce took 0.5-1.3 ms
// yielding and 14 us not (AMD EPYC Zen 3, 2 vCPUs; docs/cpu-shm.md).
struct SpinPolicy {
  std::chrono::microseconds spin;
  bool yield;
};
SpinPolicy spinPolicy(int64_t spinUs, int size, int cpus = 0, bool yield = false);

// The path's dtype for a tensor's, if it reduces that dtype.
std::optional<mq::DType> shmDtype(at::ScalarType dtype);

// Whether the path reduces `op` on `dtype` (not bitwise ops, not bool or
// other dtypes); `why` (unless null) says why not. Cheap: reads no factor.
bool shmReduces(const c10d::ReduceOp& op, at::ScalarType dtype, const char** why);

// The reduction for an `op` that shmReduces at `size` ranks (PREMUL_SUM's
// factor read as the Gloo path reads it; a tensor factor on the host).
mq::ReduceSpec shmReduction(const c10d::ReduceOp& op, int size);

// A call the path already completed: no Work for a synchronous call (torch's
// Python API then skips wait(), as for ProcessGroupNCCL), else a completed
// Work whose result is the outputs; its future (holding the outputs) is made
// only when asked for.
Pending completedCall(std::vector<at::Tensor> outputs, bool asyncOp);
// A Work that completed already (wait() returns at once), holding `outputs`.
c10::intrusive_ptr<c10d::Work> completedWork(std::vector<at::Tensor> outputs);

}  // namespace tpcomm::coord
