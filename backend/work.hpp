#pragma once
// TpcommWork: the Work every tpcomm call returns.
//
// It wraps the routed backend's work and the coordinator's finish step
// (coord::Pending). Contract, as for c10d::Work:
//  - wait(): blocks until the call finished (bounded by the group's timeout,
//    which the routed backend enforces), runs the finish step, and returns
//    true; a failure is raised as DistBackendError naming the call and group,
//    a usage mistake found only once the call ran (TPCOMM_DEBUG's send/recv
//    check) as the RuntimeError an argument error gets.
//  - getFuture(): completes, with result() as its value, after the finish
//    step ran, or with the error wait() would raise; DDP's communication
//    hooks rely on it. Where the routed work has no future (Gloo's
//    point-to-point and reduce-scatter works), the first getFuture() starts
//    a thread that waits for it (bounded by the group's timeout) and
//    completes the future.
//  - isCompleted() never blocks. Thread-safe like the wrapped work.

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include <torch/csrc/distributed/c10d/Work.hpp>

#include "coordinator/pending.hpp"

namespace tpcomm::backend {

class TpcommWork : public c10d::Work {
 public:
  // `what` names the call in errors: "allreduce on group 'default' (rank 0 of 2)".
  TpcommWork(coord::Pending pending, c10d::OpType type, std::string what, int rank);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void abort() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override;

 private:
  // Shared with the future's callback, which may outlive this Work.
  struct FinishStep {
    std::once_flag once;
    std::function<void()> fn;
    void run() {
      std::call_once(once, [this] {
        if (fn) fn();
      });
    }
  };

  c10::intrusive_ptr<c10d::Work> inner_;
  std::shared_ptr<FinishStep> finish_;
  std::vector<at::Tensor> outputs_;
  std::string what_;
  bool innerHasFuture_;
  std::atomic<bool> finishedByWait_{false};
  std::mutex futureMutex_;
  // Completes after inner_ and the finish step. Made in the constructor where
  // inner_ has a future, else on the first getFuture().
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace tpcomm::backend
