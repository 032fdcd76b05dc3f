// The CUDA side of the custom-allreduce setup (CustomDevice over the
// current process's GPUs) and the capture check.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <dlfcn.h>

#include <cstdio>
#include <memory>

#include "coordinator/cuda/cuda_util.hpp"
#include "coordinator/cuda/custom_setup.hpp"
#include "custom_allreduce/cuda_check.hpp"

namespace tpcomm::coord {

bool isCapturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return status != cudaStreamCaptureStatusNone;
}

std::string gpuUuidOf(int device) {
  cudaDeviceProp prop;
  TPCOMM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::string out;
  char hex[3];
  for (unsigned char byte : prop.uuid.bytes) {
    std::snprintf(hex, sizeof(hex), "%02x", byte);
    out += hex;
  }
  return out;
}

namespace {

// NVLink between two GPUs, asked of the driver's management library (NVML,
// loaded at run time: it sees every GPU of the host whatever
// CUDA_VISIBLE_DEVICES says). 'n' NVLink, 'p' none, '?' when the library or
// either GPU cannot be found. The declarations are NVML's C ABI.
char nvlinkBetween(const std::string& uuidA, const std::string& uuidB) {
  using Init = int (*)();
  using ByUuid = int (*)(const char*, void**);
  using P2PStatus = int (*)(void*, void*, int, int*);
  struct Nvml {
    ByUuid byUuid = nullptr;
    P2PStatus p2pStatus = nullptr;
  };
  static const Nvml nvml = [] {
    Nvml n;
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return n;
    auto init = reinterpret_cast<Init>(dlsym(lib, "nvmlInit_v2"));
    if (init == nullptr || init() != 0) return n;  // NVML_SUCCESS is 0
    n.byUuid = reinterpret_cast<ByUuid>(dlsym(lib, "nvmlDeviceGetHandleByUUID"));
    n.p2pStatus = reinterpret_cast<P2PStatus>(dlsym(lib, "nvmlDeviceGetP2PStatus"));
    return n;
  }();
  if (nvml.byUuid == nullptr || nvml.p2pStatus == nullptr) return '?';
  // NVML names a GPU "GPU-" + its UUID as 8-4-4-4-12 hex digits.
  const auto nvmlName = [](const std::string& hex) {
    if (hex.size() != 32) return std::string();
    return "GPU-" + hex.substr(0, 8) + "-" + hex.substr(8, 4) + "-" + hex.substr(12, 4) + "-" +
           hex.substr(16, 4) + "-" + hex.substr(20);
  };
  void* a = nullptr;
  void* b = nullptr;
  if (nvml.byUuid(nvmlName(uuidA).c_str(), &a) != 0 ||
      nvml.byUuid(nvmlName(uuidB).c_str(), &b) != 0) {
    return '?';
  }
  constexpr int kCapsNvlink = 2;  // NVML_P2P_CAPS_INDEX_NVLINK
  int status = -1;
  if (nvml.p2pStatus(a, b, kCapsNvlink, &status) != 0) return '?';
  return status == 0 ? 'n' : 'p';  // NVML_P2P_STATUS_OK is 0
}

class CudaDevice : public CustomDevice {
 public:
  explicit CudaDevice(int device) : device_(device) {}
  // Unmaps the peers' buffers (set-up only; zero-copy mappings stay for the
  // graphs that use them), then frees this rank's. The CustomAllreduce that
  // launched on them is destroyed first and waits for its kernels (one in
  // flight would touch unmapped memory: a sticky illegal-address error).
  ~CudaDevice() override {
    for (void* peer : opened_) car::closeIpcHandle(peer);
    if (stream_ != nullptr && cudaStreamDestroy(stream_) != cudaSuccess) cudaGetLastError();
  }

  std::unique_ptr<car::LaunchOrder> makeLaunchOrder() override {
    return car::makeEventLaunchOrder();
  }

  void zeroSignals() override {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    car::zeroDeviceMemory(buffer_->base(), buffer_->layout().signalBytes);
  }

  std::string gpuUuid() override { return gpuUuidOf(device_); }

  std::string allocate(size_t maxBytes) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    // Set-up work runs on a private non-blocking stream: it may happen while
    // another stream of this device is being captured into a graph, and a
    // stream from PyTorch's pool could be the very one torch.cuda.graph
    // captures on.
    if (stream_ == nullptr) {
      TPCOMM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    }
    buffer_ = std::make_unique<car::RankBuffer>(maxBytes);
    return buffer_->ipcHandle();
  }

  void* ownBase() override { return buffer_->base(); }

  char peerAccess(const std::string& uuid) override {
    int count = 0;
    TPCOMM_CUDA_CHECK(cudaGetDeviceCount(&count));
    for (int d = 0; d < count; ++d) {
      if (gpuUuidOf(d) != uuid) continue;
      if (d == device_) return 'y';
      int ok = 0;
      TPCOMM_CUDA_CHECK(cudaDeviceCanAccessPeer(&ok, device_, d));
      return ok != 0 ? 'y' : 'x';
    }
    // Not visible to this process (e.g. one CUDA_VISIBLE_DEVICES GPU per
    // rank): IPC may still work; the write probe decides.
    return '?';
  }

  char linkTo(const std::string& uuid) override {
    const std::string own = gpuUuidOf(device_);
    if (uuid == own) return 'n';
    return nvlinkBetween(own, uuid);
  }

  void* open(const std::string& handle) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    void* peer = car::openIpcHandle(handle);
    opened_.push_back(peer);
    return peer;
  }

  void writeProbe(void* peer, int fromRank, uint32_t value) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    car::writeProbe(peer, fromRank, value, setUpStream());
  }

  std::vector<uint32_t> readProbes(int worldSize) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    return car::readProbes(buffer_->base(), worldSize, setUpStream());
  }

  uint32_t* errorHost() override { return buffer_->errorHost(); }
  uint32_t* errorDevice() override { return buffer_->errorDevice(); }

  car::RegisteredInputs* allocateTable(size_t slots) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    void* table = nullptr;
    TPCOMM_CUDA_CHECK(cudaMalloc(&table, slots * sizeof(car::RegisteredInputs)));
    try {
      car::zeroDeviceMemory(table, slots * sizeof(car::RegisteredInputs));  // off any capture
    } catch (...) {
      cudaFree(table);
      throw;
    }
    return static_cast<car::RegisteredInputs*>(table);
  }

  void freeTable(car::RegisteredInputs* table) override {
    if (cudaFree(table) != cudaSuccess) cudaGetLastError();  // never throws (destructors)
  }

  car::ExportedPointer exportPointer(const void* ptr) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    return car::exportPointer(ptr);
  }

  void* openRegistered(const std::string& handle) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    return car::openIpcHandle(handle);
  }

  void fillTable(car::RegisteredInputs* table, const std::vector<int64_t>& slots,
                 const std::vector<car::RegisteredInputs>& entries) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    for (size_t i = 0; i < slots.size(); ++i) {
      TPCOMM_CUDA_CHECK(cudaMemcpyAsync(table + slots[i], &entries[i], sizeof(entries[i]),
                                        cudaMemcpyHostToDevice, setUpStream()));
    }
    TPCOMM_CUDA_CHECK(cudaStreamSynchronize(setUpStream()));
  }

 private:
  // The private set-up stream; nothing can capture it, which is checked.
  cudaStream_t setUpStream() {
    TPCOMM_CHECK(stream_ != nullptr, kInvalidUsage, "custom allreduce: set-up before allocate()");
    TPCOMM_CHECK(!isCapturing(stream_), kCuda,
                 "custom allreduce: the private set-up stream is being captured");
    return stream_;
  }

  int device_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<car::RankBuffer> buffer_;
  std::vector<void*> opened_;
};

}  // namespace

std::unique_ptr<CustomDevice> makeCudaDevice(int deviceIndex) {
  return std::make_unique<CudaDevice>(deviceIndex);
}

}  // namespace tpcomm::coord
