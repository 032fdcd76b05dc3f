#include "coordinator/group_coordinator.hpp"

#include <algorithm>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "common/error.hpp"
#include "common/settings.hpp"
#include "coordinator/composite_ops.hpp"
#include "coordinator/debug/debug_check.hpp"
#include "coordinator/group_life.hpp"
#include "coordinator/interpreter_lock.hpp"
#include "coordinator/routed_call.hpp"

namespace tpcomm::coord {

const char* routeName(Route route) { return route == Route::kCpu ? "cpu" : "device"; }

GroupCoordinator::GroupCoordinator(GroupOptions options, c10::intrusive_ptr<c10d::Store> store,
                                   c10::intrusive_ptr<c10d::Backend> cpuBackend,
                                   BackendFactory deviceFactory,
                                   CustomDeviceFactory customDeviceFactory)
    : options_(std::move(options)),
      store_(std::move(store)),
      cpu_(std::move(cpuBackend)),
      deviceFactory_(std::move(deviceFactory)),
      customDeviceFactory_(std::move(customDeviceFactory)),
      routing_(options_.size, RoutingConfig::fromSettings()),
      routeLog_(settings().logRoutes),
      logRoutes_(settings().logRoutes) {
  routing_.setCustomAvailability(false, "not set up yet (at the group's first CUDA allreduce)");
  TPCOMM_CHECK(cpu_, kInvalidUsage, "GroupCoordinator needs a CPU backend");
  TPCOMM_CHECK_EQ(cpu_->getRank(), options_.rank, "(CPU backend rank vs group rank)");
  TPCOMM_CHECK_EQ(cpu_->getSize(), options_.size, "(CPU backend size vs group size)");
  fault_ = GroupFault::create(store_, options_.groupName, options_.rank, options_.size,
                              options_.timeout);
  watchFaults();
  if (options_.debugChecks && store_) {
    p2p_ = std::make_unique<P2pChecker>(store_, options_.groupName, options_.rank, options_.size,
                                        options_.timeout);
  }
}

GroupCoordinator::~GroupCoordinator() {
  withoutInterpreterLock([this] {
    fault_->setReleaser({});
    fault_->setDeviceProbe({});
    customFast_.store(nullptr);
    shmFast_.store(nullptr);
    shm_.reset();
    hierFast_.store(nullptr);
    hier_.reset();
    custom_.reset();
    device_.reset();
    cpu_.reset();
  });
}

c10::intrusive_ptr<c10d::Backend> GroupCoordinator::deviceBackendIfCreated() const {
  std::lock_guard<std::mutex> lock(deviceMutex_);
  return device_;
}

c10d::Backend& GroupCoordinator::deviceBackend() {
  std::lock_guard<std::mutex> lock(deviceMutex_);
  if (!device_) {
    TPCOMM_CHECK(static_cast<bool>(deviceFactory_), kInvalidUsage, "group '", options_.groupName,
                 "' has no device backend (CUDA is not available)");
    auto store = c10::make_intrusive<c10d::PrefixStore>("device/", store_);
    device_ = deviceFactory_(store, options_.rank, options_.size, options_.timeout);
    TPCOMM_CHECK(device_, kInvalidUsage, "the device backend factory returned nothing");
  }
  return *device_;
}

c10d::Backend& GroupCoordinator::backendFor(Route route, uint64_t bytes) {
  if (route == Route::kCpu) {
    stats_.record(StatsRoute::kGloo, bytes);
    return *cpu_;
  }
  c10d::Backend& device = deviceBackend();
  stats_.record(StatsRoute::kNccl, bytes);
  if (coalescing_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(deviceMutex_);
    if (!deviceCoalescing_ && std::this_thread::get_id() == coalescingThread_ &&
        device.supportsCoalescing()) {
      device.startCoalescing();
      deviceCoalescing_ = true;
    }
  }
  return device;
}

void GroupCoordinator::logAllreduceRoute(const c10d::ReduceOp& op, const at::Tensor& tensor,
                                         const std::string& routeName, const std::string& reason) {
  const std::string what = describeReduceOp(op) + " " + dtypeName(tensor.scalar_type());
  const std::string key = std::string(routeName) + "|" + reason + "|" + what;
  routeLog_.once(key, "tpcomm route: group '" + options_.groupName + "' rank " +
                          std::to_string(rank()) + ": allreduce " + what + " " +
                          std::to_string(bytesOf(tensor)) + " B -> " + routeName + " (" + reason +
                          ")");
}

namespace {

// The start of each of `parts` equal byte ranges of a contiguous tensor.
std::vector<void*> slicesOf(const at::Tensor& t, int parts) {
  std::vector<void*> out;
  const uint64_t each = bytesOf(t) / parts;
  for (int r = 0; r < parts; ++r) out.push_back(static_cast<char*>(t.data_ptr()) + r * each);
  return out;
}

std::vector<const void*> constSlicesOf(const at::Tensor& t, int parts) {
  const auto slices = slicesOf(t, parts);
  return {slices.begin(), slices.end()};
}

// Elements per peer of an all-to-all over dim 0: `splits` rows each (empty:
// an even split), times the elements of one row.
std::vector<int64_t> splitCounts(const at::Tensor& t, const std::vector<int64_t>& splits,
                                 int size) {
  int64_t rowNumel = 1;
  for (int64_t d = 1; d < t.dim(); ++d) rowNumel *= t.size(d);
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  std::vector<int64_t> out;
  for (int r = 0; r < size; ++r) {
    out.push_back((splits.empty() ? rows / size : splits[r]) * rowNumel);
  }
  return out;
}

// Tensor i of a coalesced call of n, for the shared-memory signature.
mq::ShmPart partOf(size_t i, size_t n) {
  return mq::ShmPart{static_cast<uint32_t>(i), static_cast<uint32_t>(n)};
}

std::vector<at::Tensor> flatten(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (const auto& list : lists) out.insert(out.end(), list.begin(), list.end());
  return out;
}

}  // namespace

Pending GroupCoordinator::broadcast(std::vector<at::Tensor>& tensors,
                                    const c10d::BroadcastOptions& opts) {
  const auto turn = debugCheck([&] {
    return std::string("broadcast root=" + std::to_string(opts.rootRank) + " " +
                       describeTensors(tensors));
  });
  const Route route = routeFor(tensors[0]);
  if (route == Route::kCpu) {
    if (auto done = shmBroadcast(tensors[0], static_cast<int>(opts.rootRank), opts.asyncOp))
      return *done;
  }
  auto moved = carried(route, tensors);
  return passThrough(backendFor(route, bytesOf(tensors)).broadcast(moved, opts), tensors);
}

Pending GroupCoordinator::allreduce(std::vector<at::Tensor>& tensors,
                                    const c10d::AllreduceOptions& opts) {
  const auto turn = debugCheck([&] {
    return std::string("allreduce " + describeReduceOp(opts.reduceOp) + " " +
                       describeTensors(tensors));
  });
  return allreduceRouted(tensors, opts);
}

Pending GroupCoordinator::allreduceRouted(std::vector<at::Tensor>& tensors,
                                          const c10d::AllreduceOptions& opts) {
  const Route route = routeFor(tensors[0]);
  if (route == Route::kDevice) {
    std::shared_ptr<CustomPath> custom = ensureCustom(tensors[0].device());
    const RouteDecision d =
        routing_.decide(opts.reduceOp, tensors[0].scalar_type(), bytesOf(tensors[0]), logRoutes_);
    if (logRoutes_)
      logAllreduceRoute(opts.reduceOp, tensors[0], deviceRouteName(d.route), d.reason);
    if (d.route != DeviceRoute::kNccl) {
      return customAllreduce(std::move(custom), tensors[0], tensors[0], d.route, opts);
    }
    return passThrough(backendFor(route, bytesOf(tensors)).allreduce(tensors, opts), tensors);
  }
  checkCpuReduces("allreduce", tensors[0].scalar_type());
  if (auto done = shmAllreduce(tensors[0], tensors[0], opts.reduceOp, opts.asyncOp)) return *done;
  const ReductionPlan plan = planWithoutAvgOrPremul(opts.reduceOp);
  if (!plan.composed()) {
    return passThrough(backendFor(route, bytesOf(tensors)).allreduce(tensors, opts), tensors);
  }
  for (auto& t : tensors) {
    if (plan.premultiplies()) premultiplyInPlace(plan, t);
  }
  c10d::AllreduceOptions forwarded = opts;
  forwarded.reduceOp = plan.forwarded;
  Pending pending =
      passThrough(backendFor(route, bytesOf(tensors)).allreduce(tensors, forwarded), tensors);
  pending.finish = divideAfter(plan.divideBySize, tensors, size());
  return pending;
}

Pending GroupCoordinator::allreduceSparse(std::vector<at::Tensor>& tensors,
                                          const c10d::AllreduceOptions& opts) {
  const auto turn = debugCheck([&] {
    return std::string("allreduce_sparse " + describeReduceOp(opts.reduceOp) + " " +
                       describeTensors(tensors));
  });
  // Gloo reduces sparse tensors in its allreduce; NCCL has allreduce_sparse.
  const Route route = routeFor(tensors[0]);
  if (route == Route::kCpu) checkCpuReduces("allreduce_sparse", tensors[0].scalar_type());
  c10d::Backend& backend = backendFor(route, bytesOf(tensors));
  return passThrough(route == Route::kCpu ? backend.allreduce(tensors, opts)
                                          : backend.allreduce_sparse(tensors, opts),
                     tensors);
}

Pending GroupCoordinator::allreduceCoalesced(std::vector<at::Tensor>& tensors,
                                             const c10d::AllreduceCoalescedOptions& opts) {
  const auto turn = debugCheck([&] {
    return std::string("allreduce_coalesced " + describeReduceOp(opts.reduceOp) + " " +
                       describeTensors(tensors));
  });
  const Route route = routeFor(tensors[0]);
  if (route == Route::kCpu) checkCpuReduces("allreduce_coalesced", tensors[0].scalar_type());
  if (route == Route::kCpu && cpuShmReady() &&
      shmReduces(opts.reduceOp, tensors[0].scalar_type(), nullptr)) {
    for (size_t i = 0; i < tensors.size(); ++i)
      shmAllreduce(tensors[i], tensors[i], opts.reduceOp, false, partOf(i, tensors.size()));
    return completedCall(tensors, opts.asyncOp);
  }
  const ReductionPlan plan = planWithoutAvgOrPremul(opts.reduceOp);
  if (route == Route::kDevice || !plan.composed()) {
    return passThrough(backendFor(route, bytesOf(tensors)).allreduce_coalesced(tensors, opts),
                       tensors);
  }
  for (auto& t : tensors) {
    if (plan.premultiplies()) premultiplyInPlace(plan, t);
  }
  c10d::AllreduceCoalescedOptions forwarded = opts;
  forwarded.reduceOp = plan.forwarded;
  Pending pending = passThrough(
      backendFor(route, bytesOf(tensors)).allreduce_coalesced(tensors, forwarded), tensors);
  pending.finish = divideAfter(plan.divideBySize, tensors, size());
  return pending;
}

Pending GroupCoordinator::reduce(std::vector<at::Tensor>& tensors,
                                 const c10d::ReduceOptions& opts) {
  const auto turn = debugCheck([&] {
    return std::string("reduce " + describeReduceOp(opts.reduceOp) +
                       " root=" + std::to_string(opts.rootRank) + " " + describeTensors(tensors));
  });
  const Route route = routeFor(tensors[0]);
  if (route == Route::kCpu) checkCpuReduces("reduce", tensors[0].scalar_type());
  const ReductionPlan plan = planWithoutAvgOrPremul(opts.reduceOp);
  if (route == Route::kDevice || !plan.composed()) {
    return passThrough(backendFor(route, bytesOf(tensors)).reduce(tensors, opts), tensors);
  }
  // Reduce a scratch copy so that non-root ranks' tensors stay untouched.
  at::Tensor target = tensors[0];
  std::vector<at::Tensor> scratch{plan.premultiplies() ? premultiplied(plan, target)
                                                       : target.clone()};
  c10d::ReduceOptions forwarded = opts;
  forwarded.reduceOp = plan.forwarded;
  Pending pending =
      passThrough(backendFor(route, bytesOf(scratch)).reduce(scratch, forwarded), tensors);
  const bool isRoot = opts.rootRank == rank();
  const bool divide = plan.divideBySize;
  const int n = size();
  pending.finish = [scratch, target, isRoot, divide, n]() mutable {
    if (!isRoot) return;
    if (divide) divideInPlace(scratch[0], n);
    target.copy_(scratch[0]);
  };
  return pending;
}

Pending GroupCoordinator::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                    std::vector<at::Tensor>& inputs,
                                    const c10d::AllgatherOptions& opts) {
  const auto turn = debugCheck([&] { return std::string("allgather " + describeTensors(inputs)); });
  const Route route = routeFor(inputs[0]);
  if (route == Route::kCpu) {
    std::vector<void*> outs;
    for (auto& t : outputs[0]) outs.push_back(t.data_ptr());
    if (auto done = shmAllgather(inputs[0], outs, flatten(outputs), opts.asyncOp)) return *done;
  }
  auto outs = carried(route, outputs);
  auto ins = carried(route, inputs);
  return passThrough(backendFor(route, bytesOf(inputs)).allgather(outs, ins, opts),
                     flatten(outputs));
}

Pending GroupCoordinator::allgatherBase(at::Tensor& output, at::Tensor& input,
                                        const c10d::AllgatherOptions& opts) {
  const auto turn = debugCheck([&] {
    return std::string("allgather_into_tensor " + describeTensor(input) + " -> " +
                       describeTensor(output));
  });
  const Route route = routeFor(input);
  if (route == Route::kCpu) {
    if (auto done = shmAllgather(input, slicesOf(output, size()), {output}, opts.asyncOp))
      return *done;
  }
  at::Tensor out = carried(route, output);
  at::Tensor in = carried(route, input);
  return passThrough(backendFor(route, bytesOf(input))._allgather_base(out, in, opts), {output});
}

Pending GroupCoordinator::allgatherCoalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                             std::vector<at::Tensor>& inputs,
                                             const c10d::AllgatherOptions& opts) {
  const auto turn =
      debugCheck([&] { return std::string("allgather_coalesced " + describeTensors(inputs)); });
  const Route route = routeFor(inputs[0]);
  if (route == Route::kCpu && cpuShmReady()) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      std::vector<void*> outs;
      for (auto& list : outputs) outs.push_back(list[i].data_ptr());
      shmAllgather(inputs[i], outs, {}, false, partOf(i, inputs.size()));
    }
    return completedCall(flatten(outputs), opts.asyncOp);
  }
  auto outs = carried(route, outputs);
  auto ins = carried(route, inputs);
  return passThrough(backendFor(route, bytesOf(inputs)).allgather_coalesced(outs, ins, opts),
                     flatten(outputs));
}

Pending GroupCoordinator::allgatherIntoTensorCoalesced(std::vector<at::Tensor>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::AllgatherOptions& opts) {
  const auto turn = debugCheck([&] {
    return std::string("allgather_into_tensor_coalesced " + describeTensors(inputs) + " -> " +
                       describeTensors(outputs));
  });
  const Route route = routeFor(inputs[0]);
  if (route == Route::kCpu && cpuShmReady()) {
    for (size_t i = 0; i < inputs.size(); ++i)
      shmAllgather(inputs[i], slicesOf(outputs[i], size()), {}, false, partOf(i, inputs.size()));
    return completedCall(outputs, opts.asyncOp);
  }
  auto outs = carried(route, outputs);
  auto ins = carried(route, inputs);
  return passThrough(
      backendFor(route, bytesOf(inputs)).allgather_into_tensor_coalesced(outs, ins, opts), outputs);
}

Pending GroupCoordinator::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                 std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  const auto turn = debugCheck([&] {
    return std::string("gather root=" + std::to_string(opts.rootRank) + " " +
                       describeTensors(inputs));
  });
  const Route route = routeFor(inputs[0]);
  auto outs = carried(route, outputs);
  auto ins = carried(route, inputs);
  return passThrough(backendFor(route, bytesOf(inputs)).gather(outs, ins, opts), flatten(outputs));
}

Pending GroupCoordinator::scatter(std::vector<at::Tensor>& outputs,
                                  std::vector<std::vector<at::Tensor>>& inputs,
                                  const c10d::ScatterOptions& opts) {
  const auto turn = debugCheck([&] {
    return std::string("scatter root=" + std::to_string(opts.rootRank) + " " +
                       describeTensors(outputs));
  });
  const Route route = routeFor(outputs[0]);
  auto outs = carried(route, outputs);
  auto ins = carried(route, inputs);
  return passThrough(backendFor(route, bytesOf(outputs)).scatter(outs, ins, opts), outputs);
}

Pending GroupCoordinator::reduceScatter(std::vector<at::Tensor>& outputs,
                                        std::vector<std::vector<at::Tensor>>& inputs,
                                        const c10d::ReduceScatterOptions& opts) {
  const auto turn = debugCheck([&] {
    return std::string("reduce_scatter " + describeReduceOp(opts.reduceOp) + " " +
                       describeTensors(outputs));
  });
  const Route route = routeFor(outputs[0]);
  if (route == Route::kCpu) {
    checkCpuReduces("reduce_scatter", outputs[0].scalar_type());
    std::vector<const void*> ins;
    for (const auto& t : inputs[0]) ins.push_back(t.data_ptr());
    if (auto done = shmReduceScatter(ins, outputs[0], opts.reduceOp, opts.asyncOp)) return *done;
  }
  const ReductionPlan plan = planWithoutAvgOrPremul(opts.reduceOp);
  if (route == Route::kDevice || !plan.composed()) {
    return withoutFutureOnCpu(
        route, passThrough(backendFor(route, bytesOf(inputs)).reduce_scatter(outputs, inputs, opts),
                           outputs));
  }
  std::vector<std::vector<at::Tensor>> scaled = inputs;
  if (plan.premultiplies()) {
    for (auto& list : scaled) {
      for (auto& t : list) t = premultiplied(plan, t);
    }
  }
  c10d::ReduceScatterOptions forwarded = opts;
  forwarded.reduceOp = plan.forwarded;
  Pending pending = withoutFutureOnCpu(
      route,
      passThrough(backendFor(route, bytesOf(inputs)).reduce_scatter(outputs, scaled, forwarded),
                  outputs));
  auto divide = divideAfter(plan.divideBySize, outputs, size());
  pending.finish = [scaled, divide]() {
    if (divide) divide();
  };
  return pending;
}

Pending GroupCoordinator::reduceScatterBase(at::Tensor& output, at::Tensor& input,
                                            const c10d::ReduceScatterOptions& opts) {
  const auto turn = debugCheck([&] {
    return std::string("reduce_scatter_tensor " + describeReduceOp(opts.reduceOp) + " " +
                       describeTensor(input) + " -> " + describeTensor(output));
  });
  const Route route = routeFor(input);
  if (route == Route::kCpu) {
    checkCpuReduces("reduce_scatter_tensor", input.scalar_type());
    if (auto done =
            shmReduceScatter(constSlicesOf(input, size()), output, opts.reduceOp, opts.asyncOp))
      return *done;
  }
  const ReductionPlan plan = planWithoutAvgOrPremul(opts.reduceOp);
  if (route == Route::kDevice || !plan.composed()) {
    return withoutFutureOnCpu(
        route,
        passThrough(backendFor(route, bytesOf(input))._reduce_scatter_base(output, input, opts),
                    {output}));
  }
  at::Tensor source = plan.premultiplies() ? premultiplied(plan, input) : input;
  c10d::ReduceScatterOptions forwarded = opts;
  forwarded.reduceOp = plan.forwarded;
  Pending pending = withoutFutureOnCpu(
      route,
      passThrough(backendFor(route, bytesOf(input))._reduce_scatter_base(output, source, forwarded),
                  {output}));
  auto divide = divideAfter(plan.divideBySize, {output}, size());
  pending.finish = [source, divide]() {
    if (divide) divide();
  };
  return pending;
}

Pending GroupCoordinator::reduceScatterTensorCoalesced(std::vector<at::Tensor>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::ReduceScatterOptions& opts) {
  const auto turn = debugCheck([&] {
    return std::string("reduce_scatter_tensor_coalesced " + describeReduceOp(opts.reduceOp) + " " +
                       describeTensors(inputs) + " -> " + describeTensors(outputs));
  });
  const Route route = routeFor(inputs[0]);
  if (route == Route::kCpu) {
    for (const auto& t : inputs)
      checkCpuReduces("reduce_scatter_tensor_coalesced", t.scalar_type());
  }
  // Through shared memory only when it reduces every input's dtype (they may
  // differ): the call is never split between the two paths.
  const bool everyDtype = std::all_of(inputs.begin(), inputs.end(), [&](const at::Tensor& t) {
    return shmReduces(opts.reduceOp, t.scalar_type(), nullptr);
  });
  if (route == Route::kCpu && everyDtype && cpuShmReady()) {
    for (size_t i = 0; i < inputs.size(); ++i)
      shmReduceScatter(constSlicesOf(inputs[i], size()), outputs[i], opts.reduceOp, false,
                       partOf(i, inputs.size()));
    return completedCall(outputs, opts.asyncOp);
  }
  const ReductionPlan plan = planWithoutAvgOrPremul(opts.reduceOp);
  if (route == Route::kDevice || !plan.composed()) {
    return withoutFutureOnCpu(
        route, passThrough(backendFor(route, bytesOf(inputs))
                               .reduce_scatter_tensor_coalesced(outputs, inputs, opts),
                           outputs));
  }
  std::vector<at::Tensor> sources = inputs;
  if (plan.premultiplies()) {
    for (auto& t : sources) t = premultiplied(plan, t);
  }
  c10d::ReduceScatterOptions forwarded = opts;
  forwarded.reduceOp = plan.forwarded;
  Pending pending = withoutFutureOnCpu(
      route, passThrough(backendFor(route, bytesOf(inputs))
                             .reduce_scatter_tensor_coalesced(outputs, sources, forwarded),
                         outputs));
  auto divide = divideAfter(plan.divideBySize, outputs, size());
  pending.finish = [sources, divide]() {
    if (divide) divide();
  };
  return pending;
}

Pending GroupCoordinator::alltoallBase(at::Tensor& output, at::Tensor& input,
                                       std::vector<int64_t>& outputSplits,
                                       std::vector<int64_t>& inputSplits,
                                       const c10d::AllToAllOptions& opts) {
  // Splits legitimately differ between ranks: compare dtypes, then check
  // that what each rank sends is what its peer expects.
  const auto turn =
      debugCheck([&] { return std::string("alltoall_base " + dtypeName(input.scalar_type())); });
  if (options_.debugChecks) {
    checkAlltoallCounts(*cpu_, options_.groupName, debugSequence_, "all_to_all_single",
                        splitCounts(input, inputSplits, size()),
                        splitCounts(output, outputSplits, size()));
  }
  const Route route = routeFor(input);
  at::Tensor out = carried(route, output);
  at::Tensor in = carried(route, input);
  return passThrough(
      backendFor(route, bytesOf(input)).alltoall_base(out, in, outputSplits, inputSplits, opts),
      {output});
}

Pending GroupCoordinator::alltoall(std::vector<at::Tensor>& outputs,
                                   std::vector<at::Tensor>& inputs,
                                   const c10d::AllToAllOptions& opts) {
  const auto turn = debugCheck([&] {
    return std::string("alltoall " + dtypeName(inputs[0].scalar_type()) + " x" +
                       std::to_string(inputs.size()));
  });
  if (options_.debugChecks) {
    std::vector<int64_t> sends, recvs;
    for (const auto& t : inputs) sends.push_back(t.numel());
    for (const auto& t : outputs) recvs.push_back(t.numel());
    checkAlltoallCounts(*cpu_, options_.groupName, debugSequence_, "all_to_all", sends, recvs);
  }
  const Route route = routeFor(inputs[0]);
  if (route == Route::kDevice) {
    return passThrough(backendFor(route, bytesOf(inputs)).alltoall(outputs, inputs, opts), outputs);
  }
  auto outs = carried(route, outputs);
  auto ins = carried(route, inputs);
  Pending pending = alltoallThroughBase(backendFor(route, bytesOf(inputs)), outs, ins, opts);
  pending.outputs = outputs;
  return pending;
}

Pending GroupCoordinator::barrier(const c10d::BarrierOptions& opts) {
  const auto turn = debugCheck([&] { return std::string("barrier"); });
  if (auto done = shmBarrier(opts.asyncOp)) return *done;
  return passThrough(backendFor(Route::kCpu, 0).barrier(opts), {});
}

void GroupCoordinator::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  backendFor(Route::kCpu, 0).monitoredBarrier(opts, waitAllRanks);
}

std::shared_ptr<GroupCoordinator> GroupCoordinator::split(
    const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
    std::chrono::milliseconds timeout, const std::string& groupName) {
  const auto at = std::find(ranks.begin(), ranks.end(), rank());
  TPCOMM_CHECK(at != ranks.end(), kInvalidUsage, "rank ", rank(), " is not in the split ranks");
  GroupOptions options = options_;
  options.rank = static_cast<int>(at - ranks.begin());
  options.size = static_cast<int>(ranks.size());
  options.timeout = timeout;
  options.groupName = groupName;
  // A Gloo group on this group's network interface (the CPU backend
  // factory's, with a device of its own), where Gloo's own split would
  // bind its default one.
  if (cpuFactory_) return form(store, options, cpuFactory_, deviceFactory_);
  // Every key of the child (its Gloo group's too) under its life's prefix:
  // nothing of a split made earlier under the same name reaches it.
  options.life = agreeOnLife(store, options.rank, options.size, timeout);
  const auto lifeStore = storeOfLife(store, options.life);
  // Returned once every rank of the child made its part; the Gloo group
  // outlives a failure until every rank ended the making (group_life.hpp).
  c10::intrusive_ptr<c10d::Backend> cpu;
  return makeTogether(lifeStore, options.rank, options.size, timeout, [&] {
    auto cpuStore = c10::make_intrusive<c10d::PrefixStore>("cpu/", lifeStore);
    auto cpuOptions = c10::make_intrusive<c10d::Backend::Options>("gloo", timeout);
    cpuOptions->group_name = groupName;
    cpu = cpu_->split(cpuStore, ranks, cpuOptions);
    TPCOMM_CHECK(cpu, kInvalidUsage, "rank ", rank(), " is not in the split ranks");
    options.rank = cpu->getRank();
    options.size = cpu->getSize();
    auto child = std::make_shared<GroupCoordinator>(options, lifeStore, cpu, deviceFactory_);
    child->fault().addGlooSockets(
        GlooSockets::unknown("made by Gloo's own split, which shares its parent's device"));
    return child;
  });
}

}  // namespace tpcomm::coord
