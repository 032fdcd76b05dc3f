#pragma once
// The one place where the kernels are instantiated (dtype x world size x
// algorithm) and where a launch's parameters become the kernel's arguments.
// Included by kernels.cu for the GPU and by the CPU emulation's launch
// (tests/cpp/test_kernel_emulation.cpp), so both run the same mapping.

#include "coordinator/common/error.hpp"
#include "custom_allreduce/kernels.cuh"
#include "custom_allreduce/launch.hpp"

namespace tpcomm::car {

using KernelFn = void (*)(KernelArgs);

template <typename T, int N>
KernelFn pickAlgorithm(Algorithm algorithm) {
  return algorithm == Algorithm::kOneShot ? oneShotKernel<T, N> : twoShotKernel<T, N>;
}

template <typename T>
KernelFn pickWorldSize(Algorithm algorithm, int worldSize) {
  switch (worldSize) {
    case 2:
      return pickAlgorithm<T, 2>(algorithm);
    case 3:
      return pickAlgorithm<T, 3>(algorithm);
    case 4:
      return pickAlgorithm<T, 4>(algorithm);
    case 5:
      return pickAlgorithm<T, 5>(algorithm);
    case 6:
      return pickAlgorithm<T, 6>(algorithm);
    case 7:
      return pickAlgorithm<T, 7>(algorithm);
    case 8:
      return pickAlgorithm<T, 8>(algorithm);
  }
  TPCOMM_THROW(kInvalidUsage, "custom allreduce: world size ", worldSize, " is outside 2..",
               kMaxRanks);
}

inline KernelFn kernelFor(DType dtype, Algorithm algorithm, int worldSize) {
  switch (dtype) {
    case DType::kFloat16:
      return pickWorldSize<__half>(algorithm, worldSize);
    case DType::kBFloat16:
      return pickWorldSize<__nv_bfloat16>(algorithm, worldSize);
    case DType::kFloat32:
      break;
  }
  return pickWorldSize<float>(algorithm, worldSize);
}

inline KernelArgs kernelArgsOf(const LaunchParams& p) {
  KernelArgs a{};
  a.input = p.input;
  a.output = p.output;
  a.count = p.count;
  for (int r = 0; r < p.worldSize; ++r) a.buffers[r] = static_cast<char*>(p.buffers[r]);
  a.registered = p.registered;
  a.stagingOffset = p.stagingOffset;
  a.resultOffset = p.resultOffset;
  a.rank = p.rank;
  a.stage = p.stage ? 1 : 0;
  a.scale = p.scale;
  a.timeoutNs = p.timeoutNs;
  a.error = p.errorDevice;
  return a;
}

}  // namespace tpcomm::car
