#include "coordinator/cpu/gloo_dtypes.hpp"

#include "common/error.hpp"
#include "coordinator/debug/debug_check.hpp"

namespace tpcomm::coord {

bool glooCarries(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kChar:
    case at::kByte:
    case at::kBool:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

at::Tensor glooView(const at::Tensor& t) {
  if (glooCarries(t.scalar_type())) return t;
  // A trailing unit dimension keeps dim 0 (and 0-dim tensors) intact; the
  // caller's tensors are contiguous, so the byte view is too.
  return t.unsqueeze(-1).view(at::kByte);
}

std::vector<at::Tensor> glooViews(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(glooView(t));
  return out;
}

std::vector<std::vector<at::Tensor>> glooViews(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<std::vector<at::Tensor>> out;
  out.reserve(lists.size());
  for (const auto& list : lists) out.push_back(glooViews(list));
  return out;
}

void checkCpuReduces(const char* op, at::ScalarType dtype) {
  TPCOMM_CHECK(glooCarries(dtype), kInvalidUsage, op, ": CPU tensors of dtype ", dtypeName(dtype),
               " cannot be reduced; CPU reductions take float32, float64, float16, bfloat16, "
               "int8, uint8, bool, int32 and int64 (cast the tensor, or reduce it on CUDA)");
}

}  // namespace tpcomm::coord
