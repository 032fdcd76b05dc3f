#pragma once
// What the C++ tests use of c10d that changed its name across the torch
// range tpcomm builds against.

#include <torch/version.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace tpcomm::test {

// A PREMUL_SUM op with `factor` (a double or a one-element tensor): torch
// 2.13 renamed c10d::makeNCCLPreMulSum to c10d::makePreMulSum.
template <typename T>
c10d::ReduceOp preMulSum(const T& factor) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
  return c10d::makePreMulSum(factor);
#else
  return c10d::makeNCCLPreMulSum(factor);
#endif
}

}  // namespace tpcomm::test
