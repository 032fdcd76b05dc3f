#pragma once
// Host declaration of the kernel launch (defined in kernels.cu).

#include <cstddef>
#include <cstdint>

#include "custom_allreduce/custom_allreduce.hpp"

namespace tpcomm::car {

struct LaunchParams {
  const void* input = nullptr;
  void* output = nullptr;
  size_t count = 0;
  DType dtype = DType::kFloat32;
  Algorithm algorithm = Algorithm::kOneShot;
  int blocks = 1;
  int rank = 0;
  int worldSize = 2;
  void* const* buffers = nullptr;  // worldSize entries
  const RegisteredInputs* registered = nullptr;
  bool stage = true;
  float scale = 1.f;
  size_t stagingOffset = 0;
  size_t stagingBytes = 0;
  size_t resultOffset = 0;
  size_t pushOffset = 0;
  size_t pushSlotBytes = 0;
  bool deviceScope = false;  // every rank on one GPU: flags at GPU scope
  uint64_t timeoutNs = 0;
  uint32_t* errorDevice = nullptr;
  // Fused residual add + RMSNorm (hidden > 0): `output` receives the normed
  // rows (see KernelArgs).
  size_t hidden = 0;
  const void* residual = nullptr;
  void* residualOut = nullptr;
  const void* weight = nullptr;
  float eps = 0.f;
  bool packed = false;
  // Programmatic dependent launch (the kernel may start while the previous
  // kernel on its stream ends; it waits for it on the GPU). Used only where
  // the kernel's code has the wait (compiled for sm_90+).
  bool pdl = false;
  // Every rank of the group on this GPU: all their blocks (two kernels' worth
  // of every rank with PDL) must be resident at once, so the launch caps
  // `blocks` to what the GPU holds of this kernel (the same on every rank).
  bool sharedGpu = false;
};

void launchAllreduce(const LaunchParams& params, cudaStream_t stream);

}  // namespace tpcomm::car
