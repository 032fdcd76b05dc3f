#pragma once
// Small CUDA helpers of the coordinator's CUDA path.

#include <cuda_runtime_api.h>

#include <string>

#include "custom_allreduce/custom_allreduce.hpp"

namespace tpcomm::coord {

// Relaxed capture mode for the set-up and the graph registration: the car
// layer's (custom_allreduce.hpp), which its launch order uses too.
using car::RelaxedCaptureMode;

// Whether `stream` is being captured into a graph.
bool isCapturing(cudaStream_t stream);

// GPU `device`'s UUID as 32 hex digits.
std::string gpuUuidOf(int device);

}  // namespace tpcomm::coord
