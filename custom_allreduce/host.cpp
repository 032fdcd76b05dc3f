// Host side of the custom allreduce: per-call checks and the launch, the
// rank buffers, IPC handles and the write probe.
#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>

#include "common/settings.hpp"
#include "custom_allreduce/cuda_check.hpp"
#include "custom_allreduce/custom_allreduce.hpp"
#include "custom_allreduce/launch.hpp"
#include "custom_allreduce/signal.hpp"

namespace tpcomm::car {

CustomAllreduce::CustomAllreduce(int rank, int worldSize, std::vector<void*> buffers,
                                 size_t maxBytes, std::chrono::milliseconds timeout,
                                 uint32_t* errorWordHost, uint32_t* errorWordDevice,
                                 std::unique_ptr<LaunchOrder> order)
    : rank_(rank),
      worldSize_(worldSize),
      buffers_(std::move(buffers)),
      layout_(BufferLayout::forMaxBytes(maxBytes)),
      timeoutMs_(timeout.count()),
      errorHost_(errorWordHost),
      errorDevice_(errorWordDevice),
      order_(std::move(order)) {
  TPCOMM_CHECK(worldSize_ >= 2 && worldSize_ <= kMaxRanks, kInvalidUsage,
               "custom allreduce: world size ", worldSize_, " is outside 2..", kMaxRanks);
  TPCOMM_CHECK(rank_ >= 0 && rank_ < worldSize_, kInvalidUsage, "custom allreduce: rank ", rank_,
               " is outside 0..", worldSize_ - 1);
  TPCOMM_CHECK_EQ(static_cast<int>(buffers_.size()), worldSize_, "(buffers vs world size)");
  for (size_t r = 0; r < buffers_.size(); ++r) {
    TPCOMM_CHECK(buffers_[r] != nullptr, kInvalidUsage, "custom allreduce: no buffer for rank ", r);
  }
  TPCOMM_CHECK(errorHost_ != nullptr && errorDevice_ != nullptr, kInvalidUsage,
               "custom allreduce: no error word");
  setTimeout(timeout);
}

CustomAllreduce::~CustomAllreduce() {
  try {
    waitForLaunches();
  } catch (const std::exception&) {
    // e.g. at exit, or a sticky CUDA error: nothing more can be done
  }
}

void CustomAllreduce::waitForLaunches() {
  std::lock_guard<std::mutex> lock(launchMutex_);
  if (order_) order_->synchronize();
}

void CustomAllreduce::setTimeout(std::chrono::milliseconds timeout) {
  TPCOMM_CHECK(timeout.count() > 0, kInvalidUsage,
               "custom allreduce: the timeout must be positive, got ", timeout.count(), " ms");
  timeoutMs_.store(timeout.count());
}

void CustomAllreduce::checkCall(const void* in, const void* out, size_t bytes, DType dtype,
                                const CallOptions& options) const {
  const Eligibility e = callEligibility(dtypeName(dtype), bytes, reinterpret_cast<uintptr_t>(in),
                                        reinterpret_cast<uintptr_t>(out), layout_.maxBytes);
  TPCOMM_CHECK(e.eligible, kInvalidUsage, "custom allreduce cannot take this call: ", e.reason);
  const uint32_t failed = errorCode();
  TPCOMM_CHECK(failed == 0, kPeerLost, "custom allreduce on rank ", rank_,
               ": an earlier call failed (", describeError(failed),
               "); every rank must reset its signals before the group is used again");
  TPCOMM_CHECK(options.registered != nullptr || options.stageInput, kInvalidUsage,
               "custom allreduce: an input that is not staged needs a zero-copy table");
}

void CustomAllreduce::launch(LaunchParams& p, cudaStream_t stream, size_t bytes,
                             const CallOptions& options) {
  // (Ranks sharing a GPU: the launch caps this further to what the GPU
  // holds of the kernel, halved with PDL.)
  p.blocks =
      chooseBlocks(p.algorithm, worldSize_, bytes,
                   options.blocks > 0 ? options.blocks : static_cast<int>(settings().carBlocks),
                   sharedGpu_.load() ? kSharedGpuBlocks : kMaxBlocks);
  if (p.hidden > 0) {
    // A fused kernel's block owns whole rows: no more blocks than a part has rows.
    const size_t rows = p.count / p.hidden;
    const size_t parts = p.algorithm == Algorithm::kTwoShot ? worldSize_ : 1;  // push: 1
    p.blocks = static_cast<int>(std::clamp<size_t>((rows + parts - 1) / parts, 1, p.blocks));
  }
  p.rank = rank_;
  p.worldSize = worldSize_;
  p.buffers = buffers_.data();
  p.registered = options.registered;
  p.stage = options.stageInput;
  p.scale = options.scale;
  p.stagingOffset = layout_.stagingOffset;
  p.stagingBytes = layout_.stagingBytes;
  p.resultOffset = layout_.resultOffset;
  p.pushOffset = layout_.pushOffset;
  p.pushSlotBytes = layout_.pushSlotBytes;
  p.pdl = pdl_.load(std::memory_order_relaxed);
  p.sharedGpu = sharedGpu_.load(std::memory_order_relaxed);
  p.deviceScope = deviceScope_.load(std::memory_order_relaxed);
  p.timeoutNs = static_cast<uint64_t>(timeoutMs_.load()) * 1000000ull;
  p.errorDevice = errorDevice_;
  std::lock_guard<std::mutex> lock(launchMutex_);
  if (!order_) {
    order_ = makeEventLaunchOrder();
    order_->setCaptureEvents(captureEvents_.load());
  }
  queryableOrder_.store(order_.get(), std::memory_order_release);
  order_->before(stream);
  launchAllreduce(p, stream);
  order_->after(stream);
}

Algorithm CustomAllreduce::pickAlgorithm(size_t pushBytes, size_t bytes,
                                         const CallOptions& options) const {
  if (!options.chooseAlgorithm) {
    TPCOMM_CHECK(options.algorithm != Algorithm::kPush || pushBytes <= layout_.pushSlotBytes,
                 kInvalidUsage, "custom allreduce: a push of ", pushBytes,
                 " bytes exceeds the push buffer of ", layout_.pushSlotBytes, " bytes");
    return options.algorithm;
  }
  if (pushApplies(worldSize_, pushBytes, layout_.maxBytes, settings().carPushMaxBytes)) {
    return Algorithm::kPush;
  }
  return chooseAlgorithm(worldSize_, bytes, layout_.maxBytes, /*pushSetting=*/0);
}

Algorithm CustomAllreduce::allreduce(const void* in, void* out, size_t count, DType dtype,
                                     cudaStream_t stream, const CallOptions& options) {
  const size_t bytes = count * dtypeSize(dtype);
  // A push carries whole packs (the last one padded).
  const size_t pushBytes = (bytes + kPackBytes - 1) / kPackBytes * kPackBytes;
  const Algorithm algorithm = pickAlgorithm(pushBytes, bytes, options);
  checkCall(in, out, bytes, dtype, options);
  // Blocks do not wait for each other within a rank: an output that shares
  // bytes with the input at another offset would be written by one block
  // while another still copies or a peer still reads (the same tensor is
  // fine: a block writes only what it staged).
  TPCOMM_CHECK(in == out || !rangesOverlap(in, out, bytes), kInvalidUsage,
               "custom allreduce: the output overlaps the input without being the same memory");
  if (count == 0) return algorithm;
  LaunchParams p;
  p.input = in;
  p.output = out;
  p.count = count;
  p.dtype = dtype;
  p.algorithm = algorithm;
  launch(p, stream, bytes, options);
  return algorithm;
}

void CustomAllreduce::configureFor(const std::vector<int>& devices) {
  setDeviceScope(deviceScopeFor(devices, settings().carFlagScope));
  setSharedGpu(sharesAGpu(devices));
  setCaptureEvents(settings().carGraphOrder == "event");
  const std::string& pdl = settings().carPdl;
  setPdl(pdl == "on" || (pdl == "auto" && !sharesAGpu(devices)));
}

void CustomAllreduce::setCaptureEvents(bool events) {
  std::lock_guard<std::mutex> lock(launchMutex_);
  captureEvents_.store(events);
  if (order_) order_->setCaptureEvents(events);
}

void CustomAllreduce::barrierOnly(cudaStream_t stream, int blocks) {
  TPCOMM_CHECK(blocks >= 1 && blocks <= kMaxBlocks, kInvalidUsage, "custom allreduce: ", blocks,
               " blocks asked for; 1 to ", kMaxBlocks);
  const uint32_t failed = errorCode();
  TPCOMM_CHECK(failed == 0, kPeerLost, "custom allreduce on rank ", rank_,
               ": an earlier call failed (", describeError(failed), ")");
  LaunchParams p;  // a one-shot of no elements: open, the start barrier, done
  p.count = 0;
  p.algorithm = Algorithm::kOneShot;
  CallOptions options;
  options.blocks = blocks;
  launch(p, stream, 0, options);
}

Algorithm CustomAllreduce::allreduceAddRmsNorm(const void* in, const AddRmsNorm& norm, DType dtype,
                                               cudaStream_t stream, const CallOptions& options) {
  const size_t count = norm.rows * norm.hidden;
  const size_t bytes = count * dtypeSize(dtype);
  TPCOMM_CHECK(norm.hidden > 0, kInvalidUsage, "custom allreduce + RMSNorm: hidden size 0");
  // A push carries each row as whole packs (its last one padded).
  const size_t rowPacks = (norm.hidden * dtypeSize(dtype) + kPackBytes - 1) / kPackBytes;
  const Algorithm algorithm = pickAlgorithm(norm.rows * rowPacks * kPackBytes, bytes, options);
  TPCOMM_CHECK(options.registered == nullptr && options.stageInput, kInvalidUsage,
               "custom allreduce + RMSNorm: always stages its input (no zero-copy table)");
  TPCOMM_CHECK(std::isfinite(norm.eps) && norm.eps >= 0.f, kInvalidUsage,
               "custom allreduce + RMSNorm: eps must be finite and not negative, got ", norm.eps);
  checkCall(in, norm.normed, bytes, dtype, options);
  TPCOMM_CHECK(norm.residual && norm.residualOut && norm.weight && norm.normed, kInvalidUsage,
               "custom allreduce + RMSNorm: a null pointer among residual, residual_out, weight, "
               "normed");
  // A block writes only the rows it staged and read: an output may be the
  // same memory as what it replaces, never a shifted overlap.
  auto sameOrApart = [bytes](const void* a, const void* b) {
    return a == b || !rangesOverlap(a, b, bytes);
  };
  TPCOMM_CHECK(sameOrApart(in, norm.normed) && sameOrApart(in, norm.residualOut) &&
                   sameOrApart(norm.residual, norm.residualOut),
               kInvalidUsage,
               "custom allreduce + RMSNorm: an output overlaps the input or the residual without "
               "being the same memory");
  TPCOMM_CHECK(!rangesOverlap(norm.normed, norm.residual, bytes) &&
                   !rangesOverlap(norm.normed, norm.residualOut, bytes) &&
                   !rangesOverlap(norm.normed, norm.weight, norm.hidden * dtypeSize(dtype)) &&
                   !rangesOverlap(norm.residualOut, norm.weight, norm.hidden * dtypeSize(dtype)),
               kInvalidUsage,
               "custom allreduce + RMSNorm: normed overlaps the residual, or an output overlaps "
               "the weight");
  if (count == 0) return algorithm;
  const size_t packElements = kPackBytes / dtypeSize(dtype);
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % kPackBytes == 0; };
  LaunchParams p;
  p.input = in;
  p.output = norm.normed;
  p.count = count;
  p.dtype = dtype;
  p.algorithm = algorithm;
  p.hidden = norm.hidden;
  p.residual = norm.residual;
  p.residualOut = norm.residualOut;
  p.weight = norm.weight;
  p.eps = norm.eps;
  p.packed = norm.hidden % packElements == 0 && aligned(in) && aligned(norm.residual) &&
             aligned(norm.residualOut) && aligned(norm.weight) && aligned(norm.normed);
  launch(p, stream, bytes, options);
  return algorithm;
}

RelaxedCaptureMode::RelaxedCaptureMode() {
  mode_ = cudaStreamCaptureModeRelaxed;
  if (cudaThreadExchangeStreamCaptureMode(&mode_) != cudaSuccess) {
    cudaGetLastError();
    restore_ = false;
  }
}

RelaxedCaptureMode::~RelaxedCaptureMode() {
  if (restore_) cudaThreadExchangeStreamCaptureMode(&mode_);
}

namespace {

class EventLaunchOrder : public LaunchOrder {
 public:
  ~EventLaunchOrder() override {
    for (cudaEvent_t e : {event_, inCapture_}) {
      if (e != nullptr && cudaEventDestroy(e) != cudaSuccess) cudaGetLastError();
    }
  }
  void before(cudaStream_t stream) override {
    if (event_ == nullptr) create();
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    TPCOMM_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, &id));
    capturing_ = status != cudaStreamCaptureStatusNone;
    if (!capturing_) {
      // The stream of the previous eager launch orders this one by itself
      // (and lets a dependent launch start early); any other stream waits
      // for the event. (Not with external event nodes: a replay on another
      // stream may have recorded the event since. Not for the per-thread
      // default stream, one handle for every thread's own stream.)
      const bool sameStream = lastEagerValid_ && stream == lastEager_ && !captureEvents_ &&
                              stream != cudaStreamPerThread;
      if (!sameStream) TPCOMM_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, cudaEventWaitDefault));
      return;
    }
    lastEagerValid_ = false;  // a capture may be replayed anywhere before the next eager call
    // Across graph launches and eager calls on other streams: an external
    // wait node (when asked for).
    if (captureEvents_) {
      TPCOMM_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, cudaEventWaitExternal));
    }
    // Within this capture: after the capture's previous launch, whatever
    // branch of the graph it is on (on the same captured stream the stream's
    // own edge does it, and a programmatic edge stays programmatic).
    if (inCaptureValid_ && captureId_ == id && stream != inCaptureStream_) {
      TPCOMM_CUDA_CHECK(cudaStreamWaitEvent(stream, inCapture_, 0));
    }
    captureId_ = id;
  }
  void after(cudaStream_t stream) override {
    if (!capturing_) {
      TPCOMM_CUDA_CHECK(cudaEventRecord(event_, stream));
      lastEager_ = stream;
      lastEagerValid_ = true;
      return;
    }
    TPCOMM_CUDA_CHECK(cudaEventRecord(inCapture_, stream));
    inCaptureValid_ = true;
    inCaptureStream_ = stream;
    if (captureEvents_) {
      TPCOMM_CUDA_CHECK(cudaEventRecordWithFlags(event_, stream, cudaEventRecordExternal));
    } else {
      capturedWithoutEvents_ = true;
    }
  }
  void setCaptureEvents(bool events) override { captureEvents_ = events; }
  void synchronize() override {
    if (event_ != nullptr) TPCOMM_CUDA_CHECK(cudaEventSynchronize(event_));
    if (capturedWithoutEvents_) {
      // Replays of graphs captured without external nodes record nothing
      // this order can wait on, and may run on any stream: wait for the
      // whole device (in relaxed mode: another thread may be capturing).
      RelaxedCaptureMode relaxed;
      TPCOMM_CUDA_CHECK(cudaDeviceSynchronize());
    }
  }
  bool pending() override {
    cudaEvent_t event = queryable_.load(std::memory_order_acquire);
    if (event == nullptr) return false;
    // An event query is one of the calls a global-mode capture on another
    // thread forbids (and is invalidated by): this thread asks in relaxed mode.
    RelaxedCaptureMode relaxed;
    const cudaError_t state = cudaEventQuery(event);
    if (state == cudaSuccess) return false;
    cudaGetLastError();  // cudaErrorNotReady, or an error the next call reports
    return state == cudaErrorNotReady;
  }

 private:
  // Both events, and one record of `event_` on a private stream (complete at
  // once), so that a replay's external wait never meets a fresh event.
  void create() {
    // The first launch may be inside a capture (global mode): these calls
    // touch no capturing stream, and relaxed mode lets them through.
    RelaxedCaptureMode relaxed;
    TPCOMM_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    TPCOMM_CUDA_CHECK(cudaEventCreateWithFlags(&inCapture_, cudaEventDisableTiming));
    cudaStream_t quiet = nullptr;
    TPCOMM_CUDA_CHECK(cudaStreamCreateWithFlags(&quiet, cudaStreamNonBlocking));
    const cudaError_t recorded = cudaEventRecord(event_, quiet);
    cudaStreamDestroy(quiet);
    TPCOMM_CUDA_CHECK(recorded);
    queryable_.store(event_, std::memory_order_release);
  }

  cudaEvent_t event_ = nullptr;                  // the rank's last launch, eager or replayed
  std::atomic<cudaEvent_t> queryable_{nullptr};  // event_ once created (pending(), any thread)
  cudaEvent_t inCapture_ = nullptr;              // the last launch captured in the current capture
  unsigned long long captureId_ = 0;             // the capture inCapture_ was recorded in
  cudaStream_t inCaptureStream_ = nullptr;       // the stream inCapture_ was recorded on
  bool inCaptureValid_ = false;
  cudaStream_t lastEager_ = nullptr;  // the stream of the last eager launch
  bool lastEagerValid_ = false;       // no capture since it
  bool capturing_ = false;      // of the launch between before() and after()
  bool captureEvents_ = false;  // external event nodes in captures
  // A launch was captured without them: its replays are invisible to event_
  // (synchronize() then waits for the device; pending() does not see them).
  std::atomic<bool> capturedWithoutEvents_{false};
};

}  // namespace

std::unique_ptr<LaunchOrder> makeEventLaunchOrder() { return std::make_unique<EventLaunchOrder>(); }

const void* CustomAllreduce::stagingOf(int rank) const {
  TPCOMM_CHECK(rank >= 0 && rank < worldSize_, kInvalidUsage, "custom allreduce: rank ", rank,
               " is outside 0..", worldSize_ - 1);
  return static_cast<const char*>(buffers_[rank]) + layout_.stagingOffset;
}

uint32_t CustomAllreduce::errorCode() const {
  return *reinterpret_cast<volatile uint32_t*>(errorHost_);
}

void CustomAllreduce::checkError() const {
  const uint32_t code = errorCode();
  if (code == 0) return;
  TPCOMM_CHECK(!isAbort(code), kPeerLost, "custom allreduce on rank ", rank_, " of ", worldSize_,
               ": ", describeError(code));
  TPCOMM_THROW(kTimeout, "custom allreduce on rank ", rank_, " of ", worldSize_, ": ",
               describeError(code), " within ", timeoutMs_.load(), " ms");
}

void CustomAllreduce::clearError() { *reinterpret_cast<volatile uint32_t*>(errorHost_) = 0; }

namespace {

// A 4-byte copy into device memory (a peer's through its IPC mapping) on a
// private non-blocking stream: it runs beside the kernels that spin, and a
// pageable source is staged before cudaMemcpyAsync returns, so nothing here
// waits for the GPU. Errors are dropped (the abort is best effort).
void copyWord(uint32_t* word, uint32_t value) {
  RelaxedCaptureMode relaxed;  // another thread may be capturing
  cudaStream_t stream = nullptr;
  if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  const uint32_t source = value;
  if (cudaMemcpyAsync(word, &source, sizeof(source), cudaMemcpyHostToDevice, stream) !=
      cudaSuccess) {
    cudaGetLastError();
  }
  if (cudaStreamDestroy(stream) != cudaSuccess) cudaGetLastError();
}

}  // namespace

void CustomAllreduce::abort(const PoisonWriter& writePoison) {
  // This rank's waiting kernels read the error word while they spin.
  if (__atomic_load_n(errorHost_, __ATOMIC_ACQUIRE) == 0) {
    __atomic_store_n(errorHost_, abortCode(rank_), __ATOMIC_SEQ_CST);
  }
  const uint32_t poison = poisonCode(abortCode(rank_), rank_);
  for (int r = 0; r < worldSize_; ++r) {
    uint32_t* word = &reinterpret_cast<Signal*>(buffers_[r])->poison.value;
    try {
      if (writePoison) {
        writePoison(word, poison);
      } else {
        copyWord(word, poison);
      }
    } catch (...) {
      // Best effort: the other ranks' words are still written.
    }
  }
}

bool CustomAllreduce::launchesPending() {
  // Without launchMutex_: a launch that holds it may block while the GPU's
  // launch queue is full of kernels that wait.
  LaunchOrder* order = queryableOrder_.load(std::memory_order_acquire);
  return order != nullptr && order->pending();
}

void CustomAllreduce::reset(const ResetOps& ops) {
  TPCOMM_CHECK(ops.synchronize && ops.barrier && ops.zeroSignals, kInvalidUsage,
               "custom allreduce: a reset needs synchronize, barrier and zeroSignals");
  std::lock_guard<std::mutex> lock(resetMutex_);
  ops.synchronize();
  ops.barrier();
  ops.zeroSignals(buffers_[rank_]);
  clearError();
  ops.barrier();
}

void resetSignals(void* buffer, const BufferLayout& layout, cudaStream_t stream) {
  if (stream == nullptr) {
    zeroDeviceMemory(buffer, layout.signalBytes);  // a private stream: safe beside a capture
    return;
  }
  TPCOMM_CUDA_CHECK(cudaMemsetAsync(buffer, 0, layout.signalBytes, stream));
}

void zeroDeviceMemory(void* ptr, size_t bytes) {
  cudaStream_t stream = nullptr;
  TPCOMM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const cudaError_t set = cudaMemsetAsync(ptr, 0, bytes, stream);
  const cudaError_t done = set == cudaSuccess ? cudaStreamSynchronize(stream) : set;
  cudaStreamDestroy(stream);
  TPCOMM_CUDA_CHECK(done);
}

// --- buffers ----------------------------------------------------------------

RankBuffer::RankBuffer(size_t maxBytes) : layout_(BufferLayout::forMaxBytes(maxBytes)) {
  TPCOMM_CUDA_CHECK(cudaGetDevice(&device_));
  TPCOMM_CUDA_CHECK(cudaMalloc(&base_, layout_.totalBytes));
  try {
    zeroDeviceMemory(base_, layout_.signalBytes);
    void* host = nullptr;
    TPCOMM_CUDA_CHECK(cudaHostAlloc(&host, sizeof(uint32_t), cudaHostAllocMapped));
    errorHost_ = static_cast<uint32_t*>(host);
    *errorHost_ = 0;
    void* device = nullptr;
    TPCOMM_CUDA_CHECK(cudaHostGetDevicePointer(&device, host, 0));
    errorDevice_ = static_cast<uint32_t*>(device);
  } catch (...) {
    if (errorHost_ != nullptr) cudaFreeHost(errorHost_);
    cudaFree(base_);
    throw;
  }
}

RankBuffer::~RankBuffer() {
  // Never throws: a failure here (e.g. at process exit) is ignored.
  if (errorHost_ != nullptr) cudaFreeHost(errorHost_);
  if (base_ != nullptr) cudaFree(base_);
}

std::string RankBuffer::ipcHandle() const {
  cudaIpcMemHandle_t handle;
  TPCOMM_CUDA_CHECK(cudaIpcGetMemHandle(&handle, base_));
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

namespace {

// Every handle this process opened, and where.
std::mutex& ipcMutex() {
  static auto* mutex = new std::mutex();  // never destroyed: used at exit
  return *mutex;
}
std::map<std::string, void*>& ipcOpened() {
  static auto* opened = new std::map<std::string, void*>();  // never destroyed: used at exit
  return *opened;
}

}  // namespace

void* openIpcHandle(const std::string& bytes) {
  TPCOMM_CHECK_EQ(bytes.size(), sizeof(cudaIpcMemHandle_t), "(IPC handle size)");
  std::lock_guard<std::mutex> lock(ipcMutex());
  auto& opened = ipcOpened();
  auto it = opened.find(bytes);
  if (it != opened.end()) return it->second;
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, bytes.data(), sizeof(handle));
  void* ptr = nullptr;
  TPCOMM_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess));
  opened.emplace(bytes, ptr);
  return ptr;
}

void closeIpcHandle(void* ptr) {
  std::lock_guard<std::mutex> lock(ipcMutex());
  auto& opened = ipcOpened();
  for (auto it = opened.begin(); it != opened.end(); ++it) {
    if (it->second != ptr) continue;
    opened.erase(it);
    if (cudaIpcCloseMemHandle(ptr) != cudaSuccess) cudaGetLastError();  // e.g. at exit
    return;
  }
}

std::vector<uint32_t> readProbes(void* ownBuffer, int worldSize, cudaStream_t stream) {
  TPCOMM_CHECK(worldSize >= 1 && worldSize <= kMaxRanks, kInvalidUsage, "probe of ", worldSize,
               " ranks");
  auto* signal = static_cast<Signal*>(ownBuffer);
  std::vector<uint32_t> out(worldSize);
  for (int r = 0; r < worldSize; ++r) {
    TPCOMM_CUDA_CHECK(cudaMemcpyAsync(&out[r], &signal->probe[r].value, sizeof(uint32_t),
                                      cudaMemcpyDeviceToHost, stream));
  }
  TPCOMM_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

ExportedPointer exportPointer(const void* ptr) {
  using GetRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static GetRange getRange = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    TPCOMM_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000,
                                                       cudaEnableDefault, &status));
    TPCOMM_CHECK(fn != nullptr && status == cudaDriverEntryPointSuccess, kCuda,
                 "the CUDA driver has no cuMemGetAddressRange");
    return reinterpret_cast<GetRange>(fn);
  }();
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult r = getRange(&base, &size, reinterpret_cast<CUdeviceptr>(ptr));
  TPCOMM_CHECK(r == CUDA_SUCCESS, kCuda, "cuMemGetAddressRange failed (CUresult ",
               static_cast<int>(r), ") for a tensor at ", ptr);
  cudaIpcMemHandle_t handle;
  const cudaError_t e = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    TPCOMM_THROW(kCuda, "cudaIpcGetMemHandle: ", cudaGetErrorString(e),
                 " (memory from the expandable-segments allocator cannot be exported)");
  }
  ExportedPointer out;
  out.handle.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
  out.offset = static_cast<size_t>(reinterpret_cast<CUdeviceptr>(ptr) - base);
  return out;
}

}  // namespace tpcomm::car
