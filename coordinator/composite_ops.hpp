#pragma once
// Operations the CPU backend (Gloo) lacks, composed from ones it has.
// Internal to coordinator/.
//
//   AVG          -> SUM, then divide by the group size (integers: truncating
//                   division, as NCCL's ncclAvg does)
//   PREMUL_SUM   -> multiply each rank's input by the factor, then SUM
//   alltoall     -> one alltoall_base over flattened, concatenated tensors

#include <functional>
#include <optional>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "coordinator/pending.hpp"

namespace tpcomm::coord {

struct ReductionPlan {
  c10d::ReduceOp forwarded = c10d::ReduceOp::SUM;  // what the backend is asked to do
  bool divideBySize = false;                       // AVG
  std::optional<double> scale;                     // PREMUL_SUM with a scalar factor
  at::Tensor scaleTensor;                          // PREMUL_SUM with a one-element tensor

  bool premultiplies() const { return scale.has_value() || scaleTensor.defined(); }
  bool composed() const { return divideBySize || premultiplies(); }
};

// The plan for running `op` on a backend without AVG and PREMUL_SUM.
ReductionPlan planWithoutAvgOrPremul(const c10d::ReduceOp& op);

// Input scaled by the plan's factor, as a new tensor.
at::Tensor premultiplied(const ReductionPlan& plan, const at::Tensor& input);
void premultiplyInPlace(const ReductionPlan& plan, at::Tensor& tensor);

// Divides by the group size in place; truncating for integer dtypes.
void divideInPlace(at::Tensor& tensor, int size);

// A finish step that divides every tensor by `size` (empty if !divide).
std::function<void()> divideAfter(bool divide, std::vector<at::Tensor> tensors, int size);

// alltoall with a list of tensors per rank on a backend that has only
// alltoall_base: tensors may differ in size but share one dtype.
Pending alltoallThroughBase(c10d::Backend& backend, std::vector<at::Tensor>& outputs,
                            std::vector<at::Tensor>& inputs, const c10d::AllToAllOptions& opts);

}  // namespace tpcomm::coord
