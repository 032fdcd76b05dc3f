// tpcomm::makeBackend and friends: a tpcomm group made from C++ as the
// Python package's backend creator makes it (python/tpcomm/_registration.py),
// over the same coordinator, without Python.
#include <mutex>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "backend/boundary.hpp"
#include "backend/flight_dump.hpp"
#include "backend/process_group_tpcomm.hpp"
#include "common/settings.hpp"
#include "coordinator/faults/gloo_sockets.hpp"
#include "coordinator/group_life.hpp"
#include "cpp/src/torch_backends.hpp"
#include "tpcomm/tpcomm.hpp"

namespace tpcomm {

namespace cpp {

c10::intrusive_ptr<c10d::Backend> checkMade(c10::intrusive_ptr<c10d::Backend> made,
                                            const char* name, int rank, int size,
                                            std::optional<std::chrono::milliseconds> timeout) {
  c10d::Backend* volatile opaque = made.get();
  c10d::Backend* backend = opaque;
  TPCOMM_CHECK(backend->getBackendName() == name && backend->getRank() == rank &&
                   backend->getSize() == size &&
                   (!timeout || backend->getBackendOptions()->timeout == *timeout),
               kSystem, "torch's ", name, " group made from C++ answers as '",
               backend->getBackendName(), "' rank ", backend->getRank(), " of ",
               backend->getSize(), " instead of rank ", rank, " of ", size,
               ": this tpcomm was built against another torch");
  return made;
}

}  // namespace cpp

std::string version() { return TPCOMM_VERSION; }
std::string builtWithTorch() { return TPCOMM_TORCH_VERSION; }

namespace {

backend::ProcessGroupTpcomm* tpcommOf(const c10::intrusive_ptr<c10d::Backend>& backend) {
  return dynamic_cast<backend::ProcessGroupTpcomm*>(backend.get());
}

backend::ProcessGroupTpcomm& tpcommOf(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                      const char* what) {
  TORCH_CHECK(pg, "tpcomm::", what, ": the process group is null");
  bool cpu = false;  // (hasBackendForDeviceType is torch 2.12's)
  for (const auto& device : pg->getDeviceTypes()) cpu = cpu || device.is_cpu();
  TORCH_CHECK(cpu, "tpcomm::", what, ": the process group has no backend for CPU tensors");
  auto* tpcomm = tpcommOf(pg->getBackend(c10::DeviceType::CPU));
  TORCH_CHECK(tpcomm != nullptr, "tpcomm::", what, ": the process group's CPU backend is '",
              pg->getBackend(c10::DeviceType::CPU)->getBackendName(), "', not tpcomm");
  return *tpcomm;
}

}  // namespace

c10::intrusive_ptr<c10d::Backend> makeBackend(const c10::intrusive_ptr<c10d::Store>& store,
                                              int rank, int size, const Options& options) {
  TORCH_CHECK(store, "tpcomm::makeBackend: store is null");
  TORCH_CHECK(size >= 1, "tpcomm::makeBackend: size must be >= 1, got ", size);
  TORCH_CHECK(rank >= 0 && rank < size, "tpcomm::makeBackend: rank ", rank,
              " is out of range for a group of ", size);
  TORCH_CHECK(options.timeout.count() > 0, "tpcomm::makeBackend: timeout must be > 0 ms, got ",
              options.timeout.count());
  TORCH_CHECK(options.globalRanks.empty() || options.globalRanks.size() == size_t(size),
              "tpcomm::makeBackend: globalRanks has ", options.globalRanks.size(),
              " entries for a group of ", size);
  // Before any group exists, so before anything writes a dump through the
  // writer it replaces (backend/flight_dump.hpp); as `import tpcomm` does.
  static std::once_flag dumpWriter;
  std::call_once(dumpWriter, [] { backend::registerMergingDumpWriter(); });
  const std::string name = options.groupName.empty() ? "0" : options.groupName;
  return backend::translateErrors([&]() -> c10::intrusive_ptr<c10d::Backend> {
    // Every key of the group under its name (groups made at once on one
    // store, as torch's front door prefixes them), then under the prefix of
    // this life of the group: nothing of a group made earlier under the
    // same name on the same store reaches it.
    auto groupStore = c10::make_intrusive<c10d::PrefixStore>(name + "/tpcomm/", store);
    const std::string life = coord::agreeOnLife(groupStore, rank, size, options.timeout);
    auto lifeStore = coord::storeOfLife(groupStore, life);
    // Returned once every rank made its part; the Gloo group outlives a
    // failure until every rank ended the making (coordinator/group_life.hpp).
    c10::intrusive_ptr<c10d::Backend> cpu;
    return coord::makeTogether(lifeStore, rank, size, options.timeout, [&] {
      auto cpuStore = c10::make_intrusive<c10d::PrefixStore>("cpu/", lifeStore);
      coord::BackendFactory gloo = cpp::glooFactory(lifeStore);
      cpu = gloo(cpuStore, rank, size, options.timeout);

      coord::GroupOptions group;
      group.rank = rank;
      group.size = size;
      group.timeout = options.timeout;
      group.groupName = name;
      group.life = life;
      group.debugChecks = settings().debug;
      auto coordinator =
          std::make_shared<coord::GroupCoordinator>(group, lifeStore, cpu, cpp::ncclFactory());
      coordinator->setCpuBackendFactory(gloo);
      auto backend = c10::make_intrusive<backend::ProcessGroupTpcomm>(std::move(coordinator));
      // The group's Gloo connections, told by the listening addresses its
      // ranks left in the store, are shut down if the group breaks.
      backend->coordinator().fault().addGlooSockets(
          coord::GlooSockets::ofGroup(cpuStore, rank, size));
      std::vector<uint64_t> globalRanks = options.globalRanks;
      for (int r = 0; globalRanks.empty() && r < size; ++r) globalRanks.push_back(r);
      backend->setGlobalRanks(std::move(globalRanks));
      backend->setGroupDesc(name);
      return backend;
    });
  });
}

c10::intrusive_ptr<c10d::ProcessGroup> makeProcessGroup(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, const Options& options) {
  auto backend = makeBackend(store, rank, size, options);
  const std::string name = options.groupName.empty() ? "0" : options.groupName;
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(
      c10::make_intrusive<c10d::PrefixStore>(name + "/", store), rank, size);
  using Type = c10d::ProcessGroup::BackendType;
  pg->setDefaultBackend(Type::CUSTOM);
  pg->setBackend(c10::DeviceType::CPU, Type::CUSTOM, backend);
  pg->setBackend(c10::DeviceType::CUDA, Type::CUSTOM, backend);
  pg->setGroupName(name);
  pg->setGroupDesc(name);
  return pg;
}

void allReduce(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, at::Tensor& tensor,
               c10d::ReduceOp op) {
  TORCH_CHECK(pg, "tpcomm::allReduce: the process group is null");
  TORCH_CHECK(tensor.defined(), "tpcomm::allReduce: the tensor is undefined");
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = std::move(op);
  auto work = pg->getBackend(tensor.device().type())->allreduce(tensors, options);
  if (c10d::allow_inflight_collective_as_graph_input()) {
    c10d::register_work(tensors[0], work);  // as ProcessGroup::allreduce does
  }
  if (work) work->wait();
}

bool isTpcomm(const c10::intrusive_ptr<c10d::Backend>& backend) {
  return tpcommOf(backend) != nullptr;
}

std::vector<RouteStats> stats(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  std::vector<RouteStats> out;
  for (const auto& row : tpcommOf(pg, "stats").coordinator().stats()) {
    out.push_back(RouteStats{row.route, row.calls, row.bytes});
  }
  return out;
}

std::string fault(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  return tpcommOf(pg, "fault").coordinator().fault().reason();
}

}  // namespace tpcomm
