#pragma once
// N coordinators over ThreadedBackends sharing one hub: a group whose ranks
// are threads of this process.

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "coordinator/group_coordinator.hpp"
#include "threaded_backend.hpp"

namespace tpcomm::testing {

struct ThreadGroup {
  std::shared_ptr<Hub> hub;
  std::vector<c10::intrusive_ptr<ThreadedBackend>> cpu;
  std::vector<std::shared_ptr<coord::GroupCoordinator>> coordinators;
  std::shared_ptr<std::atomic<int>> deviceFactoryCalls = std::make_shared<std::atomic<int>>(0);

  // `customDevices(rank)`: the rank's CustomDevice factory (default: none,
  // the custom kernel is then unavailable).
  ThreadGroup(int size, bool debugChecks = false,
              std::function<coord::CustomDeviceFactory(int rank)> customDevices = {})
      : hub(std::make_shared<Hub>(size)) {
    auto store = c10::make_intrusive<c10d::HashStore>();
    auto calls = deviceFactoryCalls;
    // The device backend of these tests is another threaded group of the same size.
    auto deviceHub = std::make_shared<Hub>(size);
    coord::BackendFactory factory = [calls, deviceHub](const c10::intrusive_ptr<c10d::Store>&,
                                                       int rank, int, std::chrono::milliseconds) {
      ++*calls;
      return c10::intrusive_ptr<c10d::Backend>(
          c10::make_intrusive<ThreadedBackend>(deviceHub, rank));
    };
    for (int r = 0; r < size; ++r) {
      cpu.push_back(c10::make_intrusive<ThreadedBackend>(hub, r));
      coord::GroupOptions options;
      options.cpuShm = false;  // fake CPU backends: the Gloo route, no shm set-up
      options.rank = r;
      options.size = size;
      options.groupName = "test";
      options.debugChecks = debugChecks;
      coord::CustomDeviceFactory custom;
      if (customDevices) custom = customDevices(r);
      coordinators.push_back(
          std::make_shared<coord::GroupCoordinator>(options, store, cpu.back(), factory, custom));
    }
  }
  int size() const { return hub->size(); }
};

// Waits for a Pending the way TpcommWork does (work, then finish).
inline void complete(coord::Pending& pending) {
  pending.work->wait();
  if (pending.finish) pending.finish();
}

// A CPU backend whose allreduce fails as a timed-out Gloo call would.
class FailingBackend : public ThreadedBackend {
 public:
  using ThreadedBackend::ThreadedBackend;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>&,
                                           const c10d::AllreduceOptions&) override {
    return failedWork("Timed out waiting 1000ms for recv operation to complete");
  }
};

// A one-rank group 'g' over a FailingBackend (the Gloo route).
inline std::shared_ptr<coord::GroupCoordinator> failingCoordinator() {
  auto hub = std::make_shared<Hub>(1);
  coord::GroupOptions options;
  options.cpuShm = false;  // fake CPU backends: the Gloo route, no shm set-up
  options.groupName = "g";
  return std::make_shared<coord::GroupCoordinator>(
      options, c10::make_intrusive<c10d::HashStore>(), c10::make_intrusive<FailingBackend>(hub, 0),
      coord::BackendFactory());
}

}  // namespace tpcomm::testing
