// GroupCoordinator: the allreduce fused with a transformer layer's residual
// add and RMSNorm, on whichever path an allreduce of its size would take.
#include <c10/cuda/CUDAStream.h>

#include "common/error.hpp"
#include "coordinator/faults/group_fault.hpp"
#include "coordinator/debug/debug_check.hpp"
#include "coordinator/group_coordinator.hpp"

namespace tpcomm::coord {

namespace {

// The two ATen operations after the reduced sum: the add, rounded to the
// dtype (the bits the fused paths give), then rms_norm with its statistics
// in float32 (float64 for float64), rounded once.
void addAndNorm(const at::Tensor& sum, const at::Tensor& residual, const at::Tensor& weight,
                double eps, at::Tensor& normed, at::Tensor& residualOut) {
  at::add_out(residualOut, sum, residual);
  const auto stats = residualOut.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  normed.copy_(at::rms_norm(residualOut.to(stats), {weight.numel()}, weight.to(stats), eps));
}

mq::NormRows normRows(const at::Tensor& residual, const at::Tensor& weight, double eps,
                      at::Tensor& normed, at::Tensor& residualOut) {
  mq::NormRows rows;
  rows.residual = residual.data_ptr();
  rows.residualOut = residualOut.data_ptr();
  rows.weight = weight.data_ptr();
  rows.normed = normed.data_ptr();
  rows.hidden = static_cast<size_t>(weight.numel());
  rows.eps = eps;
  return rows;
}

}  // namespace

std::string GroupCoordinator::allreduceAddRmsNorm(const at::Tensor& input,
                                                  const at::Tensor& residual,
                                                  const at::Tensor& weight, double eps,
                                                  at::Tensor& normed, at::Tensor& residualOut) {
  const auto turn = debugCheck([&] {
    return "all_reduce_add_rms_norm " + describeTensor(input) + " in rows of " +
           std::to_string(weight.numel());
  });
  const size_t hidden = static_cast<size_t>(weight.numel());
  const size_t rows = hidden == 0 ? 0 : static_cast<size_t>(input.numel()) / hidden;
  const Route route = routeFor(input);
  if (size() == 1) {
    if (route == Route::kCpu && rows > 0) {
      const void* source = input.data_ptr();
      mq::reduceAddRmsNorm(&source, 1, rows, *shmDtype(input.scalar_type()),
                           normRows(residual, weight, eps, normed, residualOut));
    } else if (rows > 0) {
      addAndNorm(input, residual, weight, eps, normed, residualOut);
    }
    return "local";
  }
  if (route == Route::kDevice) {
    std::shared_ptr<CustomPath> custom = ensureCustom(input.device());
    const RouteDecision d =
        routing_.decide(c10d::ReduceOp::SUM, input.scalar_type(), bytesOf(input), logRoutes_);
    if (logRoutes_) {
      logAllreduceRoute(c10d::ReduceOp::SUM, input,
                        deviceRouteName(d.route) + std::string(" (fused)"), d.reason);
    }
    if (d.route != DeviceRoute::kNccl) {
      const bool oneShot = d.route == DeviceRoute::kCustomOneShot;
      stats_.record(oneShot ? StatsRoute::kCustomOneShot : StatsRoute::kCustomTwoShot,
                    bytesOf(input));
      custom->allreduceAddRmsNorm(input, residual, weight, eps, normed, residualOut, d.route,
                                  c10::cuda::getCurrentCUDAStream(input.device().index()));
      return oneShot ? "custom_oneshot" : "custom_twoshot";
    }
  } else {
    const c10d::ReduceOp sum(c10d::ReduceOp::SUM);
    // Across hosts: composed (the hierarchical allreduce, then the norm).
    mq::ShmGroup* shm = shmFor("allreduce_add_rms_norm", input, &sum).shm;
    // Chunks hold whole rows: a row longer than a chunk is composed (the
    // same decision on every rank, as the hidden size is).
    if (shm != nullptr && hidden * input.element_size() <= shm->options().bufferBytes) {
      stats_.record(StatsRoute::kCpuShm, bytesOf(input));
      shm->allreduceAddRmsNorm(input.data_ptr(), rows, *shmDtype(input.scalar_type()),
                               normRows(residual, weight, eps, normed, residualOut));
      return "cpu_shm";
    }
  }
  at::Tensor reduced = input.clone();
  std::vector<at::Tensor> tensors{reduced};
  Pending pending = allreduceRouted(tensors, c10d::AllreduceOptions());
  if (pending.work) waitWork(*pending.work);
  if (pending.finish) pending.finish();
  if (rows > 0) addAndNorm(reduced, residual, weight, eps, normed, residualOut);
  return "composed";
}

}  // namespace tpcomm::coord
