#pragma once
// Small CUDA helpers of the coordinator's CUDA path.

#include <cuda_runtime_api.h>

#include <string>

namespace tpcomm::coord {

// While alive, this thread may make calls that CUDA refuses during a graph
// capture in the default (global) mode, such as cudaMalloc or a stream
// synchronisation of a stream that is not being captured. The custom
// allreduce sets up and registers graph buffers under it, so that both work
// when the first call on a group happens inside torch.cuda.graph.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode();
  ~RelaxedCaptureMode();
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_;
  bool restore_ = true;
};

// Whether `stream` is being captured into a graph.
bool isCapturing(cudaStream_t stream);

// GPU `device`'s UUID as 32 hex digits.
std::string gpuUuidOf(int device);

}  // namespace tpcomm::coord
