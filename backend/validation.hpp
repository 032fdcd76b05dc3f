#pragma once
// Argument checks for every c10d entry point. Each throws
// tpcomm::Error(kInvalidUsage) with a message naming the call, the argument
// and what is wrong, before anything is sent. Internal to backend/.

#include <cstdint>
#include <vector>

#include <torch/csrc/distributed/c10d/Types.hpp>

namespace tpcomm::backend {

// Non-empty; every tensor defined, dense, contiguous, on a CPU or CUDA device.
void checkTensors(const char* op, const char* what, const std::vector<at::Tensor>& tensors);
// Exactly one defined sparse COO tensor on a CPU or CUDA device, reduced by
// SUM (what Gloo's and NCCL's sparse allreduce take).
void checkSparse(const char* op, const std::vector<at::Tensor>& tensors,
                 const c10d::ReduceOp& reduceOp);
// Exactly one tensor, and checkTensors.
void checkSingle(const char* op, const char* what, const std::vector<at::Tensor>& tensors);
// All tensors of one call on the same device.
void checkSameDevice(const char* op, const std::vector<at::Tensor>& tensors);
// Every tensor has `dtype`.
void checkDtype(const char* op, const char* what, const std::vector<at::Tensor>& tensors,
                at::ScalarType dtype);
// The reduction is defined for the dtype (bitwise ops need integers, ...).
void checkReduceOp(const char* op, const c10d::ReduceOp& reduceOp, at::ScalarType dtype);
// 0 <= rank < size.
void checkRank(const char* op, const char* what, int64_t rank, int size);
// BroadcastOptions/ReduceOptions.rootTensor indexes the call's tensor list.
void checkRootTensor(const char* op, int64_t rootTensor, size_t tensors);
void checkLength(const char* op, const char* what, size_t actual, size_t expected);
// InvalidUsage when `output` and `input` share some bytes without being the
// same bytes (an in-place call is fine).
void checkOverlap(const char* op, const char* outName, const at::Tensor& output, const char* inName,
                  const at::Tensor& input);
// InvalidUsage when `part` shares bytes with `whole` other than as exactly
// one rank's part of it (an all-gather's input, a reduce-scatter's output).
void checkSlotOverlap(const char* op, const char* partName, const at::Tensor& part,
                      const char* wholeName, const at::Tensor& whole);
// InvalidUsage when output o of a coalesced call shares bytes with an input
// i != o.
void checkNoSharing(const char* op, const std::vector<at::Tensor>& outputs,
                    const std::vector<at::Tensor>& inputs);
void checkNumel(const char* op, const char* what, int64_t actual, int64_t expected);
// Split sizes: empty (even split of dim 0 by size) or one per rank summing to dim 0.
void checkSplits(const char* op, const char* what, const std::vector<int64_t>& splits,
                 const at::Tensor& tensor, int size);

// all_reduce_add_rms_norm: input, residual, normed and residual_out of one
// shape (at least 1-D) and weight 1-D of the last dimension's size; all of
// one floating dtype (float32, float64, float16, bfloat16) and one device;
// eps finite and not negative; residual_out is residual or shares no byte
// with it, and normed shares no byte with residual, residual_out or weight.
void checkAddRmsNorm(const at::Tensor& input, const at::Tensor& residual, const at::Tensor& weight,
                     double eps, const at::Tensor& normed, const at::Tensor& residualOut);

}  // namespace tpcomm::backend
