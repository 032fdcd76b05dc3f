// GroupCoordinator: CPU collectives through shared memory (cpu_shm_path.hpp).
#include "coordinator/common/error.hpp"
#include "coordinator/common/settings.hpp"
#include "coordinator/debug_check.hpp"
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
  shmFast_.store(shm_.get(), std::memory_order_release);
  return shm_.get();
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
}

void GroupCoordinator::setCpuShmSpinUs(int64_t spinUs) {
  TPCOMM_CHECK(spinUs >= -1 && spinUs <= 1000000, kInvalidUsage, "CPU shared-memory spin of ",
               spinUs, " us (-1..1000000)");
  std::lock_guard<std::mutex> lock(shmMutex_);
  shmSpinUs_ = spinUs;
  if (shm_) {
    const SpinPolicy policy = spinPolicy(spinUs, size());
    shm_->setSpin(policy.spin, policy.yield);
  }
}

void GroupCoordinator::setCpuShmThreads(int64_t threads) {
  TPCOMM_CHECK(threads >= 0 && threads <= 64, kInvalidUsage, "CPU shared-memory threads ",
               threads, " (0..64)");
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
    state.memfd = shm_->execSealed()
                      ? "sealed against execution (MFD_NOEXEC_SEAL)"
                      : "not sealed against execution (the kernel refused MFD_NOEXEC_SEAL: "
                        "before Linux 6.3)";
  }
  state.reduceIsa = mq::reduceIsaName(
      shm_ ? shm_->reduceIsa() : reduceIsaOf(shmIsa_.empty() ? settings().cpuReduceIsa : shmIsa_));
  return state;
}

mq::ShmGroup* GroupCoordinator::shmFor(const char* op, const at::Tensor& tensor,
                                       const c10d::ReduceOp* reduceOp) {
  mq::ShmGroup* shm = cpuShm();
  const char* why = "shared memory unavailable for this group";
  const bool taken =
      shm != nullptr && (reduceOp == nullptr || shmReduces(*reduceOp, tensor.scalar_type(), &why));
  if (logRoutes_) {
    // TPCOMM_LOG=routes: "allreduce SUM float32 16 B -> cpu_shm (one host)", once per kind.
    const std::string what = std::string(op) +
                             (reduceOp ? " " + describeReduceOp(*reduceOp) : std::string()) + " " +
                             dtypeName(tensor.scalar_type());
    const char* route = taken ? "cpu_shm" : "gloo";
    const char* reason = taken ? "one host" : why;
    routeLog_.once(std::string("cpu|") + route + "|" + reason + "|" + what,
                   "tpcomm route: group '" + options_.groupName + "' rank " +
                       std::to_string(rank()) + ": " + what + " " +
                       std::to_string(bytesOf(tensor)) + " B -> " + route + " (" + reason + ")");
  }
  return taken ? shm : nullptr;
}

std::optional<Pending> GroupCoordinator::shmAllreduce(const at::Tensor& input, at::Tensor& output,
                                                      const c10d::ReduceOp& op, bool asyncOp,
                                                      const mq::ShmPart& part) {
  mq::ShmGroup* shm = shmFor("allreduce", input, &op);
  if (shm == nullptr) return std::nullopt;
  stats_.record(StatsRoute::kCpuShm, bytesOf(input));
  shm->allreduce(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()),
                 *shmDtype(input.scalar_type()), shmReduction(op, size()), part);
  return completedCall({output}, asyncOp);
}

std::optional<Pending> GroupCoordinator::shmAllgather(const at::Tensor& input,
                                                      const std::vector<void*>& outs,
                                                      std::vector<at::Tensor> results, bool asyncOp,
                                                      const mq::ShmPart& part) {
  mq::ShmGroup* shm = shmFor("all_gather", input, nullptr);
  if (shm == nullptr) return std::nullopt;
  stats_.record(StatsRoute::kCpuShm, bytesOf(input));
  shm->allgather(input.data_ptr(), bytesOf(input), outs, part);
  return completedCall(std::move(results), asyncOp);
}

std::optional<Pending> GroupCoordinator::shmReduceScatter(const std::vector<const void*>& ins,
                                                          at::Tensor& output,
                                                          const c10d::ReduceOp& op, bool asyncOp,
                                                          const mq::ShmPart& part) {
  mq::ShmGroup* shm = shmFor("reduce_scatter", output, &op);
  if (shm == nullptr) return std::nullopt;
  stats_.record(StatsRoute::kCpuShm, bytesOf(output) * size());
  shm->reduceScatter(ins, output.data_ptr(), static_cast<size_t>(output.numel()),
                     *shmDtype(output.scalar_type()), shmReduction(op, size()), part);
  return completedCall({output}, asyncOp);
}

std::optional<Pending> GroupCoordinator::shmBroadcast(at::Tensor& tensor, int root, bool asyncOp) {
  mq::ShmGroup* shm = shmFor("broadcast", tensor, nullptr);
  if (shm == nullptr) return std::nullopt;
  stats_.record(StatsRoute::kCpuShm, bytesOf(tensor));
  shm->broadcast(tensor.data_ptr(), bytesOf(tensor), root);
  return completedCall({tensor}, asyncOp);
}

std::optional<Pending> GroupCoordinator::shmBarrier(bool asyncOp) {
  mq::ShmGroup* shm = cpuShm();
  if (shm == nullptr) return std::nullopt;
  stats_.record(StatsRoute::kCpuShm, 0);
  shm->barrier();
  return completedCall({}, asyncOp);
}

}  // namespace tpcomm::coord
