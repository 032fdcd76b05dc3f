#include "backend/work.hpp"

#include <thread>

#include <torch/csrc/distributed/c10d/exception.h>

#include "backend/flight_record.hpp"
#include "common/error.hpp"
#include "coordinator/cpu/framed_p2p.hpp"

namespace tpcomm::backend {

void raiseCallFailure(const CallIdentity& id, coord::GroupFault& fault, std::exception_ptr error) {
  std::string text;
  try {
    std::rethrow_exception(std::move(error));
  } catch (const Error& e) {
    // A usage mistake found once the call ran (TPCOMM_DEBUG's send/recv
    // check): the RuntimeError an argument error gets.
    TORCH_CHECK(e.code() != ErrorCode::kInvalidUsage, "tpcomm: ", id.what, " refused: ", e.what());
    text = e.what();
  } catch (const std::exception& e) {
    text = e.what();
  } catch (...) {
    text = "an unknown exception";
  }
  std::string message;
  fault.learnFromPeers();
  if (fault.broken()) {
    // The group broke first (an abort, a peer's failure or refusal): that
    // is the cause; the route's own words follow unless they only say so.
    message = "the group is unusable: " + fault.reason();
    if (text.find("released: ") == std::string::npos &&
        text.find(fault.reason()) == std::string::npos) {
      message += " (the call ended with: " + text + ")";
    }
  } else {
    if (id.breaksGroup) {
      fault.breakGroup(
          detail::concat("rank ", id.rank, "'s ", id.op, " #", id.seq, " failed: ", text));
    }
    message = text;
  }
  // Before the raise: the group is marked broken (its reason and the
  // flight recorder are in reach of the hooks).
  if (id.hooks) id.hooks->runAbort();
  C10_THROW_ERROR(DistBackendError, "tpcomm: " + id.what + " failed: " + message +
                                        fault.positions(id.op, id.seq) +
                                        FlightRecord::get().dumpAfterFailure());
}

namespace {

std::exception_ptr failureOf(const CallIdentity& id, coord::GroupFault& fault,
                             std::exception_ptr error) {
  try {
    raiseCallFailure(id, fault, std::move(error));
  } catch (...) {
    return std::current_exception();
  }
}

}  // namespace

struct TpcommWork::State : coord::Interruptible {
  CallIdentity id;
  std::shared_ptr<coord::GroupFault> fault;
  c10::intrusive_ptr<c10d::Work> inner;
  bool p2p = false;
  std::atomic<uint64_t> ticket{0};  // in fault's calls while in flight
  std::vector<at::Tensor> outputs;
  std::once_flag finishOnce;
  std::function<void()> finish;
  uint64_t completionKey = BackendHooks::nextCompletionKey();
  c10::intrusive_ptr<c10::ivalue::Future> future;  // where the routed work has one
  std::atomic<bool> settled{false};

  // Once the routed work succeeded: the finish step, then the completion
  // hooks (once per work; failed work runs neither).
  void runFinish() {
    std::call_once(finishOnce, [this] {
      if (finish) finish();
      if (id.hooks && id.hooks->wantsCompletion()) id.hooks->runCompletion(completionKey);
    });
  }
  void leave() {
    if (const uint64_t t = ticket.exchange(0)) fault->leave(t);
  }
  // The routed work's future completed: finish, then complete ours.
  void complete(c10::ivalue::Future& parent) {
    if (settled.exchange(true)) return;
    leave();
    try {
      parent.value();  // rethrows the routed backend's error
      runFinish();
    } catch (...) {
      future->setError(failureOf(id, *fault, std::current_exception()));
      return;
    }
    future->markCompleted(c10::IValue(outputs));
  }
  void interrupt(const std::string& why) override {
    if (!future) {
      // Without a future: a send/recv's blocked wait ends when it is
      // aborted, a reduce-scatter's when the connections close.
      if (!p2p) return;
      // Gloo's send/recv: its abort ends the blocked wait, which raises.
      try {
        inner->abort();
      } catch (...) {
      }
      return;
    }
    if (settled.exchange(true)) return;
    leave();
    future->setError(failureOf(
        id, *fault, std::make_exception_ptr(Error(ErrorCode::kPeerLost, "released: " + why))));
  }
  // A routed work without a future (Gloo's send/recv and reduce-scatter):
  // waits for it, registered in flight so that a broken group ends the wait
  // (a send/recv is aborted; every Gloo call fails once the group's Gloo
  // connections are shut down).
  bool waitWithoutFuture(const std::shared_ptr<State>& self, std::chrono::milliseconds timeout) {
    const uint64_t entry = fault->enter(id.seq, id.op, p2p, self);
    try {
      auto released = [&] {
        if (fault->broken()) TPCOMM_THROW(kPeerLost, "released: ", fault->reason());
      };
      // A work that completed already (a framed send/recv completes by
      // itself) stays completed whatever broke since.
      if (!(inner->isCompleted() && inner->isSuccess())) released();
      // A reduce-scatter's blocked wait ends when the group's Gloo
      // connections are shut down (Gloo's reduce-scatter work never reports
      // completion through isCompleted(), so it cannot be polled).
      const bool done = inner->wait(timeout);
      // An aborted Gloo send/recv returns false without raising.
      if (!done) released();
      fault->leave(entry);
      if (done) runFinish();
      return done;
    } catch (...) {
      fault->leave(entry);
      raiseCallFailure(id, *fault, std::current_exception());
    }
  }
};

TpcommWork::TpcommWork(coord::Pending pending, c10d::OpType type, CallIdentity id,
                       std::shared_ptr<coord::GroupFault> fault)
    : c10d::Work(id.rank, type),
      state_(std::make_shared<State>()),
      inner_(std::move(pending.work)),
      innerHasFuture_(pending.hasFuture) {
  TORCH_INTERNAL_ASSERT(inner_, std::string("tpcomm: ") + id.what + " produced no work");
  state_->id = std::move(id);
  state_->fault = std::move(fault);
  state_->inner = inner_;
  state_->p2p = type == c10d::OpType::SEND || type == c10d::OpType::RECV ||
                type == c10d::OpType::RECVANYSOURCE;
  state_->outputs = std::move(pending.outputs);
  state_->finish = std::move(pending.finish);
  if (!pending.hasFuture) {
    // A framed send/recv completes on its own, waited on or not: then its
    // finish runs (the flight recorder's entry retires). The work drops
    // the callback once it ran or failed, which ends the cycle.
    if (auto* framed = dynamic_cast<coord::FramedWork*>(inner_.get())) {
      framed->whenDone([state = state_] { state->runFinish(); });
    }
    return;
  }
  if (state_->id.device) {
    // The device routes' future carries the CUDA events that order the
    // caller's stream after the call: the child future of then() keeps
    // them. Not released by a broken group (its device backend is aborted).
    future_ = inner_->getFuture()->then(
        [state = state_](c10::ivalue::Future& parent) {
          try {
            parent.value();  // rethrows the routed backend's error
            state->runFinish();
          } catch (...) {
            std::rethrow_exception(failureOf(state->id, *state->fault, std::current_exception()));
          }
          return c10::IValue(state->outputs);
        },
        c10::ListType::ofTensors());
    return;
  }
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
  state_->future = future_;
  state_->ticket = state_->fault->enter(state_->id.seq, state_->id.op, false, state_);
  // Interrupted before the ticket was stored: leave now.
  if (state_->settled.load()) state_->leave();
  // The finish step runs on the thread that completes the routed work, so
  // that waiting on the future alone observes final results.
  inner_->getFuture()->addCallback(
      [state = state_](c10::ivalue::Future& parent) { state->complete(parent); });
  // A group that broke before the callback was in place: release now.
  if (state_->fault->broken()) state_->interrupt(state_->fault->reason());
}

TpcommWork::~TpcommWork() = default;

bool TpcommWork::isCompleted() {
  if (innerHasFuture_) return future_->completed();
  if (finishedByWait_.load()) return true;
  std::lock_guard<std::mutex> lock(futureMutex_);
  return (future_ && future_->completed()) || inner_->isCompleted();
}

bool TpcommWork::isSuccess() const {
  return innerHasFuture_ ? (future_->completed() && !future_->hasError()) : inner_->isSuccess();
}

std::exception_ptr TpcommWork::exception() const {
  if (innerHasFuture_ && future_->completed() && future_->hasError()) {
    return future_->exception_ptr();
  }
  return inner_->exception();
}

int TpcommWork::sourceRank() const { return inner_->sourceRank(); }

std::vector<at::Tensor> TpcommWork::result() { return state_->outputs; }

bool TpcommWork::wait(std::chrono::milliseconds timeout) {
  if (state_->id.device && innerHasFuture_) {
    // As the device backend waits (stream ordering, its own timeout).
    try {
      if (!inner_->wait(timeout)) return false;
    } catch (...) {
      raiseCallFailure(state_->id, *state_->fault, std::current_exception());
    }
    future_->wait();
    if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
    return true;
  }
  if (!innerHasFuture_) {
    if (!state_->waitWithoutFuture(state_, timeout)) return false;
    finishedByWait_ = true;
    return true;
  }
  if (timeout == kNoTimeout) {
    future_->wait();
  } else {
    // c10's future has no timed wait: poll it, as torch's Work does.
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    auto pause = std::chrono::microseconds(50);
    while (!future_->completed()) {
      if (std::chrono::steady_clock::now() >= deadline) {
        C10_THROW_ERROR(DistBackendError,
                        "tpcomm: " + state_->id.what + " did not finish within " +
                            std::to_string(timeout.count()) + " ms" +
                            state_->fault->positions(state_->id.op, state_->id.seq));
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(5000));
    }
  }
  // The future's error is raised as raiseCallFailure raised it.
  if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
  return true;
}

void TpcommWork::abort() { inner_->abort(); }

c10::intrusive_ptr<c10::ivalue::Future> TpcommWork::getFuture() {
  std::lock_guard<std::mutex> lock(futureMutex_);
  if (future_) return future_;
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
  // The routed work has no future: wait for it on a thread of its own. The
  // wait ends when the work does, when the routed backend's timeout fires
  // or when the group breaks.
  std::thread([state = state_, future = future_] {
    try {
      state->waitWithoutFuture(state, kNoTimeout);
      future->markCompleted(c10::IValue(state->outputs));
    } catch (...) {
      future->setError(std::current_exception());
    }
  }).detach();
  return future_;
}

uint64_t TpcommWork::getSequencenumber() const { return inner_->getSequencenumber(); }

#if defined(TPCOMM_COMPLETION_HOOKS)
uint64_t TpcommWork::getCompletionKey() const { return state_->completionKey; }
#endif

}  // namespace tpcomm::backend
