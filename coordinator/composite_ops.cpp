#include "coordinator/composite_ops.hpp"

#include "common/error.hpp"

namespace tpcomm::coord {

ReductionPlan planWithoutAvgOrPremul(const c10d::ReduceOp& op) {
  ReductionPlan plan;
  switch (op.op_) {
    case c10d::ReduceOp::AVG:
      plan.forwarded = c10d::ReduceOp::SUM;
      plan.divideBySize = true;
      return plan;
    case c10d::ReduceOp::PREMUL_SUM: {
      auto* supplement = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      TPCOMM_CHECK(supplement != nullptr, kInvalidUsage,
                   "PREMUL_SUM needs a factor: build the op with "
                   "torch.distributed._make_nccl_premul_sum(factor)");
      plan.forwarded = c10d::ReduceOp::SUM;
      if (supplement->tensor_factor.defined()) {
        plan.scaleTensor = supplement->tensor_factor;
      } else {
        plan.scale = supplement->double_factor;
      }
      return plan;
    }
    default:
      plan.forwarded = op;
      return plan;
  }
}

at::Tensor premultiplied(const ReductionPlan& plan, const at::Tensor& input) {
  if (plan.scaleTensor.defined()) {
    return (input * plan.scaleTensor.to(input.device()).reshape({})).to(input.scalar_type());
  }
  return (input * plan.scale.value()).to(input.scalar_type());
}

void premultiplyInPlace(const ReductionPlan& plan, at::Tensor& tensor) {
  if (plan.scaleTensor.defined()) {
    tensor.mul_(plan.scaleTensor.to(tensor.device()).reshape({}));
  } else {
    tensor.mul_(plan.scale.value());
  }
}

void divideInPlace(at::Tensor& tensor, int size) {
  if (at::isIntegralType(tensor.scalar_type(), /*includeBool=*/false)) {
    tensor.div_(size, "trunc");
  } else {
    tensor.div_(size);
  }
}

std::function<void()> divideAfter(bool divide, std::vector<at::Tensor> tensors, int size) {
  if (!divide) return {};
  return [tensors = std::move(tensors), size]() mutable {
    for (auto& t : tensors) divideInPlace(t, size);
  };
}

Pending alltoallThroughBase(c10d::Backend& backend, std::vector<at::Tensor>& outputs,
                            std::vector<at::Tensor>& inputs, const c10d::AllToAllOptions& opts) {
  std::vector<int64_t> inputSplits;
  std::vector<int64_t> outputSplits;
  std::vector<at::Tensor> flatInputs;
  int64_t outputNumel = 0;
  for (const auto& t : inputs) {
    inputSplits.push_back(t.numel());
    flatInputs.push_back(t.reshape({-1}));
  }
  for (const auto& t : outputs) {
    outputSplits.push_back(t.numel());
    outputNumel += t.numel();
  }
  at::Tensor flatInput = at::cat(flatInputs);
  at::Tensor flatOutput = at::empty({outputNumel}, outputs.at(0).options());
  Pending pending;
  pending.work = backend.alltoall_base(flatOutput, flatInput, outputSplits, inputSplits, opts);
  pending.outputs = outputs;
  pending.finish = [flatInput, flatOutput, outputs]() {
    int64_t offset = 0;
    for (const auto& out : outputs) {
      const int64_t n = out.numel();
      out.copy_(flatOutput.narrow(0, offset, n).view(out.sizes()));
      offset += n;
    }
  };
  return pending;
}

}  // namespace tpcomm::coord
