#pragma once
// The GroupCoordinator ops' output allocation (register_ops.cpp), shared with
// the direct calls of fast_calls.cpp.
#include <ATen/core/Tensor.h>

namespace tpcomm::python {

// A new contiguous tensor shaped and typed as `t`; a large one reuses a kept
// block of the same size (see OutputCache in register_ops.cpp).
at::Tensor emptyOpOutput(const at::Tensor& t);

}  // namespace tpcomm::python
