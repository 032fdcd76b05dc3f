#pragma once
// Which dtypes the CPU backend (torch's ProcessGroupGloo) carries, and how
// the coordinator hands it the others. Internal to coordinator/.
//
// Gloo's kernels exist for float32, float64, float16, bfloat16, int8, uint8,
// bool, int32 and int64; any other dtype fails inside its worker thread as
// "Invalid scalar type", reported as a communication failure. So:
//   - calls that only move bytes (broadcast, all-gather, gather, scatter,
//     all-to-all, send/recv) pass other dtypes to Gloo as uint8 views of the
//     same memory: exact, and every dtype works;
//   - reductions of other dtypes are refused up front as invalid usage,
//     naming the dtypes that reduce (the shared-memory path reduces a subset).

#include <vector>

#include <ATen/ATen.h>

namespace tpcomm::coord {

// Whether Gloo has kernels for this dtype.
bool glooCarries(at::ScalarType dtype);

// `t` itself when Gloo carries its dtype, else a uint8 view of its bytes
// whose dim 0 is t's (row splits of all-to-all keep their meaning).
at::Tensor glooView(const at::Tensor& t);
std::vector<at::Tensor> glooViews(const std::vector<at::Tensor>& tensors);
std::vector<std::vector<at::Tensor>> glooViews(const std::vector<std::vector<at::Tensor>>& lists);

// Throws InvalidUsage when a CPU reduction (`op` names the call) cannot
// reduce `dtype`.
void checkCpuReduces(const char* op, at::ScalarType dtype);

}  // namespace tpcomm::coord
