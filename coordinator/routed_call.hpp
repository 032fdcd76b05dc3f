#pragma once
// Helpers the GroupCoordinator's call files share to hand a call to its
// routed backend. Internal to coordinator/.

#include <utility>
#include <vector>

#include "coordinator/cpu/gloo_dtypes.hpp"
#include "coordinator/group_coordinator.hpp"
#include "coordinator/pending.hpp"

namespace tpcomm::coord {

inline Pending passThrough(c10::intrusive_ptr<c10d::Work> work, std::vector<at::Tensor> outputs) {
  Pending pending;
  pending.work = std::move(work);
  pending.outputs = std::move(outputs);
  return pending;
}

// Gloo's point-to-point and reduce-scatter works have no future.
inline Pending withoutFutureOnCpu(Route route, Pending pending) {
  pending.hasFuture = route != Route::kCpu;
  return pending;
}

// What a call hands its routed backend: Gloo gets byte views of the dtypes
// it has no kernels for (gloo_dtypes.hpp); other backends the tensors as
// they are.
inline at::Tensor carried(Route route, const at::Tensor& t) {
  return route == Route::kCpu ? glooView(t) : t;
}
template <typename List>
List carried(Route route, const List& tensors) {
  return route == Route::kCpu ? glooViews(tensors) : tensors;
}

}  // namespace tpcomm::coord
