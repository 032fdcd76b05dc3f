#pragma once
// The one place where the kernels are instantiated (dtype x world size x
// algorithm) and where a launch's parameters become the kernel's arguments.
// Included by kernels.cu for the GPU and by the CPU emulation's launch
// (tests/cpp/custom_allreduce/test_kernel_emulation.cpp), so both run the same mapping.

#include "common/error.hpp"
#include "custom_allreduce/fused_kernels.cuh"
#include "custom_allreduce/kernels.cuh"
#include "custom_allreduce/launch.hpp"
#include "custom_allreduce/push_kernels.cuh"

namespace tpcomm::car {

using KernelFn = void (*)(KernelArgs);

// `fused`: the allreduce + residual add + RMSNorm kernels (fused_kernels.cuh).
template <typename T, int N>
KernelFn pickAlgorithm(Algorithm algorithm, bool fused) {
  switch (algorithm) {
    case Algorithm::kPush:
      return fused ? fusedPushKernel<T, N> : pushOneShotKernel<T, N>;
    case Algorithm::kOneShot:
      return fused ? fusedOneShotKernel<T, N> : oneShotKernel<T, N>;
    case Algorithm::kTwoShot:
      break;
  }
  return fused ? fusedTwoShotKernel<T, N> : twoShotKernel<T, N>;
}

template <typename T>
KernelFn pickWorldSize(Algorithm algorithm, int worldSize, bool fused) {
  switch (worldSize) {
    case 2:
      return pickAlgorithm<T, 2>(algorithm, fused);
    case 3:
      return pickAlgorithm<T, 3>(algorithm, fused);
    case 4:
      return pickAlgorithm<T, 4>(algorithm, fused);
    case 5:
      return pickAlgorithm<T, 5>(algorithm, fused);
    case 6:
      return pickAlgorithm<T, 6>(algorithm, fused);
    case 7:
      return pickAlgorithm<T, 7>(algorithm, fused);
    case 8:
      return pickAlgorithm<T, 8>(algorithm, fused);
  }
  TPCOMM_THROW(kInvalidUsage, "custom allreduce: world size ", worldSize, " is outside 2..",
               kMaxRanks);
}

inline KernelFn kernelFor(DType dtype, Algorithm algorithm, int worldSize, bool fused = false) {
  switch (dtype) {
    case DType::kFloat16:
      return pickWorldSize<__half>(algorithm, worldSize, fused);
    case DType::kBFloat16:
      return pickWorldSize<__nv_bfloat16>(algorithm, worldSize, fused);
    case DType::kFloat32:
      break;
  }
  return pickWorldSize<float>(algorithm, worldSize, fused);
}

inline KernelFn kernelFor(const LaunchParams& p) {
  return kernelFor(p.dtype, p.algorithm, p.worldSize, p.hidden > 0);
}

inline KernelArgs kernelArgsOf(const LaunchParams& p) {
  KernelArgs a{};
  a.input = p.input;
  a.output = p.output;
  a.count = p.count;
  for (int r = 0; r < p.worldSize; ++r) a.buffers[r] = static_cast<char*>(p.buffers[r]);
  a.registered = p.registered;
  a.stagingOffset = p.stagingOffset;
  a.stagingBytes = p.stagingBytes;
  a.resultOffset = p.resultOffset;
  a.pushOffset = p.pushOffset;
  a.pushSlotBytes = p.pushSlotBytes;
  a.pushDepth = kPushDepth;
  a.deviceScope = p.deviceScope ? 1 : 0;
  a.rank = p.rank;
  a.stage = p.stage ? 1 : 0;
  a.scale = p.scale;
  a.timeoutNs = p.timeoutNs;
  a.error = p.errorDevice;
  a.residual = p.residual;
  a.residualOut = p.residualOut;
  a.weight = p.weight;
  a.hidden = p.hidden;
  a.eps = p.eps;
  a.packed = p.packed ? 1 : 0;
  return a;
}

}  // namespace tpcomm::car
