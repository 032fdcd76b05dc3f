// GroupCoordinator: CPU collectives through shared memory (cpu_shm_path.hpp).
#include <cstring>

#include "common/error.hpp"
#include "common/settings.hpp"
#include "coordinator/debug/debug_check.hpp"
#include "coordinator/group_coordinator.hpp"

namespace tpcomm::coord {

mq::ShmGroup* GroupCoordinator::cpuShm() {
  if (mq::ShmGroup* ready = shmFast_.load(std::memory_order_acquire)) return ready;
  std::lock_guard<std::mutex> lock(shmMutex_);
  if (shmTried_) {
    // TPCOMM_CPU_SHM=1 refused: every later call raises the same.
    if (!shmError_.empty()) throw Error(ErrorCode::kInvalidUsage, shmError_);
    return shm_.get();
  }
  shmTried_ = true;
  if (!options_.cpuShm) {
    shmReason_ = "turned off for this group";
    return nullptr;
  }
  shmReason_ = "set-up failed";
  CpuShmConfig config = CpuShmConfig::fromSettings();
  if (!shmMode_.empty()) config.mode = shmMode_;
  if (!shmIsa_.empty()) config.reduceIsa = shmIsa_;
  if (shmSpinUs_) config.spinUs = *shmSpinUs_;
  if (shmThreads_) config.threads = *shmThreads_;
  CpuShmSetup setup;
  try {
    setup = setUpCpuShm(*cpu_, rank(), size(), hostIdentity(), config, options_.timeout);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kInvalidUsage) shmError_ = shmReason_ = e.what();
    throw;
  } catch (const std::exception& e) {
    // The exchange over the CPU backend failed (a peer missing or gone):
    // the group's later CPU calls go to Gloo, which reports the same.
    shmReason_ = std::string("set-up exchange failed: ") + e.what();
    const std::string what = e.what();
    if (what.find("imed out") != std::string::npos)
      TPCOMM_THROW(kTimeout, "setting up the CPU shared-memory path: ", what);
    TPCOMM_THROW(kPeerLost, "setting up the CPU shared-memory path: ", what);
  }
  shmReason_ = setup.reason;
  shm_ = std::move(setup.group);
  shmCpus_ = setup.cpus;
  shmRanks_ = setup.ranks;
  if (!shm_ && !setup.hosts.empty()) setUpHierLocked(setup, config);
  shmFast_.store(shm_.get(), std::memory_order_release);
  return shm_.get();
}

void GroupCoordinator::setUpHierLocked(const CpuShmSetup& setup, const CpuShmConfig& config) {
  const HostLayout layout = HostLayout::of(setup.hosts, rank());
  hierLayout_ = layout.describe();
  HierSetup hier;
  try {
    // The kernel level the whole group agreed on, for every host.
    CpuShmConfig agreed = config;
    agreed.reduceIsa = mq::reduceIsaName(setup.reduceIsa);
    // The Gloo groups between hosts: their connections close when the
    // group breaks, and the flight recorder names them as tpcomm's own.
    BackendFactory factory = [this](const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                    int size, std::chrono::milliseconds timeout) {
      c10::intrusive_ptr<c10d::Backend> made;
      made = cpuFactory_(store, rank, size, timeout);
      fault_->addGlooSockets(GlooSockets::ofGroup(store, rank, size));
      if (made) made->setGroupUid(options_.groupName + ":hosts:tpcomm-internal");
      return made;
    };
    hier = setUpHier(*cpu_, factory, store_, rank(), size(), setup.hosts, agreed, options_.timeout,
                     setup.requiredBy);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kInvalidUsage) shmError_ = shmReason_ = e.what();
    throw;
  } catch (const std::exception& e) {
    shmReason_ = std::string("set-up across hosts failed: ") + e.what();
    TPCOMM_THROW(kPeerLost, "setting up the CPU collectives across hosts: ", e.what());
  }
  hierReason_ = hier.group ? detail::concat(layout.hosts(),
                                            " hosts: shared memory inside each, "
                                            "Gloo between them")
                           : hier.reason;
  hier_ = std::move(hier.group);
  hierFast_.store(hier_.get(), std::memory_order_release);
}

HierGroup* GroupCoordinator::cpuHier() {
  if (HierGroup* ready = hierFast_.load(std::memory_order_acquire)) return ready;
  if (shmFast_.load(std::memory_order_acquire) != nullptr) return nullptr;
  cpuShm();  // sets up both
  return hierFast_.load(std::memory_order_acquire);
}

void GroupCoordinator::setCpuShmMode(const std::string& mode) {
  TPCOMM_CHECK(mode == "auto" || mode == "0" || mode == "1", kInvalidUsage,
               "CPU shared-memory mode '", mode, "' is not one of auto, 0, 1");
  std::lock_guard<std::mutex> lock(shmMutex_);
  TPCOMM_CHECK(!shmTried_, kInvalidUsage,
               "set_cpu_shm_mode: the group's CPU shared-memory path is already set up");
  shmMode_ = mode;
}

void GroupCoordinator::setCpuReduceIsa(const std::string& level) {
  TPCOMM_CHECK(level == "auto" || level == "avx512" || level == "avx2" || level == "portable",
               kInvalidUsage, "CPU reduction kernels '", level,
               "' are not one of auto, avx512, avx2, portable");
  std::lock_guard<std::mutex> lock(shmMutex_);
  shmIsa_ = level;
  if (shm_) shm_->setReduceIsa(reduceIsaOf(level));
  if (hier_) hier_->setReduceIsa(reduceIsaOf(level));
}

void GroupCoordinator::setCpuShmSpinUs(int64_t spinUs) {
  TPCOMM_CHECK(spinUs >= -1 && spinUs <= 1000000, kInvalidUsage, "CPU shared-memory spin of ",
               spinUs, " us (-1..1000000)");
  std::lock_guard<std::mutex> lock(shmMutex_);
  shmSpinUs_ = spinUs;
  if (shm_) {
    const SpinPolicy policy = spinPolicy(spinUs, size(), shmCpus_, settings().cpuShmYield);
    shm_->setSpin(policy.spin, policy.yield);
  }
  if (hier_ && hier_->local()) {
    const SpinPolicy policy = spinPolicy(spinUs, hier_->machineRanks(), 0, settings().cpuShmYield);
    hier_->local()->setSpin(policy.spin, policy.yield);
  }
}

void GroupCoordinator::setCpuShmThreads(int64_t threads) {
  TPCOMM_CHECK(threads >= 0 && threads <= 64, kInvalidUsage, "CPU shared-memory threads ", threads,
               " (0..64)");
  std::lock_guard<std::mutex> lock(shmMutex_);
  TPCOMM_CHECK(!shmTried_, kInvalidUsage,
               "set_cpu_shm_threads: the group's CPU shared-memory path is already set up");
  shmThreads_ = threads;
}

GroupCoordinator::CpuShmState GroupCoordinator::cpuShmState() const {
  std::lock_guard<std::mutex> lock(shmMutex_);
  CpuShmState state;
  state.setUp = shmTried_;
  state.available = shm_ != nullptr;
  state.reason = shm_ ? shm_->failure() : shmReason_;
  state.mode = shmMode_.empty() ? settings().cpuShm : shmMode_;
  if (shm_) {
    state.spinUs = shm_->spin().count();
    state.yields = shm_->yields();
    state.threads = shm_->threads();
    state.bufferBytes = shm_->options().bufferBytes;
    state.waits = shm_->waitStats();
    state.memfd = shm_->execSealed()
                      ? "sealed against execution (MFD_NOEXEC_SEAL)"
                      : "not sealed against execution (the kernel refused MFD_NOEXEC_SEAL: "
                        "before Linux 6.3)";
  }
  state.ranks = shmRanks_;
  state.numaNodes = numaNodes();
  state.hierarchical = hier_ != nullptr;
  state.layout = hierLayout_;
  state.hierReason = hierReason_;
  if (hier_) {
    state.hierSliceBytes = hier_->sliceMinBytes();
    state.hierGatherBytes = hier_->gatherMaxBytes();
    state.hierInlineBytes = hier_->inlineBytes();
    if (hier_->local()) {
      state.spinUs = hier_->local()->spin().count();
      state.yields = hier_->local()->yields();
      state.threads = hier_->local()->threads();
      state.bufferBytes = hier_->local()->options().bufferBytes;
      state.waits = hier_->local()->waitStats();
    }
    if (!hier_->failure().empty()) state.reason = hier_->failure();
  }
  state.reduceIsa = mq::reduceIsaName(
      shm_ ? shm_->reduceIsa() : reduceIsaOf(shmIsa_.empty() ? settings().cpuReduceIsa : shmIsa_));
  return state;
}

GroupCoordinator::CpuPath GroupCoordinator::shmFor(const char* op, const at::Tensor& tensor,
                                                   const c10d::ReduceOp* reduceOp) {
  CpuPath path;
  path.hier = hierFast_.load(std::memory_order_acquire);
  if (path.hier == nullptr) {
    path.shm = cpuShm();
    if (path.shm == nullptr) path.hier = hierFast_.load(std::memory_order_acquire);
  }
  const char* why = "shared memory unavailable for this group";
  const bool taken = static_cast<bool>(path) &&
                     (reduceOp == nullptr || shmReduces(*reduceOp, tensor.scalar_type(), &why));
  if (logRoutes_) {
    // TPCOMM_LOG=routes: "allreduce SUM float32 16 B -> cpu_shm (one host)", once per kind.
    const std::string what = std::string(op) +
                             (reduceOp ? " " + describeReduceOp(*reduceOp) : std::string()) + " " +
                             dtypeName(tensor.scalar_type());
    std::string route = taken ? (path.shm ? "cpu_shm" : "cpu_hier") : "gloo";
    std::string reason = taken ? (path.shm ? "one host" : hierLayout_) : why;
    if (taken && path.hier && std::string(op) == "allreduce") {
      const char* how = path.hier->allreducePath(static_cast<size_t>(tensor.numel()),
                                                 *shmDtype(tensor.scalar_type()));
      route += std::string(":") + how;
      reason += std::strcmp(how, "slices") == 0 ? "; each rank of a host crosses hosts with a slice"
                                                : "; the hosts' leaders cross hosts";
    }
    if (!taken && !path && !hierReason_.empty()) reason = hierReason_;
    routeLog_.once(std::string("cpu|") + route + "|" + reason + "|" + what,
                   "tpcomm route: group '" + options_.groupName + "' rank " +
                       std::to_string(rank()) + ": " + what + " " +
                       std::to_string(bytesOf(tensor)) + " B -> " + route + " (" + reason + ")");
  }
  return taken ? path : CpuPath{};
}

std::optional<Pending> GroupCoordinator::shmAllreduce(const at::Tensor& input, at::Tensor& output,
                                                      const c10d::ReduceOp& op, bool asyncOp,
                                                      const mq::ShmPart& part) {
  const CpuPath path = shmFor("allreduce", input, &op);
  if (!path) return std::nullopt;
  if (path.shm) {
    stats_.record(StatsRoute::kCpuShm, bytesOf(input));
    path.shm->allreduce(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()),
                        *shmDtype(input.scalar_type()), shmReduction(op, size()), part);
  } else {
    stats_.record(StatsRoute::kCpuHier, bytesOf(input));
    path.hier->allreduce(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()),
                         *shmDtype(input.scalar_type()), shmReduction(op, size()), part);
  }
  return completedCall({output}, asyncOp);
}

std::optional<Pending> GroupCoordinator::shmAllgather(const at::Tensor& input,
                                                      const std::vector<void*>& outs,
                                                      std::vector<at::Tensor> results, bool asyncOp,
                                                      const mq::ShmPart& part) {
  const CpuPath path = shmFor("all_gather", input, nullptr);
  if (!path) return std::nullopt;
  stats_.record(path.shm ? StatsRoute::kCpuShm : StatsRoute::kCpuHier, bytesOf(input));
  if (path.shm) {
    path.shm->allgather(input.data_ptr(), bytesOf(input), outs, part);
  } else {
    path.hier->allgather(input.data_ptr(), bytesOf(input), outs, part);
  }
  return completedCall(std::move(results), asyncOp);
}

std::optional<Pending> GroupCoordinator::shmReduceScatter(const std::vector<const void*>& ins,
                                                          at::Tensor& output,
                                                          const c10d::ReduceOp& op, bool asyncOp,
                                                          const mq::ShmPart& part) {
  const CpuPath path = shmFor("reduce_scatter", output, &op);
  if (!path) return std::nullopt;
  stats_.record(path.shm ? StatsRoute::kCpuShm : StatsRoute::kCpuHier, bytesOf(output) * size());
  const auto count = static_cast<size_t>(output.numel());
  const mq::DType dtype = *shmDtype(output.scalar_type());
  if (path.shm) {
    path.shm->reduceScatter(ins, output.data_ptr(), count, dtype, shmReduction(op, size()), part);
  } else {
    path.hier->reduceScatter(ins, output.data_ptr(), count, dtype, shmReduction(op, size()), part);
  }
  return completedCall({output}, asyncOp);
}

std::optional<Pending> GroupCoordinator::shmBroadcast(at::Tensor& tensor, int root, bool asyncOp) {
  const CpuPath path = shmFor("broadcast", tensor, nullptr);
  if (!path) return std::nullopt;
  stats_.record(path.shm ? StatsRoute::kCpuShm : StatsRoute::kCpuHier, bytesOf(tensor));
  if (path.shm) {
    path.shm->broadcast(tensor.data_ptr(), bytesOf(tensor), root);
  } else {
    path.hier->broadcast(tensor.data_ptr(), bytesOf(tensor), root);
  }
  return completedCall({tensor}, asyncOp);
}

std::optional<Pending> GroupCoordinator::shmBarrier(bool asyncOp) {
  HierGroup* hier = cpuHier();
  mq::ShmGroup* shm = hier ? nullptr : shmFast_.load(std::memory_order_acquire);
  if (shm == nullptr && hier == nullptr) return std::nullopt;
  stats_.record(shm ? StatsRoute::kCpuShm : StatsRoute::kCpuHier, 0);
  if (shm) {
    shm->barrier();
  } else {
    hier->barrier();
  }
  return completedCall({}, asyncOp);
}

}  // namespace tpcomm::coord
