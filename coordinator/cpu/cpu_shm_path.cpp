#include "coordinator/cpu/cpu_shm_path.hpp"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>

#include <mutex>

#include "common/error.hpp"
#include "common/settings.hpp"
#include "coordinator/composite_ops.hpp"
#include "coordinator/cpu/cpu_placement.hpp"
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

// A CPU list as kMaskWidth hex digits, CPU 0 in the lowest bit of the first
// digit, and back.
std::string maskHex(const std::vector<int>& cpus) {
  std::string hex(kMaskWidth, '0');
  for (int c : cpus) {
    if (c < 0 || c >= static_cast<int>(kMaskWidth * 4)) continue;
    const int digit =
        (hex[c / 4] >= 'a' ? hex[c / 4] - 'a' + 10 : hex[c / 4] - '0') | (1 << (c % 4));
    hex[c / 4] = "0123456789abcdef"[digit];
  }
  return hex;
}

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

SpinPolicy spinPolicy(int64_t spinUs, int size, int cpus, bool yield) {
  const bool oversubscribed = size > (cpus > 0 ? cpus : usableCpus());
  if (spinUs >= 0) return {std::chrono::microseconds(spinUs), yield};
  return {std::chrono::microseconds(oversubscribed ? 0 : 1000), yield};
}

int64_t autoBufferBytes(int size, int64_t threads) {
  // Two slots a rank: the minimum is what keeps the region within
  // kAutoRegionBytes, in whole cache lines, and at most 1 MiB.
  const int64_t fits = kAutoRegionBytes / (2 * std::max(1, size)) / 64 * 64;
  return std::max(std::max<int64_t>(1, threads) * kAutoBufferBytesPerThread,
                  std::min(kAutoBufferMinBytes, fits));
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
  c.yield = settings().cpuShmYield;
  c.reduceIsa = settings().cpuReduceIsa;
  c.threads = settings().cpuShmThreads;
  c.workerSpinUs = settings().cpuShmWorkerSpinUs;
  c.hierSliceBytes = settings().cpuHierSliceBytes;
  c.hierGatherBytes = settings().cpuHierGatherBytes;
  c.hierInlineBytes = settings().cpuHierInlineBytes;
  return c;
}

CpuShmSetup setUpCpuShm(c10d::Backend& cpu, int rank, int size, const std::string& hostId,
                        const CpuShmConfig& config, std::chrono::milliseconds timeout) {
  CpuShmSetup result;
  // The ranks that share this machine's cores: this group's, or more (a
  // group across namespaced hosts of one machine, whose masks this group
  // alone does not see: each rank then takes its CPUs divided among them).
  const int sharing = std::max(size, config.machineRanks);
  std::vector<int> cpus;
  std::string cpusError;
  try {
    cpus = rankCpus();
  } catch (const std::exception& e) {
    cpusError = failureOf(e);
  }
  const int64_t sharedThreads =
      config.threads > 0 ? config.threads : std::clamp(usableCpus() / std::max(1, sharing), 1, 8);
  // Round 1: settings, host, pid, this rank's CPUs and threads setting.
  Record mine;
  mine.put(config.mode, kModeWidth).put(hostId, kHostWidth).put(::getpid());
  mine.put(config.bufferBytes).put(config.twoPhaseBytes);
  mine.put(static_cast<int64_t>(reduceIsaOf(config.reduceIsa)));
  mine.put(maskHex(cpus), kMaskWidth);
  mine.put(config.threads).put(sharedThreads).put(quotaCpus());
  mine.put(cpusError, kMessageWidth);
  const auto records = allgatherBytes(cpu, size, mine.bytes());
  std::vector<std::string> modes(size), hosts(size), cpusErrors(size);
  std::vector<int64_t> pids(size), buffers(size), twoPhase(size), threadSettings(size),
      shared(size);
  std::vector<int> quotas(size);
  // The reductions' kernel level: the lowest any rank asks for or runs, so
  // that every rank computes the same bits (a SUM of two NaNs keeps the NaN
  // the instruction order picks, which may differ between levels).
  int64_t isaLevel = static_cast<int64_t>(mq::ReduceIsa::kAvx512);
  std::vector<std::vector<int>> allowed(size);
  for (int r = 0; r < size; ++r) {
    Fields f(records[r]);
    modes[r] = f.text(kModeWidth);
    hosts[r] = f.text(kHostWidth);
    pids[r] = f.number();
    buffers[r] = f.number();
    twoPhase[r] = f.number();
    isaLevel = std::min(isaLevel, f.number());
    allowed[r] = cpusOf(f.text(kMaskWidth));
    threadSettings[r] = f.number();
    shared[r] = f.number();
    quotas[r] = static_cast<int>(f.number());
    cpusErrors[r] = f.text(kMessageWidth);
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
  for (int r = 0; r < size; ++r) {
    if (!cpusErrors[r].empty()) return refuse(detail::concat("rank ", r, ": ", cpusErrors[r]));
  }
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

  // Every rank's share of the CPUs, threads and node (cpu_placement.hpp),
  // the same table on every rank. A group across namespaced hosts of one
  // machine sees only its own masks: its ranks take their CPUs divided among
  // the machine's ranks, unpinned.
  std::vector<RankPlace> places = placeRanks(allowed, threadSettings, quotas);
  const bool machineShared = config.machineRanks > size;
  for (int r = 0; r < size && machineShared; ++r) places[r].threads = static_cast<int>(shared[r]);
  int64_t threadsAsked = 0;  // the largest any rank's threads ask for
  for (const auto& p : places) threadsAsked = std::max<int64_t>(threadsAsked, p.threads);
  const int64_t autoBuffer = autoBufferBytes(size, threadsAsked);

  mq::ShmGroupOptions options;
  options.rank = rank;
  options.size = size;
  options.bufferBytes = static_cast<uint64_t>(buffers[0] != 0 ? buffers[0] : autoBuffer);
  options.twoPhaseMinBytes = static_cast<uint64_t>(config.twoPhaseBytes);
  // Whether the group's ranks compete for CPUs, from all their CPU lists:
  // ranks pinned each to cores of their own (as vLLM's CPU workers are) do
  // not, though each process alone may use fewer CPUs than there are ranks.
  // `cpus` counts the ranks that can each have a CPU of their own, so the
  // ranks outnumber it exactly when some must share.
  int groupCpus = machineShared ? usableCpus() : ranksWithOwnCpu(allowed);
  if (const int quota = quotaCpus(); quota > 0) groupCpus = std::min(groupCpus, quota);
  result.cpus = std::max(1, groupCpus);
  const SpinPolicy policy = spinPolicy(config.spinUs, sharing, result.cpus, config.yield);
  options.spin = policy.spin;
  options.yield = policy.yield;
  options.reduceIsa = static_cast<mq::ReduceIsa>(std::max<int64_t>(0, isaLevel));
  options.threads = places[rank].threads;
  if (!machineShared) {
    options.workerCpus = workerCpus(places[rank], threadCpus());
    options.memoryNode = places[rank].node;
    // Workers on CPUs of their own poll between a large call's chunks.
    if (!options.workerCpus.empty())
      options.workerSpin = std::chrono::microseconds(config.workerSpinUs);
  }
  options.timeout = timeout;
  options.rankNames = config.rankNames;

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
  // close its descriptor (the mapping stays), and where each rank's threads
  // and slots went.
  Record outcome;
  outcome.put(failure, kMessageWidth);
  outcome.put(group ? group->memoryBinding() : -1).put(group ? group->pinnedWorkers() : 0);
  const auto mapped = allgatherBytes(cpu, size, outcome.bytes());
  std::vector<std::string> failures;
  for (int r = 0; r < size; ++r) {
    Fields f(mapped[r]);
    failures.push_back(f.text(kMessageWidth));
    RankShare share;
    share.cpus = formatCpuList(places[r].cpus);
    share.allowed = formatCpuList(allowed[r]);
    share.node = places[r].node;
    share.threads = places[r].threads;
    const int64_t binding = f.number();
    share.memory = binding == 0  ? detail::concat("bound to node ", places[r].node)
                   : binding < 0 ? std::string("first touch")
                                 : detail::concat("first touch (mbind refused: ",
                                                  std::strerror(static_cast<int>(binding)), ")");
    share.pinnedWorkers = static_cast<int>(f.number());
    result.ranks.push_back(std::move(share));
  }
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
