#include "backend/validation.hpp"

#include <cmath>
#include <numeric>

#include "common/error.hpp"
#include "coordinator/debug/debug_check.hpp"

namespace tpcomm::backend {

void checkTensors(const char* op, const char* what, const std::vector<at::Tensor>& tensors) {
  TPCOMM_CHECK(!tensors.empty(), kInvalidUsage, op, ": ", what, " is an empty list");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    TPCOMM_CHECK(t.defined(), kInvalidUsage, op, ": ", what, "[", i, "] is an undefined tensor");
    const auto device = t.device();
    TPCOMM_CHECK(device.is_cpu() || device.is_cuda(), kInvalidUsage, op, ": ", what, "[", i,
                 "] is on device ", device, "; tpcomm handles cpu and cuda tensors");
    TPCOMM_CHECK(t.layout() == at::kStrided, kInvalidUsage, op, ": ", what, "[", i,
                 "] is not a dense (strided) tensor; only dense tensors are supported");
    TPCOMM_CHECK(t.is_contiguous(), kInvalidUsage, op, ": ", what, "[", i,
                 "] is not contiguous (sizes ", t.sizes(), ", strides ", t.strides(),
                 "); pass tensor.contiguous()");
  }
}

void checkSparse(const char* op, const std::vector<at::Tensor>& tensors,
                 const c10d::ReduceOp& reduceOp) {
  TPCOMM_CHECK(tensors.size() == 1 && tensors[0].defined(), kInvalidUsage, op,
               ": expected exactly one defined tensor, got ", tensors.size());
  const auto& t = tensors[0];
  TPCOMM_CHECK(t.layout() == at::kSparse, kInvalidUsage, op, ": tensors[0] has layout ",
               c10::str(t.layout()), "; a sparse allreduce takes a sparse COO tensor");
  TPCOMM_CHECK(t.device().is_cpu() || t.device().is_cuda(), kInvalidUsage, op,
               ": tensors[0] is on device ", t.device(), "; tpcomm handles cpu and cuda tensors");
  TPCOMM_CHECK(reduceOp.op_ == c10d::ReduceOp::SUM, kInvalidUsage, op,
               ": sparse tensors are reduced by SUM only, got ReduceOp.",
               coord::describeReduceOp(reduceOp));
}

void checkSingle(const char* op, const char* what, const std::vector<at::Tensor>& tensors) {
  TPCOMM_CHECK(tensors.size() == 1, kInvalidUsage, op, ": expected exactly one tensor in ", what,
               ", got ", tensors.size());
  checkTensors(op, what, tensors);
}

void checkSameDevice(const char* op, const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    TPCOMM_CHECK(t.device() == tensors.front().device(), kInvalidUsage, op,
                 ": tensors of one call must be on one device, got ", tensors.front().device(),
                 " and ", t.device());
  }
}

void checkDtype(const char* op, const char* what, const std::vector<at::Tensor>& tensors,
                at::ScalarType dtype) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    TPCOMM_CHECK(tensors[i].scalar_type() == dtype, kInvalidUsage, op, ": ", what, "[", i,
                 "] has dtype ", coord::dtypeName(tensors[i].scalar_type()),
                 " but the call's dtype is ", coord::dtypeName(dtype));
  }
}

void checkReduceOp(const char* op, const c10d::ReduceOp& reduceOp, at::ScalarType dtype) {
  const std::string name = coord::describeReduceOp(reduceOp);
  const bool integral = at::isIntegralType(dtype, /*includeBool=*/true);
  const std::string dtypeStr = coord::dtypeName(dtype);
  switch (reduceOp.op_) {
    case c10d::ReduceOp::SUM:
    case c10d::ReduceOp::PRODUCT:
    case c10d::ReduceOp::MIN:
    case c10d::ReduceOp::MAX:
      return;
    case c10d::ReduceOp::AVG:
      TPCOMM_CHECK(dtype != at::kBool, kInvalidUsage, op, ": ReduceOp.AVG is not defined for ",
                   dtypeStr, " tensors");
      return;
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      TPCOMM_CHECK(integral, kInvalidUsage, op, ": ReduceOp.", name,
                   " needs an integer or bool tensor, got ", dtypeStr);
      return;
    case c10d::ReduceOp::PREMUL_SUM:
      TPCOMM_CHECK(at::isFloatingType(dtype), kInvalidUsage, op,
                   ": PREMUL_SUM needs a floating-point tensor, got ", dtypeStr);
      return;
    default:
      TPCOMM_THROW(kInvalidUsage, op, ": unsupported reduce op ", name);
  }
}

void checkRank(const char* op, const char* what, int64_t rank, int size) {
  TPCOMM_CHECK(rank >= 0 && rank < size, kInvalidUsage, op, ": ", what, " ", rank,
               " is out of range for a group of size ", size);
}

void checkRootTensor(const char* op, int64_t rootTensor, size_t tensors) {
  TPCOMM_CHECK(rootTensor >= 0 && static_cast<size_t>(rootTensor) < tensors, kInvalidUsage, op,
               ": rootTensor ", rootTensor, " is not an index into the call's tensor list (",
               tensors, tensors == 1 ? " tensor" : " tensors", ", so rootTensor must be ",
               tensors == 1 ? std::string("0") : "below " + std::to_string(tensors), ")");
}

void checkLength(const char* op, const char* what, size_t actual, size_t expected) {
  TPCOMM_CHECK(actual == expected, kInvalidUsage, op, ": ", what, " has ", actual,
               " entries, expected ", expected);
}

void checkNumel(const char* op, const char* what, int64_t actual, int64_t expected) {
  TPCOMM_CHECK(actual == expected, kInvalidUsage, op, ": ", what, " has ", actual,
               " elements, expected ", expected);
}

void checkSplits(const char* op, const char* what, const std::vector<int64_t>& splits,
                 const at::Tensor& tensor, int size) {
  TPCOMM_CHECK(tensor.dim() > 0, kInvalidUsage, op, ": ", what,
               " split dim 0, but the tensor has no dimensions (a 0-dim tensor)");
  const int64_t rows = tensor.size(0);
  if (splits.empty()) {
    TPCOMM_CHECK(rows % size == 0, kInvalidUsage, op, ": without ", what,
                 " dim 0 must divide evenly by the group size, got ", rows, " rows for ", size,
                 " ranks");
    return;
  }
  checkLength(op, what, splits.size(), static_cast<size_t>(size));
  for (size_t i = 0; i < splits.size(); ++i) {
    TPCOMM_CHECK(splits[i] >= 0, kInvalidUsage, op, ": ", what, "[", i, "] is negative (",
                 splits[i], ")");
  }
  const int64_t total = std::accumulate(splits.begin(), splits.end(), int64_t{0});
  TPCOMM_CHECK(total == rows, kInvalidUsage, op, ": ", what, " sum to ", total,
               " but the tensor has ", rows, " rows");
}

namespace {
bool shareBytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0) return false;
  const auto x = reinterpret_cast<uintptr_t>(a.data_ptr());
  const auto y = reinterpret_cast<uintptr_t>(b.data_ptr());
  return x < y + b.nbytes() && y < x + a.nbytes();
}
}  // namespace

void checkOverlap(const char* op, const char* outName, const at::Tensor& output, const char* inName,
                  const at::Tensor& input) {
  if (!shareBytes(output, input)) return;
  const bool same = output.data_ptr() == input.data_ptr() && output.nbytes() == input.nbytes();
  TPCOMM_CHECK(same, kInvalidUsage, op, ": ", outName, " (", output.nbytes(), " bytes at ",
               output.data_ptr(), ") partly overlaps ", inName, " (", input.nbytes(), " bytes at ",
               input.data_ptr(),
               "): it would be read after it was written; pass the same tensor (in place) or "
               "separate memory");
}

void checkSlotOverlap(const char* op, const char* partName, const at::Tensor& part,
                      const char* wholeName, const at::Tensor& whole) {
  if (!shareBytes(part, whole)) return;
  // Exactly one rank's part (this rank's: in place): each offset of it is
  // read before that offset of any part is written.
  const auto offset =
      static_cast<const char*>(part.data_ptr()) - static_cast<const char*>(whole.data_ptr());
  const auto each = static_cast<std::ptrdiff_t>(part.nbytes());
  TPCOMM_CHECK(offset >= 0 && offset % each == 0, kInvalidUsage, op, ": ", partName, " (",
               part.nbytes(), " bytes at ", part.data_ptr(), ") overlaps ", wholeName, " (at ",
               whole.data_ptr(),
               ") other than as exactly one rank's part; pass that part (in place) or separate "
               "memory");
}

void checkNoSharing(const char* op, const std::vector<at::Tensor>& outputs,
                    const std::vector<at::Tensor>& inputs) {
  for (size_t o = 0; o < outputs.size(); ++o) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (i == o) continue;  // each pair is checked by its own rule
      TPCOMM_CHECK(!shareBytes(outputs[o], inputs[i]), kInvalidUsage, op, ": output ", o,
                   " shares memory with input ", i,
                   " (the tensors of a coalesced call are done one after another, so it would "
                   "be written before it was read)");
    }
  }
}

void checkAddRmsNorm(const at::Tensor& input, const at::Tensor& residual, const at::Tensor& weight,
                     double eps, const at::Tensor& normed, const at::Tensor& residualOut) {
  constexpr const char* op = "all_reduce_add_rms_norm";
  checkTensors(op, "input, residual, weight, normed, residual_out",
               {input, residual, weight, normed, residualOut});
  checkSameDevice(op, {input, residual, weight, normed, residualOut});
  const at::ScalarType dtype = input.scalar_type();
  TPCOMM_CHECK(
      dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16,
      kInvalidUsage, op, ": input is ", coord::dtypeName(dtype),
      "; RMSNorm needs float32, float64, float16 or bfloat16");
  checkDtype(op, "residual, weight, normed and residual_out",
             {residual, weight, normed, residualOut}, dtype);
  TPCOMM_CHECK(input.dim() >= 1, kInvalidUsage, op, ": input is 0-dim; rows need a last dimension");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"residual", residual},
                                {"normed", normed},
                                {"residual_out", residualOut}}) {
    TPCOMM_CHECK(t.sizes() == input.sizes(), kInvalidUsage, op, ": ", name, " has shape ",
                 t.sizes(), ", the input ", input.sizes());
  }
  TPCOMM_CHECK(weight.dim() == 1 && weight.size(0) == input.size(-1), kInvalidUsage, op,
               ": weight has shape ", weight.sizes(), "; it must be [", input.size(-1),
               "] (the input's last dimension)");
  TPCOMM_CHECK(std::isfinite(eps) && eps >= 0, kInvalidUsage, op,
               ": eps must be finite and not negative, got ", eps);
  TPCOMM_CHECK(residualOut.data_ptr() == residual.data_ptr() || !shareBytes(residualOut, residual),
               kInvalidUsage, op, ": residual_out overlaps the residual without being it");
  TPCOMM_CHECK(!shareBytes(normed, residual) && !shareBytes(normed, residualOut) &&
                   !shareBytes(normed, weight) && !shareBytes(residualOut, weight),
               kInvalidUsage, op,
               ": normed shares memory with the residual or residual_out, or an output with the "
               "weight");
  TPCOMM_CHECK((normed.data_ptr() == input.data_ptr() || !shareBytes(normed, input)) &&
                   (residualOut.data_ptr() == input.data_ptr() || !shareBytes(residualOut, input)),
               kInvalidUsage, op, ": an output overlaps the input without being it");
}

}  // namespace tpcomm::backend
