// The CUDA side of the custom-allreduce setup (CustomDevice over the
// current process's GPUs), and the capture-mode guard the setup runs under.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdio>
#include <memory>

#include "coordinator/cuda_util.hpp"
#include "coordinator/custom_setup.hpp"
#include "custom_allreduce/cuda_check.hpp"

namespace tpcomm::coord {

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

class CudaDevice : public CustomDevice {
 public:
  explicit CudaDevice(int device) : device_(device) {}
  // Unmaps the peers' buffers (set-up only; zero-copy mappings stay for the
  // graphs that use them), then frees this rank's.
  ~CudaDevice() override {
    for (void* peer : opened_) car::closeIpcHandle(peer);
  }

  std::string gpuUuid() override { return gpuUuidOf(device_); }

  std::string allocate(size_t maxBytes) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    // Setup work runs on a stream of its own: it may happen while another
    // stream of this device is being captured into a graph.
    stream_ = c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device_));
    buffer_ = std::make_unique<car::RankBuffer>(maxBytes);
    return buffer_->ipcHandle();
  }

  void* ownBase() override { return buffer_->base(); }

  bool canAccessPeer(const std::string& uuid) override {
    int count = 0;
    TPCOMM_CUDA_CHECK(cudaGetDeviceCount(&count));
    for (int d = 0; d < count; ++d) {
      if (gpuUuidOf(d) != uuid) continue;
      if (d == device_) return true;
      int ok = 0;
      TPCOMM_CUDA_CHECK(cudaDeviceCanAccessPeer(&ok, device_, d));
      return ok != 0;
    }
    return false;  // that GPU is not visible to this process
  }

  void* open(const std::string& handle) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    void* peer = car::openIpcHandle(handle);
    opened_.push_back(peer);
    return peer;
  }

  void writeProbe(void* peer, int fromRank, uint32_t value) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    car::writeProbe(peer, fromRank, value, stream_->stream());
  }

  std::vector<uint32_t> readProbes(int worldSize) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_));
    return car::readProbes(buffer_->base(), worldSize, stream_->stream());
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
                                        cudaMemcpyHostToDevice, stream_->stream()));
    }
    TPCOMM_CUDA_CHECK(cudaStreamSynchronize(stream_->stream()));
  }

 private:
  int device_;
  std::optional<c10::cuda::CUDAStream> stream_;
  std::unique_ptr<car::RankBuffer> buffer_;
  std::vector<void*> opened_;
};

}  // namespace

std::unique_ptr<CustomDevice> makeCudaDevice(int deviceIndex) {
  return std::make_unique<CudaDevice>(deviceIndex);
}

}  // namespace tpcomm::coord
