#pragma once
// Every TPCOMM_* environment variable, declared once with its type, default
// and doc line. The process-wide values are read on first use and never
// again, so nothing here is ever read in a hot path.
//
// To add a setting: add a field to Settings, a row to kSettingTable in
// settings.cpp, and a line to the README's settings table.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace tpcomm {

// The custom kernel's wait when TPCOMM_CAR_TIMEOUT_MS is 0 and no group's
// timeout applies (NCCL's default collective timeout).
inline constexpr int64_t kDirectCarTimeoutMs = 10 * 60 * 1000;

struct Settings {
  // TPCOMM_DEBUG: before each collective, compare op, shapes and dtypes
  // across ranks through the CPU group and raise naming the ranks that differ.
  bool debug = false;
  // TPCOMM_DIRECT_CALLS: dist.all_reduce and GroupCoordinator.all_reduce on
  // plain CPU tensors call the backend directly (python/fast_calls.cpp), not
  // through torch's Python function, binding and dispatcher.
  bool directCalls = true;
  // TPCOMM_HOST_ID: this process's host identity for shared-memory paths
  // (empty: the host name). Ranks with different ids never share memory;
  // tests use it to simulate several hosts on one machine.
  std::string hostId;
  // TPCOMM_CAR_MAX_BYTES: the largest allreduce the custom kernel takes; its
  // buffers are sized from it (three times this per rank: two stagings
  // used by call parity and the two-shot's result region).
  int64_t carMaxBytes = 8 << 20;
  // TPCOMM_CAR_TIMEOUT_MS: how long a custom-allreduce kernel waits for a
  // peer before it gives up and the host raises naming that peer. 0: the
  // group's timeout (init_process_group's), as for every other collective;
  // the direct API (no group) then waits kDirectCarTimeoutMs.
  int64_t carTimeoutMs = 0;
  // TPCOMM_CAR_BLOCKS: thread blocks per custom-allreduce kernel (0: chosen
  // from the size).
  int64_t carBlocks = 0;
  // TPCOMM_CAR_FLAG_SCOPE: "auto" (flags at GPU scope when every rank of a
  // group runs on one GPU, else system scope) or "system" (always).
  std::string carFlagScope = "auto";
  // TPCOMM_CAR_GRAPH_ORDER: "stream" (a captured custom-allreduce call is
  // ordered against calls outside its graph by the stream it replays on) or
  // "event" (external event nodes: also against other streams).
  std::string carGraphOrder = "stream";
  // TPCOMM_CAR_PUSH_MAX_BYTES: largest one-shot call made as a push (values
  // that carry their own arrival, no barrier); -1: by world size
  // (car::pushLimit), 0: never.
  int64_t carPushMaxBytes = -1;
  // TPCOMM_CAR_PDL: programmatic dependent launch of the custom kernels:
  // "auto" (on a GPU that has it, sm_90+, unless ranks share the GPU), "on"
  // (also when they share it), "off".
  std::string carPdl = "auto";
  // TPCOMM_ROUTE: auto (the routing table), nccl (never the custom kernel),
  // oneshot or twoshot (the custom kernel whenever it can take the call).
  std::string route = "auto";
  // TPCOMM_ONESHOT_MAX_BYTES: largest one-shot allreduce (-1: by world size).
  int64_t oneShotMaxBytes = -1;
  // TPCOMM_AUTOTUNE: measure the CUDA allreduce crossovers at custom-kernel
  // set-up and cache them (coordinator/cuda/autotune.hpp).
  bool autotune = false;
  // TPCOMM_AUTOTUNE_DIR: the cache's directory (empty: the user's cache).
  std::string autotuneDir;
  // TPCOMM_CPU_SHM: CPU collectives of one-host groups through shared memory:
  // "auto" (where every rank agrees and set-up works, else Gloo), "0" (never),
  // "1" (like auto, but a failed set-up on a group is an error).
  std::string cpuShm = "auto";
  // TPCOMM_CPU_SHM_BUFFER_BYTES: each rank's chunk slot (two of them per
  // rank); larger calls stream through it in chunks. 0: 256 KiB per worker
  // thread (coordinator/cpu/cpu_shm_path.hpp).
  int64_t cpuShmBufferBytes = 0;
  // TPCOMM_CPU_SHM_TWO_PHASE_BYTES: allreduces from this size on reduce-
  // scatter then all-gather inside shared memory.
  int64_t cpuShmTwoPhaseBytes = 16 << 10;
  // TPCOMM_CPU_HIER_GATHER_BYTES: allreduces of groups across hosts up to
  // this size gather every host's partial; larger ones reduce-scatter then
  // all-gather between hosts.
  int64_t cpuHierGatherBytes = 4096;
  // TPCOMM_CPU_HIER_INLINE_BYTES: payloads between hosts up to this size
  // ride in the call descriptions' blocks (0-4096).
  int64_t cpuHierInlineBytes = 32;
  // TPCOMM_CPU_HIER_SLICE_BYTES: allreduces of groups across hosts (the
  // same number of ranks on each) from this size on cross hosts in slices.
  int64_t cpuHierSliceBytes = 4 << 20;
  // TPCOMM_CPU_SHM_SPIN_US: how long a shared-memory wait polls before it
  // sleeps on a futex (-1: by the group, see cpu_shm_path.hpp's spinPolicy).
  int64_t cpuShmSpinUs = -1;
  // TPCOMM_CPU_SHM_YIELD: whether that wait yields its core between polls
  // also when each rank has a CPU of its own (spinPolicy).
  bool cpuShmYield = false;
  // TPCOMM_CPU_SHM_THREADS: threads per rank that split large copies and
  // reductions (0: the rank's share of the CPUs, cpu_placement.hpp).
  int64_t cpuShmThreads = 0;
  // TPCOMM_CPU_SHM_WORKER_SPIN_US: how long worker threads pinned to CPUs
  // of their rank's own poll for a large call's next part before sleeping.
  int64_t cpuShmWorkerSpinUs = 50;
  // TPCOMM_CPU_SHM_CPUS: the CPUs this process's shared-memory groups may
  // use ("0-7"), instead of the calling thread's affinity mask (empty).
  std::string cpuShmCpus;
  // TPCOMM_CPU_REDUCE_ISA: the vector kernels the shared-memory reductions
  // use at most: auto (the best this CPU has), avx512, avx2, portable.
  std::string cpuReduceIsa = "auto";
  // TPCOMM_MQ_SPIN_US: how long a message-queue wait polls before it sleeps
  // on a futex (0: a fixed 4,000 polls).
  int64_t mqSpinUs = 200;
  // TPCOMM_MQ_SPIN_ADAPT: a reader's waits poll only while recent waits
  // were met polling (message_queue/ring/ring.hpp, SpinLearner).
  bool mqSpinAdapt = true;
  // TPCOMM_FR_STACKS: tpcomm's entries in torch's flight recorder carry the
  // caller's Python stack (as torch's own entries do; about a microsecond
  // per call).
  bool frStacks = false;
  // TPCOMM_WATCHDOG_MS: once a call has waited this long, the watchdog
  // (coordinator/faults/group_fault.hpp) reads the group's published faults every
  // half this and publishes the rank's position (0: no watchdog).
  int64_t watchdogMs = 200;
  // TPCOMM_LOG: comma-separated topics to log to stderr; "routes" logs each
  // distinct routing decision once per group.
  bool logRoutes = false;

  // Lookup is injectable so tests can parse without touching the environment.
  using Lookup = std::function<std::optional<std::string>(const std::string& name)>;

  // Parses every setting; a malformed value throws InvalidUsage naming the
  // variable and the value.
  static Settings parse(const Lookup& lookup);
};

struct SettingInfo {
  const char* name;
  const char* type;
  const char* defaultValue;
  const char* doc;
};

// The table of settings (name, type, default, doc), for documentation and
// tpcomm.settings().
const std::vector<SettingInfo>& settingTable();

// The process-wide settings, parsed from the environment once.
const Settings& settings();

// This process's host identity: TPCOMM_HOST_ID, else
// "<host name>#<hash>@<machine>", the hash (64-bit FNV-1a, hex) over the
// kernel's boot id and this process's pid- and mount-namespace inodes, the
// machine a 32-bit hash of the boot id alone (hosts that are namespaces of
// one kernel share its cores). Two processes may share memory only when
// their identities are equal: same kernel, each other's pids and /proc in
// view. Two containers with equal host names thus differ.
std::string hostIdentity();
// The part of it for people and caches: TPCOMM_HOST_ID, else the host name.
std::string hostName();

// Parses an integer setting value within [low, high].
int64_t parseInt(const std::string& name, const std::string& value, int64_t low, int64_t high);

// Parses a boolean setting value: 1/0, true/false, yes/no, on/off (any case).
bool parseBool(const std::string& name, const std::string& value);

}  // namespace tpcomm
