#pragma once
// Public host-side header of the custom peer-to-peer allreduce (tpcomm::car).
// Declares host functions only; kernels stay in this folder's .cu/.cuh files.
//
// So far this component reports what its CUDA code was compiled for; the
// one-shot/two-shot kernels and their IPC buffers build on it.

#include <vector>

namespace tpcomm::car {

// CUDA runtime version the kernels were compiled against (e.g. 13000).
int compiledCudaVersion();

// The SM architectures with machine code in this build (e.g. {800, 900}).
std::vector<int> compiledArchitectures();

}  // namespace tpcomm::car
