// The GroupCoordinator's CUDA side: binding the group's GPU, the custom
// allreduce (set-up, calls, graph registration) and eager connect.
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>

#include "common/error.hpp"
#include "common/settings.hpp"
#include "coordinator/debug/debug_check.hpp"
#include "coordinator/group_coordinator.hpp"
#include "coordinator/stream_work.hpp"

namespace tpcomm::coord {

Route GroupCoordinator::routeFor(const at::Tensor& tensor) {
  if (tensor.device().is_cpu()) return Route::kCpu;
  bindDevice(tensor.device());
  return Route::kDevice;
}

void GroupCoordinator::bindDevice(at::Device device) {
  std::lock_guard<std::mutex> lock(deviceMutex_);
  if (!cudaDevice_) {
    cudaDevice_ = device;
  } else {
    TPCOMM_CHECK(*cudaDevice_ == device, kInvalidUsage, "group '", options_.groupName, "' rank ",
                 options_.rank, ": a call on ", device,
                 ", but this rank's CUDA calls on the "
                 "group use ",
                 *cudaDevice_,
                 " (the GPU of its first CUDA call); move the "
                 "tensor there or use a group per GPU");
  }
}

std::optional<at::Device> GroupCoordinator::cudaDevice() const {
  std::lock_guard<std::mutex> lock(deviceMutex_);
  return cudaDevice_;
}

std::shared_ptr<CustomPath> GroupCoordinator::customPath() const {
  std::lock_guard<std::mutex> lock(deviceMutex_);
  return custom_;
}

std::chrono::milliseconds GroupCoordinator::customTimeout() const {
  // A kernel waiting for a peer is a collective waiting for a peer: it gets
  // the group's timeout unless TPCOMM_CAR_TIMEOUT_MS says otherwise.
  const int64_t set = settings().carTimeoutMs;
  return set > 0 ? std::chrono::milliseconds(set) : options_.timeout;
}

std::shared_ptr<CustomPath> GroupCoordinator::ensureCustom(at::Device device) {
  std::shared_ptr<CustomPath> created;
  {
    std::lock_guard<std::mutex> lock(deviceMutex_);
    if (custom_) return custom_;
    // Decided from what every rank shares, so either every rank sets up or
    // none. TPCOMM_ROUTE is a rank's own: the set-up compares it first.
    std::string skip;
    if (options_.size < 2 || options_.size > car::kMaxRanks) {
      skip = detail::concat("world size ", options_.size, " is outside 2..", car::kMaxRanks);
    } else if (!customDeviceFactory_) {
      skip = "no GPU side for the custom kernel in this coordinator";
    }
    if (!skip.empty()) {
      routing_.setCustomAvailability(false, skip);
      custom_ = std::make_shared<CustomPath>(skip);
      return custom_;
    }
    // Every setting that makes a rank launch differently (the maximum size
    // is compared by the set-up itself).
    const RoutingConfig& config = routing_.config();
    const LaunchSettings launch{
        {"TPCOMM_CAR_BLOCKS", std::to_string(settings().carBlocks)},
        {"TPCOMM_CAR_FLAG_SCOPE", settings().carFlagScope},
        {"TPCOMM_CAR_PUSH_MAX_BYTES", std::to_string(settings().carPushMaxBytes)},
        {"TPCOMM_CAR_PDL", settings().carPdl},
        {"TPCOMM_ROUTE", config.mode},
        {"TPCOMM_ONESHOT_MAX_BYTES", std::to_string(config.oneShotMaxBytes)},
        {"TPCOMM_AUTOTUNE", settings().autotune ? "1" : "0"}};
    created = std::make_shared<CustomPath>(
        *cpu_, options_.rank, options_.size, device, customDeviceFactory_(device.index()),
        static_cast<size_t>(config.customMaxBytes), customTimeout(), options_.groupName, launch,
        config.mode == "nccl" ? "TPCOMM_ROUTE=nccl" : "");
    routing_.setCustomAvailability(created->available(), created->reason());
    custom_ = created;
    if (created->available()) customFast_.store(created.get());
  }
  // Outside the lock: the measurement may create the device backend.
  if (settings().autotune && created->available()) tuneRouting(*created);
  return created;
}

Pending GroupCoordinator::customAllreduce(std::shared_ptr<CustomPath> custom, at::Tensor& input,
                                          at::Tensor& output, DeviceRoute route,
                                          const c10d::AllreduceOptions& opts) {
  const float scale =
      opts.reduceOp == c10d::ReduceOp::AVG ? 1.f / static_cast<float>(options_.size) : 1.f;
  stats_.record(route == DeviceRoute::kCustomOneShot ? StatsRoute::kCustomOneShot
                                                     : StatsRoute::kCustomTwoShot,
                bytesOf(input));
  const bool registering = registrationDepth_.load() > 0;
  const auto current = c10::cuda::getCurrentCUDAStream(input.device().index());
  Pending pending;
  pending.outputs = {output};
  if (!opts.asyncOp) {
    // As ProcessGroupNCCL: ordered on the current stream, no Work.
    custom->allreduce(input, output, route, scale, current, registering);
    return pending;
  }
  // On the group's comm stream, so that it overlaps the caller's work; the
  // kernel's launch order (car::LaunchOrder) keeps it after every earlier
  // launch of the group on any stream, and every later one after it.
  c10::cuda::CUDAStream stream = current;
  {
    std::lock_guard<std::mutex> lock(deviceMutex_);
    if (!commStream_) commStream_ = c10::cuda::getStreamFromPool(false, input.device().index());
    stream = *commStream_;
  }
  {
    const std::shared_ptr<at::cuda::CUDAEvent> ready = takePooledEvent(input.device().index());
    ready->record(current);
    ready->block(stream);  // after whatever produced the input
  }
  custom->allreduce(input, output, route, scale, stream, registering);
  std::vector<at::Tensor> inputs;
  if (!input.is_same(output)) inputs.push_back(input);
  pending.work =
      c10::make_intrusive<StreamWork>(options_.rank, c10d::OpType::ALLREDUCE, stream,
                                      pending.outputs, inputs, [custom] { custom->checkError(); });
  return pending;
}

Pending GroupCoordinator::allreduceInto(at::Tensor& input, at::Tensor& output,
                                        const c10d::AllreduceOptions& opts) {
  // Checked before the custom kernel's set-up, whose exchanges run on the
  // CPU group too.
  const auto turn = debugCheck([&] {
    return std::string("allreduce " + describeReduceOp(opts.reduceOp) + " " +
                       describeTensor(input));
  });
  if (routeFor(input) == Route::kDevice) {
    std::shared_ptr<CustomPath> custom = ensureCustom(input.device());
    const RouteDecision d =
        routing_.decide(opts.reduceOp, input.scalar_type(), bytesOf(input), logRoutes_);
    if (logRoutes_) logAllreduceRoute(opts.reduceOp, input, deviceRouteName(d.route), d.reason);
    if (d.route != DeviceRoute::kNccl) {
      return customAllreduce(std::move(custom), input, output, d.route, opts);
    }
  }
  // CPU through shared memory: out of place, without the copy below.
  if (routeFor(input) == Route::kCpu && cpuShm() != nullptr &&
      shmReduces(opts.reduceOp, input.scalar_type(), nullptr)) {
    return *shmAllreduce(input, output, opts.reduceOp, opts.asyncOp);
  }
  output.copy_(input);
  std::vector<at::Tensor> tensors{output};
  return allreduceRouted(tensors, opts);
}

void GroupCoordinator::beginGraphRegistration() {
  std::lock_guard<std::mutex> lock(deviceMutex_);
  ++registrationDepth_;
}

void GroupCoordinator::finishGraphRegistration() {
  std::shared_ptr<CustomPath> custom;
  {
    std::lock_guard<std::mutex> lock(deviceMutex_);
    TPCOMM_CHECK(registrationDepth_ > 0, kInvalidUsage,
                 "graph registration finished more often than it began");
    if (--registrationDepth_ > 0) return;
    custom = custom_;
  }
  if (custom) {
    const auto turn = debugTurn();  // its exchanges are not interleaved with a check's
    custom->finishGraphRegistration(*cpu_);
  }
}

void GroupCoordinator::resetCustom() {
  std::shared_ptr<CustomPath> custom = customPath();
  // Every rank decides alike: the path exists on every rank or on none
  // (it is made by the group's first CUDA allreduce, a collective).
  if (custom) {
    const auto turn = debugTurn();
    custom->reset(*cpu_);
  }
}

void GroupCoordinator::eagerConnect(at::Device device) {
  if (device.is_cpu()) return;
  bindDevice(device);
  ensureCustom(device);
  deviceBackend().eagerConnectSingleDevice(device);
}

// The device backend's own batch (coalescing), opened in backendFor.
void GroupCoordinator::startCoalescing() {
  std::lock_guard<std::mutex> lock(deviceMutex_);
  deviceCoalescing_ = false;
  coalescingThread_ = std::this_thread::get_id();
  coalescing_.store(true, std::memory_order_release);
}

c10::intrusive_ptr<c10d::Work> GroupCoordinator::endCoalescing() {
  c10::intrusive_ptr<c10d::Backend> device;
  {
    std::lock_guard<std::mutex> lock(deviceMutex_);
    coalescing_.store(false, std::memory_order_release);
    if (!deviceCoalescing_) return {};
    deviceCoalescing_ = false;
    device = device_;
  }
  // Outside the lock: ncclGroupEnd may block (connections being made), and
  // a break's release takes the lock to abort the device backend.
  return device->endCoalescing();
}

}  // namespace tpcomm::coord
