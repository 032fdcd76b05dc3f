// The group's faults, timeouts, abort and shutdown: what breaking the group
// releases on each route (group_fault.hpp), and the device work the
// watchdog watches.
#include <mutex>
#include <vector>

#include "coordinator/common/error.hpp"
#include "coordinator/group_coordinator.hpp"

namespace tpcomm::coord {

void GroupCoordinator::watchFaults() {
  fault_->setReleaser([this](const std::string& why) {
    // Gloo's worker threads may stay blocked in a released call until the
    // peer's process exits or Gloo's timeout; destroying the Gloo group
    // would join them. A broken group's Gloo group is therefore never
    // destroyed (the process's exit ends its threads).
    static std::mutex keptMutex;
    static auto* kept = new std::vector<c10::intrusive_ptr<c10d::Backend>>();
    {
      std::lock_guard<std::mutex> lock(keptMutex);
      kept->push_back(cpu_);
    }
    if (auto* shm = shmFast_.load()) shm->abort(why);
    if (auto* hier = hierFast_.load()) hier->abort(why);
    if (auto* custom = customFast_.load()) custom->abort();  // cheap: before NCCL's
    if (auto device = deviceBackendIfCreated()) device->abort();
  });
  fault_->setDeviceProbe([this] {
    auto* custom = customFast_.load();
    return custom != nullptr && custom->launchesPending();
  });
}

void GroupCoordinator::setTimeout(std::chrono::milliseconds timeout) {
  options_.timeout = timeout;
  cpu_->setTimeout(timeout);
  if (p2p_) p2p_->setTimeout(timeout);
  if (auto* shm = shmFast_.load()) shm->setTimeout(timeout);
  if (auto* hier = hierFast_.load()) hier->setTimeout(timeout);
  if (auto device = deviceBackendIfCreated()) device->setTimeout(timeout);
  if (auto custom = customPath()) custom->setTimeout(customTimeout());
  fault_->setTimeout(timeout);
}

void GroupCoordinator::abort() {
  // Published, then released (the shared-memory paths, the device backend,
  // the Gloo connections, the calls in flight): group_fault.hpp.
  fault_->breakGroup(detail::concat("rank ", rank(), " aborted the group"));
  cpu_->abort();
}

void GroupCoordinator::shutdown() {
  if (auto device = deviceBackendIfCreated()) device->shutdown();
  cpu_->shutdown();
}

}  // namespace tpcomm::coord
