#pragma once
// TpcommWork: the Work every tpcomm call returns.
//
// It wraps the routed backend's work and the coordinator's finish step
// (coord::Pending). Contract, as for c10d::Work:
//  - wait(): blocks until the call finished (bounded by the group's timeout,
//    which the routed backend enforces) or the group broke
//    (coord::GroupFault: an abort, a peer's failure or refusal), runs the
//    finish step, and returns true; a failure is raised as DistBackendError
//    naming the call, the group and, where the peers said, where they are; a
//    usage mistake found only once the call ran (TPCOMM_DEBUG's send/recv
//    check) as the RuntimeError an argument error gets.
//  - getFuture(): completes, with result() as its value, after the finish
//    step ran, or with the error wait() would raise (also when the group
//    breaks first); DDP's communication hooks rely on it. Where the routed
//    work has no future (Gloo's point-to-point works), the first getFuture()
//    starts a thread that waits for it (bounded by the group's timeout) and
//    completes the future.
//  - isCompleted() never blocks. Thread-safe like the wrapped work.
//
// A released wait leaves the routed backend's work running (Gloo's worker
// may still be blocked in it; it keeps the call's tensors alive); the group
// is unusable from then on, so nothing pairs with it.

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include <torch/csrc/distributed/c10d/Work.hpp>

#include "backend/hooks.hpp"
#include "backend/torch_features.hpp"
#include "coordinator/faults/group_fault.hpp"
#include "coordinator/pending.hpp"

namespace tpcomm::backend {

// Who a call is, for errors and the group's fault state.
struct CallIdentity {
  std::string what;  // "allreduce on group 'default' (rank 0 of 2)"
  const char* op;    // "allreduce"
  uint64_t seq;      // its number in the group's collective or p2p sequence
  int rank;
  // A failure breaks the group (CPU routes; the device routes keep their
  // own recovery, GroupCoordinator::resetCustom).
  bool breaksGroup;
  // Routed to NCCL or the custom kernel: the work's future carries CUDA
  // events, and a broken group ends it by aborting the device backend.
  bool device = false;
  // The group's hooks (abort hooks before a failure is raised, completion
  // hooks once the work succeeded); null: none.
  std::shared_ptr<const BackendHooks> hooks;
};

// Raises `error`, a failure of the call `id`, as the caller sees it; a
// communication failure breaks the group (when id.breaksGroup), runs the
// group's abort hooks, and its message names the group's fault when that
// came first, the peers' positions and the flight recorder's dump.
[[noreturn]] void raiseCallFailure(const CallIdentity& id, coord::GroupFault& fault,
                                   std::exception_ptr error);

class TpcommWork : public c10d::Work {
 public:
  TpcommWork(coord::Pending pending, c10d::OpType type, CallIdentity id,
             std::shared_ptr<coord::GroupFault> fault);
  ~TpcommWork() override;

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void abort() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  uint64_t getSequencenumber() const override;
#if defined(TPCOMM_COMPLETION_HOOKS)
  // Never reused in this process: the completion hooks may run after this
  // Work is gone (on the routed backend's callback thread).
  uint64_t getCompletionKey() const override;
#endif

 private:
  // Shared with the routed work's callback and the group's fault state,
  // which may outlive this Work.
  struct State;

  std::shared_ptr<State> state_;
  c10::intrusive_ptr<c10d::Work> inner_;
  bool innerHasFuture_;
  std::atomic<bool> finishedByWait_{false};
  std::mutex futureMutex_;
  // Where inner_ has a future: completed by its callback or by the group's
  // break, whichever comes first. Else made on the first getFuture().
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace tpcomm::backend
