#include "coordinator/cpu/cpu_shm_path.hpp"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>

#include <mutex>

#include "coordinator/common/error.hpp"
#include "coordinator/common/settings.hpp"
#include "coordinator/composite_ops.hpp"
#include "coordinator/cuda/custom_setup.hpp"  // the set-up exchange helpers

namespace tpcomm::coord {

namespace {

constexpr size_t kModeWidth = 8;
constexpr size_t kHostWidth = 128;
constexpr size_t kNumberWidth = 24;
constexpr size_t kMessageWidth = 384;
constexpr size_t kNonceWidth = 32;
constexpr size_t kMaskWidth = CPU_SETSIZE / 4;  // hex digits, 4 CPUs each

// A record of fixed-width fields, and its fields back.
class Record {
 public:
  Record& put(const std::string& value, size_t width) {
    bytes_ += fixedWidth(value, width);
    return *this;
  }
  Record& put(int64_t value) { return put(std::to_string(value), kNumberWidth); }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

class Fields {
 public:
  explicit Fields(const std::string& record) : record_(record) {}
  std::string text(size_t width) {
    std::string field = trimmed(record_.substr(offset_, width));
    offset_ += width;
    return field;
  }
  int64_t number() {
    const std::string field = text(kNumberWidth);
    return field.empty() ? -1 : std::stoll(field);
  }

 private:
  const std::string& record_;
  size_t offset_ = 0;
};

// Round 1's verdict on the settings: empty when every rank can share one
// region, hosts aside.
// A chunk size as a message shows it (0: chosen from the threads).
std::string bufferSetting(int64_t bytes) {
  return bytes == 0 ? std::string("0 (auto)") : detail::concat(bytes);
}

std::string agreement(const std::vector<std::string>& modes, const std::vector<int64_t>& buffers,
                      const std::vector<int64_t>& twoPhase) {
  std::string off;
  for (size_t r = 0; r < modes.size(); ++r) {
    if (modes[r] == "0") off += detail::concat(off.empty() ? "" : ",", r);
  }
  if (!off.empty()) return detail::concat("TPCOMM_CPU_SHM=0 on rank(s) ", off);
  for (size_t r = 1; r < buffers.size(); ++r) {
    if (buffers[r] != buffers[0])
      return detail::concat(
          "ranks disagree on TPCOMM_CPU_SHM_BUFFER_BYTES (rank 0: ", bufferSetting(buffers[0]),
          ", rank ", r, ": ", bufferSetting(buffers[r]), ")");
    if (twoPhase[r] != twoPhase[0])
      return detail::concat("ranks disagree on TPCOMM_CPU_SHM_TWO_PHASE_BYTES (rank 0: ",
                            twoPhase[0], ", rank ", r, ": ", twoPhase[r], ")");
  }
  return "";
}

}  // namespace

namespace {

// A cgroup (v2) CPU quota in whole CPUs, at least 1; 0 when there is none.
int quotaCpus() {
  int cpus = 0;
  // "max 100000" (none) or "<quota> <period>".
  if (FILE* f = std::fopen("/sys/fs/cgroup/cpu.max", "r")) {
    char quota[32] = {};
    long long period = 0;
    if (std::fscanf(f, "%31s %lld", quota, &period) == 2 && std::strcmp(quota, "max") != 0 &&
        period > 0) {
      const long long q = std::atoll(quota);
      if (q > 0) cpus = static_cast<int>(std::max<long long>(1, q / period));
    }
    std::fclose(f);
  }
  return cpus;
}

// This process's affinity mask as kMaskWidth hex digits, CPU 0 in the
// lowest bit of the first digit; all CPUs online when it cannot be read.
std::string affinityHex() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) != 0 || CPU_COUNT(&set) == 0) {
    const long online = std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
    for (long c = 0; c < online && c < CPU_SETSIZE; ++c) CPU_SET(c, &set);
  }
  std::string hex(kMaskWidth, '0');
  for (size_t d = 0; d < kMaskWidth; ++d) {
    int digit = 0;
    for (int b = 0; b < 4; ++b) digit |= CPU_ISSET(d * 4 + b, &set) ? (1 << b) : 0;
    hex[d] = "0123456789abcdef"[digit];
  }
  return hex;
}

// The CPUs of one mask.
std::vector<int> cpusOf(const std::string& mask) {
  std::vector<int> cpus;
  for (size_t d = 0; d < kMaskWidth && d < mask.size(); ++d) {
    const char c = mask[d];
    const int digit = c >= 'a' ? c - 'a' + 10 : (c >= '0' && c <= '9' ? c - '0' : 0);
    for (int b = 0; b < 4; ++b) {
      if (digit & (1 << b)) cpus.push_back(static_cast<int>(d) * 4 + b);
    }
  }
  return cpus;
}

}  // namespace

int ranksWithOwnCpu(const std::vector<std::vector<int>>& allowed) {
  std::vector<int> holder(CPU_SETSIZE, -1);  // CPU -> the rank it is given to
  std::vector<char> seen;
  // Kuhn's augmenting paths: at most ranks x (ranks x CPUs) steps.
  std::function<bool(int)> place = [&](int rank) {
    for (int cpu : allowed[rank]) {
      if (cpu < 0 || cpu >= CPU_SETSIZE || seen[cpu]) continue;
      seen[cpu] = 1;
      if (holder[cpu] < 0 || place(holder[cpu])) {
        holder[cpu] = rank;
        return true;
      }
    }
    return false;
  };
  int placed = 0;
  for (size_t r = 0; r < allowed.size(); ++r) {
    seen.assign(CPU_SETSIZE, 0);
    placed += place(static_cast<int>(r)) ? 1 : 0;
  }
  return placed;
}

namespace {

int ranksWithOwnCpuOfMasks(const std::vector<std::string>& masks) {
  std::vector<std::vector<int>> allowed;
  for (const auto& m : masks) allowed.push_back(cpusOf(m));
  return ranksWithOwnCpu(allowed);
}

}  // namespace

int usableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  int cpus = ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
  if (cpus <= 0) cpus = static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  const int quota = quotaCpus();
  return quota > 0 ? std::min(cpus, quota) : cpus;
}

int threadsFor(int64_t setting, int size) {
  if (setting > 0) return static_cast<int>(setting);
  return std::max(1, std::min(8, usableCpus() / std::max(1, size)));
}

SpinPolicy spinPolicy(int64_t spinUs, int size, int cpus) {
  const bool oversubscribed = size > (cpus > 0 ? cpus : usableCpus());
  if (spinUs >= 0) return {std::chrono::microseconds(spinUs), oversubscribed};
  if (oversubscribed) return {std::chrono::microseconds(50), true};
  return {std::chrono::microseconds(1000), false};
}

mq::ReduceIsa reduceIsaOf(const std::string& setting) {
  const mq::ReduceIsa wanted = setting == "avx512"     ? mq::ReduceIsa::kAvx512
                               : setting == "avx2"     ? mq::ReduceIsa::kAvx2
                               : setting == "portable" ? mq::ReduceIsa::kPortable
                                                       : mq::bestReduceIsa();
  return mq::cpuRunsReduceIsa(wanted) ? wanted : mq::bestReduceIsa();
}

CpuShmConfig CpuShmConfig::fromSettings() {
  CpuShmConfig c;
  c.mode = settings().cpuShm;
  c.bufferBytes = settings().cpuShmBufferBytes;
  c.twoPhaseBytes = settings().cpuShmTwoPhaseBytes;
  c.spinUs = settings().cpuShmSpinUs;
  c.reduceIsa = settings().cpuReduceIsa;
  c.threads = settings().cpuShmThreads;
  c.hierSliceBytes = settings().cpuHierSliceBytes;
  c.hierGatherBytes = settings().cpuHierGatherBytes;
  return c;
}

CpuShmSetup setUpCpuShm(c10d::Backend& cpu, int rank, int size, const std::string& hostId,
                        const CpuShmConfig& config, std::chrono::milliseconds timeout) {
  CpuShmSetup result;
  // The ranks that share this machine's cores: this group's, or more (a
  // group across namespaced hosts of one machine).
  const int sharing = std::max(size, config.machineRanks);
  const int threads = threadsFor(config.threads, sharing);
  // Round 1: settings, host, pid, the chunk this rank would choose.
  Record mine;
  mine.put(config.mode, kModeWidth).put(hostId, kHostWidth).put(::getpid());
  mine.put(config.bufferBytes).put(config.twoPhaseBytes);
  mine.put(kAutoBufferBytesPerThread * threads);
  mine.put(static_cast<int64_t>(reduceIsaOf(config.reduceIsa)));
  mine.put(affinityHex(), kMaskWidth);
  const auto records = allgatherBytes(cpu, size, mine.bytes());
  std::vector<std::string> modes(size), hosts(size);
  std::vector<int64_t> pids(size), buffers(size), twoPhase(size);
  int64_t autoBuffer = 0;  // the largest any rank would choose: every rank's threads get 256 KiB
  // The reductions' kernel level: the lowest any rank asks for or runs, so
  // that every rank computes the same bits (a SUM of two NaNs keeps the NaN
  // the instruction order picks, which may differ between levels).
  int64_t isaLevel = static_cast<int64_t>(mq::ReduceIsa::kAvx512);
  std::vector<std::string> masks(size);
  for (int r = 0; r < size; ++r) {
    Fields f(records[r]);
    modes[r] = f.text(kModeWidth);
    hosts[r] = f.text(kHostWidth);
    pids[r] = f.number();
    buffers[r] = f.number();
    twoPhase[r] = f.number();
    autoBuffer = std::max(autoBuffer, f.number());
    isaLevel = std::min(isaLevel, f.number());
    masks[r] = f.text(kMaskWidth);
  }
  // TPCOMM_CPU_SHM=1 on any rank makes a refusal an error on every rank, so
  // that no rank goes on through Gloo while another raised.
  std::string required;
  for (int r = 0; r < size; ++r) {
    if (modes[r] == "1") required += detail::concat(required.empty() ? "" : ",", r);
  }
  const auto refuse = [&](std::string reason) -> CpuShmSetup {
    TPCOMM_CHECK(required.empty(), kInvalidUsage, "TPCOMM_CPU_SHM=1 (on rank(s) ", required,
                 ") but the group cannot use shared memory: ", reason);
    result.reason = std::move(reason);
    return std::move(result);
  };
  std::string reason = agreement(modes, buffers, twoPhase);
  if (!reason.empty()) return refuse(reason);
  for (int r = 1; r < size; ++r) {
    if (hosts[r] == hosts[0]) continue;
    // A group across hosts: the caller decides (hierarchical collectives).
    result.hosts = hosts;
    result.requiredBy = required;
    result.reduceIsa = static_cast<mq::ReduceIsa>(std::max<int64_t>(0, isaLevel));
    result.reason = detail::concat("ranks 0 and ", r, " are on different hosts ('", hosts[0],
                                   "' and '", hosts[r], "')");
    return result;
  }

  mq::ShmGroupOptions options;
  options.rank = rank;
  options.size = size;
  options.bufferBytes = static_cast<uint64_t>(buffers[0] != 0 ? buffers[0] : autoBuffer);
  options.twoPhaseMinBytes = static_cast<uint64_t>(config.twoPhaseBytes);
  // Whether the group's ranks compete for CPUs, from all their affinity
  // masks: ranks pinned each to cores of their own (as vLLM's CPU workers
  // are) do not, though each process alone may use fewer CPUs than there
  // are ranks. `cpus` counts the ranks that can each have a CPU of their
  // own, so the ranks outnumber it exactly when some must share. A group
  // across namespaced hosts of one machine (machineRanks) sees only its own
  // masks: its processes' alone count there.
  int groupCpus = config.machineRanks > size ? usableCpus() : ranksWithOwnCpuOfMasks(masks);
  if (const int quota = quotaCpus(); quota > 0) groupCpus = std::min(groupCpus, quota);
  result.cpus = std::max(1, groupCpus);
  const SpinPolicy policy = spinPolicy(config.spinUs, sharing, result.cpus);
  options.spin = policy.spin;
  options.yield = policy.yield;
  options.reduceIsa = static_cast<mq::ReduceIsa>(std::max<int64_t>(0, isaLevel));
  options.threads = threads;
  options.timeout = timeout;

  // Round 2: rank 0 creates the region; the others map it.
  std::unique_ptr<mq::SharedRegion> region;
  std::string failure;
  size_t bytes = 0;
  try {
    bytes = mq::ShmGroup::regionBytes(size, options.bufferBytes);
    if (rank == 0) {
      region = mq::SharedRegion::create(bytes);
      mq::ShmGroup::initRegion(region->base(), size, options.bufferBytes, options.twoPhaseMinBytes);
    }
  } catch (const std::exception& e) {
    failure = "could not create the shared-memory region: " + failureOf(e);
  }
  Record created;
  created.put(failure, kMessageWidth).put(region ? region->fd() : -1);
  created.put(region ? region->nonce().hex() : std::string(), kNonceWidth);
  const auto fromZero = allgatherBytes(cpu, size, created.bytes())[0];
  Fields zero(fromZero);
  const std::string zeroFailure = zero.text(kMessageWidth);
  const int64_t fd = zero.number();
  const std::string nonce = zero.text(kNonceWidth);
  if (!zeroFailure.empty()) return refuse("rank 0: " + zeroFailure);
  std::unique_ptr<mq::ShmGroup> group;
  try {
    if (rank != 0) {
      region = mq::SharedRegion::attach(static_cast<int32_t>(pids[0]), static_cast<int32_t>(fd),
                                        bytes, mq::RegionNonce::parse(nonce));
    }
    // Checks the header it mapped (magic, size, settings): a rank that
    // reached some other file says so in round 3.
    std::vector<int32_t> pid32(pids.begin(), pids.end());
    group = std::make_unique<mq::ShmGroup>(std::move(region), options, std::move(pid32));
  } catch (const std::exception& e) {
    failure = "could not map rank 0's shared-memory region: " + failureOf(e);
  }

  // Round 3: did everyone map it? Also the point after which rank 0 may
  // close its descriptor (the mapping stays).
  const auto mapped = allgatherBytes(cpu, size, fixedWidth(failure, kMessageWidth));
  std::vector<std::string> failures;
  for (const auto& m : mapped) failures.push_back(trimmed(m));
  reason = firstFailure(failures);
  if (!reason.empty()) return refuse(reason);
  group->closeDescriptor();
  group->prefaultPeers();
  result.group = std::move(group);
  return result;
}

std::optional<mq::DType> shmDtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return mq::DType::kFloat32;
    case at::kDouble:
      return mq::DType::kFloat64;
    case at::kBFloat16:
      return mq::DType::kBFloat16;
    case at::kHalf:
      return mq::DType::kFloat16;
    case at::kInt:
      return mq::DType::kInt32;
    case at::kLong:
      return mq::DType::kInt64;
    default:
      return std::nullopt;
  }
}

bool shmReduces(const c10d::ReduceOp& op, at::ScalarType dtype, const char** why) {
  const char* ignored = nullptr;
  if (why == nullptr) why = &ignored;
  if (!shmDtype(dtype)) {
    *why = "dtype not reduced in shared memory";
    return false;
  }
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::AVG:
    case c10d::ReduceOp::PREMUL_SUM:
    case c10d::ReduceOp::PRODUCT:
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX:
      return true;
    default:
      *why = "bitwise reductions go to Gloo";
      return false;
  }
}

mq::ReduceSpec shmReduction(const c10d::ReduceOp& op, int size) {
  mq::ReduceSpec spec;
  switch (op.op_) {
    case c10d::ReduceOp::PRODUCT:
      spec.kind = mq::ReduceKind::kProduct;
      return spec;
    case c10d::ReduceOp::MIN:
      spec.kind = mq::ReduceKind::kMin;
      return spec;
    case c10d::ReduceOp::MAX:
      spec.kind = mq::ReduceKind::kMax;
      return spec;
    default:
      break;
  }
  // SUM, AVG and PREMUL_SUM: the Gloo path's plan (its factor included).
  const ReductionPlan plan = planWithoutAvgOrPremul(op);
  if (plan.divideBySize) spec.divisor = size;
  if (plan.premultiplies()) {
    spec.premultiply = true;
    spec.scale = plan.scaleTensor.defined()
                     ? plan.scaleTensor.to(at::kCPU).to(at::kDouble).item<double>()
                     : *plan.scale;
  }
  return spec;
}

namespace {

// What completedCall hands back for an asynchronous call: done and
// successful from the start; the future is made on the first getFuture().
class CompletedWork : public c10d::Work {
 public:
  explicit CompletedWork(std::vector<at::Tensor> outputs) : outputs_(std::move(outputs)) {}
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::lock_guard<std::mutex> lock(futureMutex_);
    if (!future_) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
      future_->markCompleted(c10::IValue(outputs_));
    }
    return future_;
  }

 private:
  std::vector<at::Tensor> outputs_;
  std::mutex futureMutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace

c10::intrusive_ptr<c10d::Work> completedWork(std::vector<at::Tensor> outputs) {
  return c10::make_intrusive<CompletedWork>(std::move(outputs));
}

Pending completedCall(std::vector<at::Tensor> outputs, bool asyncOp) {
  Pending pending;
  if (asyncOp) {
    pending.work = c10::make_intrusive<CompletedWork>(outputs);
    pending.done = true;
  }
  pending.outputs = std::move(outputs);
  return pending;
}

}  // namespace tpcomm::coord
