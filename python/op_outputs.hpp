#pragma once
// The body of torch.ops.tpcomm.all_reduce's CPU kernel on a tpcomm group
// (register_ops.cpp), shared with GroupCoordinator.all_reduce's direct call
// (fast_calls.cpp).
#include <ATen/core/Tensor.h>

#include "backend/process_group_tpcomm.hpp"

namespace tpcomm::python {

// The sum over the group of `tensor` in a new contiguous tensor (a large
// CPU one reuses a kept block of the same size: OutputCache in
// register_ops.cpp). Waits for a CPU call; a CUDA call is ordered on the
// current stream. The caller does not hold the GIL.
at::Tensor allReduceOutOfPlace(backend::ProcessGroupTpcomm& tpcomm, const at::Tensor& tensor);

}  // namespace tpcomm::python
