// What this build's CUDA code targets. Compiled by nvcc in every build (CI
// included), so a CUDA toolchain problem shows at build time, not on a GPU.
#include <cuda_runtime_api.h>

#include "custom_allreduce/custom_allreduce.hpp"

namespace tpcomm::car {

int compiledCudaVersion() { return CUDART_VERSION; }

std::vector<int> compiledArchitectures() {
#ifdef __CUDA_ARCH_LIST__
  return {__CUDA_ARCH_LIST__};
#else
  return {};
#endif
}

}  // namespace tpcomm::car
