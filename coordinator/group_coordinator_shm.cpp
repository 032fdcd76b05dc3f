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

GroupCoordinator::CpuShmState GroupCoordinator::cpuShmState() const {
  std::lock_guard<std::mutex> lock(shmMutex_);
  CpuShmState state;
  state.setUp = shmTried_;
  state.available = shm_ != nullptr;
  state.reason = shm_ ? shm_->failure() : shmReason_;
  state.mode = shmMode_.empty() ? settings().cpuShm : shmMode_;
  return state;
}

void GroupCoordinator::logCpuRoute(const char* op, const at::Tensor& tensor, const char* route,
                                   const char* reason) {
  const std::string what = std::string(op) + " " + dtypeName(tensor.scalar_type());
  routeLog_.once(std::string("cpu|") + route + "|" + reason + "|" + what,
                 "tpcomm route: group '" + options_.groupName + "' rank " + std::to_string(rank()) +
                     ": " + what + " " + std::to_string(bytesOf(tensor)) + " B -> " + route + " (" +
                     reason + ")");
}

std::optional<Pending> GroupCoordinator::shmAllreduce(const at::Tensor& input, at::Tensor& output,
                                                      const c10d::ReduceOp& op, bool asyncOp) {
  mq::ShmGroup* shm = cpuShm();
  const char* why = "";
  std::optional<mq::ReduceSpec> spec;
  if (shm == nullptr) {
    why = "shared memory unavailable for this group";
  } else {
    spec = shmReduction(op, input.scalar_type(), size(), &why);
  }
  if (logRoutes_) logAllreduceRoute(op, input, spec ? "cpu_shm" : "gloo", spec ? "one host" : why);
  if (!spec) return std::nullopt;
  stats_.record(StatsRoute::kCpuShm, bytesOf(input));
  shm->allreduce(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()),
                 *shmDtype(input.scalar_type()), *spec);
  return completedCall({output}, asyncOp);
}

std::optional<Pending> GroupCoordinator::shmAllgather(const at::Tensor& input,
                                                      const std::vector<void*>& outs,
                                                      std::vector<at::Tensor> results,
                                                      bool asyncOp) {
  mq::ShmGroup* shm = cpuShm();
  if (logRoutes_)
    logCpuRoute("all_gather", input, shm ? "cpu_shm" : "gloo",
                shm ? "one host" : "shared memory unavailable for this group");
  if (shm == nullptr) return std::nullopt;
  stats_.record(StatsRoute::kCpuShm, bytesOf(input));
  shm->allgather(input.data_ptr(), bytesOf(input), outs);
  return completedCall(std::move(results), asyncOp);
}

std::optional<Pending> GroupCoordinator::shmReduceScatter(const std::vector<const void*>& ins,
                                                          at::Tensor& output,
                                                          const c10d::ReduceOp& op, bool asyncOp) {
  mq::ShmGroup* shm = cpuShm();
  const char* why = "";
  std::optional<mq::ReduceSpec> spec;
  if (shm == nullptr) {
    why = "shared memory unavailable for this group";
  } else {
    spec = shmReduction(op, output.scalar_type(), size(), &why);
  }
  if (logRoutes_)
    logCpuRoute("reduce_scatter", output, spec ? "cpu_shm" : "gloo", spec ? "one host" : why);
  if (!spec) return std::nullopt;
  stats_.record(StatsRoute::kCpuShm, bytesOf(output) * size());
  shm->reduceScatter(ins, output.data_ptr(), static_cast<size_t>(output.numel()),
                     *shmDtype(output.scalar_type()), *spec);
  return completedCall({output}, asyncOp);
}

std::optional<Pending> GroupCoordinator::shmBroadcast(at::Tensor& tensor, int root, bool asyncOp) {
  mq::ShmGroup* shm = cpuShm();
  if (logRoutes_)
    logCpuRoute("broadcast", tensor, shm ? "cpu_shm" : "gloo",
                shm ? "one host" : "shared memory unavailable for this group");
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
