#include "common/settings.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "common/error.hpp"

namespace tpcomm {

namespace {

const std::vector<SettingInfo> kSettingTable = {
    {"TPCOMM_DEBUG", "bool", "0",
     "Before each collective, check op, shapes, dtypes, all-to-all split sizes and one-rank "
     "refusals across ranks through the CPU group, and each CPU send/recv pair's dtype and "
     "element count through the store, and raise on every rank naming the ranks that differ "
     "(costs one extra CPU round trip per call; docs/faults.md)."},
    {"TPCOMM_DIRECT_CALLS", "bool", "1",
     "dist.all_reduce and GroupCoordinator.all_reduce on plain CPU tensors of a tpcomm group "
     "(and CUDA tensors where tpcomm is also its CUDA backend) call the backend directly, as "
     "torch's route ends up doing, without torch's Python "
     "checks, binding and dispatcher (about 2 us less a call); calls with tensor subclasses, "
     "torch function or dispatch modes or a profiler take torch's route anyway. 0: every call "
     "takes torch's route."},
    {"TPCOMM_HOST_ID", "string", "",
     "This process's host identity (empty: the host name with a hash of the kernel's boot id "
     "and the pid and mount namespaces): ranks with equal ids share memory (message queue, CPU "
     "collectives), others talk through Gloo."},
    {"TPCOMM_CAR_MAX_BYTES", "int", "8388608",
     "The largest allreduce the custom peer-to-peer kernel takes (bytes, a multiple of 16); "
     "each rank's buffer holds three times this (two stagings used by call parity and the "
     "two-shot's result region)."},
    {"TPCOMM_CAR_TIMEOUT_MS", "int", "0",
     "How long a custom-allreduce kernel waits for a peer before it stops and the host raises "
     "an error naming that peer. 0: the group's timeout (init_process_group's, as for any "
     "collective); without a group (tpcomm.custom_allreduce) 10 minutes."},
    {"TPCOMM_CAR_BLOCKS", "int", "0",
     "Thread blocks per custom-allreduce kernel, 1 to 64 (0: chosen from the size and world "
     "size)."},
    {"TPCOMM_CAR_FLAG_SCOPE", "string", "auto",
     "Memory scope of the custom-allreduce kernel's flags: auto (GPU scope when every rank of "
     "the group runs on one GPU, as ranks on streams of one process or processes sharing a GPU "
     "do; system scope across GPUs), system (always system scope). Equal on every rank."},
    {"TPCOMM_CAR_GRAPH_ORDER", "string", "stream",
     "How a CUDA graph's custom-allreduce calls are ordered against the group's calls outside "
     "that graph: stream (by the stream the graph replays on, as NCCL's and vLLM's kernels "
     "are: replay on the stream of the eager calls, or synchronise; wait() an async call "
     "before a replay; a reset or teardown of the group then waits for the whole GPU), event "
     "(external event "
     "nodes in the graph: a replay may also run beside eager calls or other replays on other "
     "streams, at several microseconds per call). Calls within one graph are always ordered."},
    {"TPCOMM_CAR_PUSH_MAX_BYTES", "int", "-1",
     "Largest custom one-shot allreduce made as a push: each rank writes its values straight "
     "into every peer's buffer and they carry their own arrival (no flag, no barrier; a zero "
     "of either sign is read as +0). -1: by world size (256 KiB at 2-4 ranks, 8 KiB at "
     "5-8, at most the push buffer of 256 KiB and TPCOMM_CAR_MAX_BYTES), 0: never. Equal on "
     "every rank."},
    {"TPCOMM_CAR_PDL", "string", "auto",
     "Programmatic dependent launch of the custom-allreduce kernels (a kernel is launched "
     "while the one before it on its stream ends; it waits for it on the GPU): auto (on GPUs "
     "that have it, sm_90 and newer, unless ranks of the group share a GPU), on (also when "
     "they share one: fewer blocks per rank then, so that two kernels of every rank fit at "
     "once), off."},
    {"TPCOMM_ROUTE", "string", "auto",
     "Where CUDA allreduces go: auto (the routing table by world size and bytes), nccl (never the "
     "custom kernel), oneshot or twoshot (that custom algorithm whenever the kernel can take "
     "the call)."},
    {"TPCOMM_ONESHOT_MAX_BYTES", "int", "-1",
     "Largest allreduce sent to the custom one-shot kernel (-1: 1 MiB at 2 ranks, 512 KiB at "
     "3-4, 256 KiB at 5-8, until TPCOMM_AUTOTUNE has measured; never above "
     "TPCOMM_CAR_MAX_BYTES)."},
    {"TPCOMM_AUTOTUNE", "bool", "0",
     "Measure the CUDA allreduce crossovers (one-shot, two-shot, NCCL) when a group sets up the "
     "custom kernel, and cache them per machine and world size; later groups read the cache."},
    {"TPCOMM_AUTOTUNE_DIR", "string", "",
     "Where TPCOMM_AUTOTUNE caches its measurements (empty: $XDG_CACHE_HOME/tpcomm, else "
     "~/.cache/tpcomm)."},
    {"TPCOMM_CPU_SHM", "string", "auto",
     "CPU collectives (allreduce, all-gather, reduce-scatter, broadcast, barrier) of groups whose "
     "ranks share a host go through shared memory: auto (where set-up works on every rank, else "
     "Gloo), 0 (always Gloo), 1 (like auto, but a failed set-up is an error)."},
    {"TPCOMM_CPU_SHM_BUFFER_BYTES", "int", "0",
     "Chunk size of the shared-memory CPU collectives (a multiple of 64, at least 4096; each "
     "rank maps twice this); larger calls stream through in chunks. 0: 256 KiB per worker "
     "thread of a rank (TPCOMM_CPU_SHM_THREADS), the largest any rank asks for, and at least "
     "1 MiB up to 8 ranks, less beyond so that the group's region stays within 16 MiB (each "
     "chunk costs a pipeline step, which costs far more than its synchronisation). "
     "Must be equal on every rank."},
    {"TPCOMM_CPU_SHM_TWO_PHASE_BYTES", "int", "16384",
     "CPU allreduces from this size on reduce-scatter then all-gather inside shared memory "
     "(each rank reduces a slice); smaller ones are reduced whole by every rank. Must be equal "
     "on every rank."},
    {"TPCOMM_CPU_HIER_GATHER_BYTES", "int", "4096",
     "Groups whose ranks sit on several hosts: CPU allreduces up to this size cross hosts as "
     "every host gathering every host's partial (ceil(log2 hosts) rounds, each host sending "
     "hosts - 1 copies); larger ones as a reduce-scatter then an all-gather between hosts "
     "(two rounds, each host sending twice the payload at most). Set-up takes the smallest "
     "value of any rank."},
    {"TPCOMM_CPU_HIER_INLINE_BYTES", "int", "32",
     "Groups whose ranks sit on several hosts: payloads up to this size (at most 4096) travel "
     "inside the blocks of the call's description that every step first gathers (ceil(log2 "
     "hosts) rounds, each host sending hosts - 1 blocks of 64 bytes plus this size); larger "
     "ones follow in one more round. 32: a 4-byte allreduce sends about 1.9 KB a host at 8 "
     "hosts; 4096: payloads up to 4 KiB save that round, every call sending hosts - 1 blocks "
     "of 4,160 bytes. Set-up takes the smallest value of any rank."},
    {"TPCOMM_CPU_HIER_SLICE_BYTES", "int", "4194304",
     "Groups whose ranks sit on several hosts, each with the same number of ranks: CPU "
     "allreduces from this size on cross hosts in slices, one per rank of a host, all at once "
     "(smaller ones: the hosts' leaders alone). Set-up takes the smallest value of any rank."},
    {"TPCOMM_CPU_SHM_SPIN_US", "int", "-1",
     "How long a shared-memory CPU collective polls for its peers before it sleeps on a futex. "
     "-1: 1000 us when each of the group's ranks on a host can have a CPU of its own among "
     "those its affinity mask allows (capped by a cgroup quota: ranks pinned to cores of their "
     "own do; a late peer is met without a wake-up), else 0 (a few polls, then the futex: "
     "the peer that needs the core gets it)."},
    {"TPCOMM_CPU_SHM_YIELD", "bool", "0",
     "Whether a shared-memory CPU collective's wait calls sched_yield between polls (after the "
     "first few microseconds). 0: never; a wait polls, then sleeps on a futex, which frees the "
     "core for whatever else runs there until a peer wakes it. 1: yield, which where other "
     "work is runnable hands it the core for a whole time slice (a 4-byte allreduce of 2 "
     "ranks on 2 busy cores: 0.5-1.3 ms against 14 us)."},
    {"TPCOMM_CPU_SHM_THREADS", "int", "0",
     "Threads per rank (its own included) that split the copies and reductions of large "
     "shared-memory CPU collectives: a chunk with at least 256 KiB a thread is split in one part a "
     "thread for each of its phases (copy in, reduce, copy out), a smaller one in a part per "
     "256 KiB; smaller calls use one. 0: the "
     "rank's share of the CPUs its group's ranks may use (their affinity masks, exchanged at "
     "set-up: CPUs of its own, plus an equal part of those it shares with other ranks), at most "
     "8, capped by a cgroup quota divided among the ranks. Results do not depend on it."},
    {"TPCOMM_CPU_SHM_WORKER_SPIN_US", "int", "50",
     "How long a shared-memory worker thread pinned to a CPU of its rank's own share polls for "
     "the next part of a large CPU collective before it sleeps (so a call's chunks pay no "
     "wake-up each; run()'s caller polls as long for the last parts). 0: sleep at once, as "
     "workers that are not pinned always do."},
    {"TPCOMM_CPU_SHM_CPUS", "string", "",
     "The CPUs this process's shared-memory groups may use (a list such as 0-7,16-23), instead "
     "of the affinity mask of the thread that sets the group up: its share of them holds its "
     "worker threads (one pinned to each CPU) and decides its NUMA node. For a process whose "
     "main thread an OpenMP runtime pinned to one core of its list (vLLM's plugin passes the "
     "list itself)."},
    {"TPCOMM_CPU_REDUCE_ISA", "string", "auto",
     "The widest vector kernels the shared-memory CPU reductions use: auto (the best this CPU "
     "runs), avx512, avx2, portable (the compiler's loops). A level the CPU lacks falls back to "
     "the best it has; a group uses the lowest level any of its ranks asks for. Every level "
     "gives the same bits (but for which NaN's sign a sum of two NaNs keeps)."},
    {"TPCOMM_MQ_SPIN_US", "int", "200",
     "How long a message-queue wait polls (yielding the core) before it sleeps on a futex: "
     "busy round trips never pay a wake-up, an idle reader costs no CPU. 0: a fixed 4,000 "
     "polls."},
    {"TPCOMM_MQ_SPIN_ADAPT", "bool", "1",
     "Whether a message-queue reader polls only while polling pays: once fewer than half of "
     "its last 16 waits that found no message were met while polling (messages a model step "
     "apart, say), its waits poll a few times and sleep, and every 8th polls fully to notice "
     "when messages come quickly again (a poll that meets one restores polling). 0: every wait "
     "polls TPCOMM_MQ_SPIN_US."},
    {"TPCOMM_FR_STACKS", "bool", "0",
     "tpcomm's entries in torch's flight recorder (TORCH_FR_BUFFER_SIZE) carry the caller's "
     "Python stack, as torch's own do (about a microsecond per call)."},
    {"TPCOMM_WATCHDOG_MS", "int", "200",
     "Once a call has waited this long, the process's watchdog reads the group's published "
     "faults (an abort, a failure, a call refused on another rank) every half this, ends the "
     "call when the group broke, and publishes where this rank waits for the peers' error "
     "messages. 0: no watchdog (faults then reach a rank only through shared memory)."},
    {"TPCOMM_LOG", "string", "",
     "Comma-separated topics logged to stderr: routes (each distinct routing decision of a "
     "group, once)."},
};

std::optional<std::string> fromEnvironment(const std::string& name) {
  const char* value = std::getenv(name.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

}  // namespace

bool parseBool(const std::string& name, const std::string& value) {
  std::string v = value;
  std::transform(v.begin(), v.end(), v.begin(), [](unsigned char c) { return std::tolower(c); });
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off" || v.empty()) return false;
  TPCOMM_THROW(kInvalidUsage, "setting ", name, "='", value,
               "' is not a boolean (use 1/0, true/false, yes/no, on/off)");
}

int64_t parseInt(const std::string& name, const std::string& value, int64_t low, int64_t high) {
  char* end = nullptr;
  errno = 0;
  const long long parsed = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || end == nullptr || *end != '\0' || errno == ERANGE) {
    TPCOMM_THROW(kInvalidUsage, "setting ", name, "='", value, "' is not an integer");
  }
  if (parsed < low || parsed > high) {
    TPCOMM_THROW(kInvalidUsage, "setting ", name, "=", value, " is outside ", low, "..", high);
  }
  return parsed;
}

Settings Settings::parse(const Lookup& lookup) {
  Settings s;
  if (auto v = lookup("TPCOMM_DEBUG")) s.debug = parseBool("TPCOMM_DEBUG", *v);
  if (auto v = lookup("TPCOMM_DIRECT_CALLS")) {
    s.directCalls = parseBool("TPCOMM_DIRECT_CALLS", *v);
  }
  if (auto v = lookup("TPCOMM_HOST_ID")) s.hostId = *v;
  if (auto v = lookup("TPCOMM_CAR_MAX_BYTES")) {
    s.carMaxBytes = parseInt("TPCOMM_CAR_MAX_BYTES", *v, 16, int64_t{1} << 30);
    TPCOMM_CHECK(s.carMaxBytes % 16 == 0, kInvalidUsage, "setting TPCOMM_CAR_MAX_BYTES=", *v,
                 " is not a multiple of 16");
  }
  if (auto v = lookup("TPCOMM_CAR_TIMEOUT_MS")) {
    s.carTimeoutMs = parseInt("TPCOMM_CAR_TIMEOUT_MS", *v, 0, int64_t{24} * 3600 * 1000);
  }
  if (auto v = lookup("TPCOMM_CAR_BLOCKS")) s.carBlocks = parseInt("TPCOMM_CAR_BLOCKS", *v, 0, 64);
  if (auto v = lookup("TPCOMM_CAR_FLAG_SCOPE")) {
    s.carFlagScope = v->empty() ? "auto" : *v;
    TPCOMM_CHECK(s.carFlagScope == "auto" || s.carFlagScope == "system", kInvalidUsage,
                 "setting TPCOMM_CAR_FLAG_SCOPE='", *v, "' is not one of auto, system");
  }
  if (auto v = lookup("TPCOMM_CAR_GRAPH_ORDER")) {
    s.carGraphOrder = v->empty() ? "stream" : *v;
    TPCOMM_CHECK(s.carGraphOrder == "stream" || s.carGraphOrder == "event", kInvalidUsage,
                 "setting TPCOMM_CAR_GRAPH_ORDER='", *v, "' is not one of stream, event");
  }
  if (auto v = lookup("TPCOMM_CAR_PUSH_MAX_BYTES")) {
    s.carPushMaxBytes = parseInt("TPCOMM_CAR_PUSH_MAX_BYTES", *v, -1, int64_t{1} << 30);
  }
  if (auto v = lookup("TPCOMM_CAR_PDL")) {
    s.carPdl = v->empty() ? "auto" : *v;
    TPCOMM_CHECK(s.carPdl == "auto" || s.carPdl == "on" || s.carPdl == "off", kInvalidUsage,
                 "setting TPCOMM_CAR_PDL='", *v, "' is not one of auto, on, off");
  }
  if (auto v = lookup("TPCOMM_ROUTE")) {
    s.route = v->empty() ? "auto" : *v;
    TPCOMM_CHECK(
        s.route == "auto" || s.route == "nccl" || s.route == "oneshot" || s.route == "twoshot",
        kInvalidUsage, "setting TPCOMM_ROUTE='", *v,
        "' is not one of auto, nccl, oneshot, twoshot");
  }
  if (auto v = lookup("TPCOMM_ONESHOT_MAX_BYTES")) {
    s.oneShotMaxBytes = parseInt("TPCOMM_ONESHOT_MAX_BYTES", *v, -1, int64_t{1} << 30);
  }
  if (auto v = lookup("TPCOMM_CPU_SHM")) {
    std::string mode = *v;
    std::transform(mode.begin(), mode.end(), mode.begin(),
                   [](unsigned char c) { return std::tolower(c); });
    if (mode.empty() || mode == "auto") {
      s.cpuShm = "auto";
    } else if (mode == "1" || mode == "0") {
      s.cpuShm = mode;
    } else {
      s.cpuShm = parseBool("TPCOMM_CPU_SHM", *v) ? "1" : "0";  // throws unless a boolean
    }
  }
  if (auto v = lookup("TPCOMM_CPU_SHM_BUFFER_BYTES")) {
    s.cpuShmBufferBytes = parseInt("TPCOMM_CPU_SHM_BUFFER_BYTES", *v, 0, int64_t{1} << 30);
    TPCOMM_CHECK(
        s.cpuShmBufferBytes == 0 || (s.cpuShmBufferBytes >= 4096 && s.cpuShmBufferBytes % 64 == 0),
        kInvalidUsage, "setting TPCOMM_CPU_SHM_BUFFER_BYTES=", *v,
        " is neither 0 (auto) nor a multiple of 64 of at least 4096");
  }
  if (auto v = lookup("TPCOMM_CPU_HIER_INLINE_BYTES")) {
    s.cpuHierInlineBytes = parseInt("TPCOMM_CPU_HIER_INLINE_BYTES", *v, 0, 4096);
  }
  if (auto v = lookup("TPCOMM_CPU_HIER_GATHER_BYTES")) {
    s.cpuHierGatherBytes = parseInt("TPCOMM_CPU_HIER_GATHER_BYTES", *v, 0, int64_t{1} << 62);
  }
  if (auto v = lookup("TPCOMM_CPU_HIER_SLICE_BYTES")) {
    s.cpuHierSliceBytes = parseInt("TPCOMM_CPU_HIER_SLICE_BYTES", *v, 0, int64_t{1} << 62);
  }
  if (auto v = lookup("TPCOMM_CPU_SHM_TWO_PHASE_BYTES")) {
    s.cpuShmTwoPhaseBytes = parseInt("TPCOMM_CPU_SHM_TWO_PHASE_BYTES", *v, 0, int64_t{1} << 62);
  }
  if (auto v = lookup("TPCOMM_FR_STACKS")) s.frStacks = parseBool("TPCOMM_FR_STACKS", *v);
  if (auto v = lookup("TPCOMM_WATCHDOG_MS")) {
    s.watchdogMs = parseInt("TPCOMM_WATCHDOG_MS", *v, 0, 3600000);
  }
  if (auto v = lookup("TPCOMM_MQ_SPIN_US")) {
    s.mqSpinUs = parseInt("TPCOMM_MQ_SPIN_US", *v, 0, 10000000);
  }
  if (auto v = lookup("TPCOMM_MQ_SPIN_ADAPT"))
    s.mqSpinAdapt = parseBool("TPCOMM_MQ_SPIN_ADAPT", *v);
  if (auto v = lookup("TPCOMM_CPU_SHM_SPIN_US")) {
    s.cpuShmSpinUs = parseInt("TPCOMM_CPU_SHM_SPIN_US", *v, -1, 1000000);
  }
  if (auto v = lookup("TPCOMM_CPU_SHM_YIELD"))
    s.cpuShmYield = parseBool("TPCOMM_CPU_SHM_YIELD", *v);
  if (auto v = lookup("TPCOMM_CPU_SHM_THREADS")) {
    s.cpuShmThreads = parseInt("TPCOMM_CPU_SHM_THREADS", *v, 0, 64);
  }
  if (auto v = lookup("TPCOMM_CPU_SHM_WORKER_SPIN_US")) {
    s.cpuShmWorkerSpinUs = parseInt("TPCOMM_CPU_SHM_WORKER_SPIN_US", *v, 0, 100000);
  }
  if (auto v = lookup("TPCOMM_CPU_SHM_CPUS")) {
    // The syntax here, on every rank before any exchange; the CPUs at set-up
    // (coordinator/cpu/cpu_placement.hpp).
    s.cpuShmCpus = *v;
    bool ok = true;
    size_t from = 0;
    while (ok && !v->empty()) {
      const size_t comma = v->find(',', from);
      const std::string item = v->substr(from, comma == std::string::npos ? comma : comma - from);
      const size_t dash = item.find('-');
      const auto digits = [](const std::string& t) {
        return !t.empty() && t.size() <= 5 &&
               t.find_first_not_of("0123456789") == std::string::npos;
      };
      ok = dash == std::string::npos
               ? digits(item)
               : digits(item.substr(0, dash)) && digits(item.substr(dash + 1));
      if (comma == std::string::npos) break;
      from = comma + 1;
    }
    TPCOMM_CHECK(ok, kInvalidUsage, "setting TPCOMM_CPU_SHM_CPUS='", *v,
                 "' is not a CPU list such as 0-7,16-23");
  }
  if (auto v = lookup("TPCOMM_CPU_REDUCE_ISA")) {
    s.cpuReduceIsa = v->empty() ? "auto" : *v;
    TPCOMM_CHECK(s.cpuReduceIsa == "auto" || s.cpuReduceIsa == "avx512" ||
                     s.cpuReduceIsa == "avx2" || s.cpuReduceIsa == "portable",
                 kInvalidUsage, "setting TPCOMM_CPU_REDUCE_ISA='", *v,
                 "' is not one of auto, avx512, avx2, portable");
  }
  if (auto v = lookup("TPCOMM_AUTOTUNE")) s.autotune = parseBool("TPCOMM_AUTOTUNE", *v);
  if (auto v = lookup("TPCOMM_AUTOTUNE_DIR")) s.autotuneDir = *v;
  if (auto v = lookup("TPCOMM_LOG")) {
    size_t start = 0;
    while (start <= v->size()) {
      const size_t comma = v->find(',', start);
      const std::string topic =
          v->substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      if (topic == "routes") {
        s.logRoutes = true;
      } else if (!topic.empty()) {
        TPCOMM_THROW(kInvalidUsage, "setting TPCOMM_LOG='", *v, "': unknown topic '", topic,
                     "' (known: routes)");
      }
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  return s;
}

const std::vector<SettingInfo>& settingTable() { return kSettingTable; }

std::string hostName() {
  if (!settings().hostId.empty()) return settings().hostId;
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  return name;
}

namespace {

// A namespace's inode ("0" where /proc cannot say).
std::string namespaceInode(const char* which) {
  struct stat st;
  const std::string path = std::string("/proc/self/ns/") + which;
  return ::stat(path.c_str(), &st) == 0 ? std::to_string(st.st_ino) : "0";
}

std::string bootId() {
  std::string id;
  if (FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char line[64] = {};
    if (std::fgets(line, sizeof(line), f) != nullptr) id = line;
    std::fclose(f);
  }
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  return id;
}

// FNV-1a, 64 bits: stable across builds and processes.
uint64_t fnv1a(const std::string& text) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

std::string hostIdentity() {
  if (!settings().hostId.empty()) return settings().hostId;
  // Processes share memory only where they share the kernel (boot id), see
  // each other's pids (pid namespace) and reach each other's /proc (mount
  // namespace); equal host names say none of that (containers).
  const std::string machine =
      bootId() + "/pid:" + namespaceInode("pid") + "/mnt:" + namespaceInode("mnt");
  char hash[34];
  std::snprintf(hash, sizeof(hash), "%016llx@%08llx",
                static_cast<unsigned long long>(fnv1a(machine)),
                static_cast<unsigned long long>(fnv1a(bootId()) & 0xffffffffull));
  return hostName().substr(0, 64) + "#" + hash;
}

const Settings& settings() {
  static const Settings instance = Settings::parse(fromEnvironment);
  return instance;
}

}  // namespace tpcomm
