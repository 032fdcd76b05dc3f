#include "backend/work.hpp"

#include <thread>

#include <torch/csrc/distributed/c10d/exception.h>

#include "backend/flight_record.hpp"
#include "coordinator/common/error.hpp"

namespace tpcomm::backend {

namespace {

// Raises `error`, a failure of the call `what`, as the caller sees it: a
// usage mistake found once the call ran (TPCOMM_DEBUG's send/recv check) as
// the RuntimeError an argument error gets, anything else as DistBackendError
// naming the call.
[[noreturn]] void raiseFor(const std::string& what, std::exception_ptr error) {
  try {
    std::rethrow_exception(std::move(error));
  } catch (const Error& e) {
    TORCH_CHECK(e.code() != ErrorCode::kInvalidUsage, "tpcomm: ", what, " refused: ", e.what());
    C10_THROW_ERROR(DistBackendError, "tpcomm: " + what + " failed: " + e.what() +
                                          FlightRecord::get().dumpAfterFailure());
  } catch (const std::exception& e) {
    C10_THROW_ERROR(DistBackendError, "tpcomm: " + what + " failed: " + e.what() +
                                          FlightRecord::get().dumpAfterFailure());
  } catch (...) {
    C10_THROW_ERROR(DistBackendError, "tpcomm: " + what + " failed: an unknown exception");
  }
}

// Completes `future` with `error` raised as raiseFor raises it.
void failFuture(const c10::intrusive_ptr<c10::ivalue::Future>& future, const std::string& what,
                std::exception_ptr error) {
  try {
    raiseFor(what, std::move(error));
  } catch (...) {
    future->setError(std::current_exception());
  }
}

}  // namespace

TpcommWork::TpcommWork(coord::Pending pending, c10d::OpType type, std::string what, int rank)
    : c10d::Work(rank, type),
      inner_(std::move(pending.work)),
      finish_(std::make_shared<FinishStep>()),
      outputs_(std::move(pending.outputs)),
      what_(std::move(what)),
      innerHasFuture_(pending.hasFuture) {
  TORCH_INTERNAL_ASSERT(inner_, std::string("tpcomm: ") + what_ + " produced no work");
  finish_->fn = std::move(pending.finish);
  if (!pending.hasFuture) return;
  // The child future runs the finish step on the thread that completes the
  // routed work, so that waiting on the future alone observes final results.
  future_ = inner_->getFuture()->then(
      [finish = finish_, outputs = outputs_, what = what_](c10::ivalue::Future& parent) {
        try {
          parent.value();  // rethrows the routed backend's error
          finish->run();
        } catch (...) {
          raiseFor(what, std::current_exception());
        }
        return c10::IValue(outputs);
      },
      c10::ListType::ofTensors());
}

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

std::vector<at::Tensor> TpcommWork::result() { return outputs_; }

bool TpcommWork::wait(std::chrono::milliseconds timeout) {
  try {
    if (!inner_->wait(timeout)) return false;
  } catch (...) {
    raiseFor(what_, std::current_exception());
  }
  if (innerHasFuture_) {
    future_->wait();
    // The future's callback raised its error as raiseFor does.
    if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
  } else {
    try {
      finish_->run();
    } catch (...) {
      raiseFor(what_, std::current_exception());
    }
    finishedByWait_ = true;
  }
  return true;
}

void TpcommWork::abort() { inner_->abort(); }

c10::intrusive_ptr<c10::ivalue::Future> TpcommWork::getFuture() {
  std::lock_guard<std::mutex> lock(futureMutex_);
  if (future_) return future_;
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
  // The routed work has no future: wait for it on a thread of its own. The
  // wait ends when the work does or when the routed backend's timeout fires.
  std::thread([inner = inner_, finish = finish_, outputs = outputs_, future = future_,
               what = what_] {
    try {
      inner->wait();
      finish->run();
      future->markCompleted(c10::IValue(outputs));
    } catch (...) {
      failFuture(future, what, std::current_exception());
    }
  }).detach();
  return future_;
}

uint64_t TpcommWork::getSequencenumber() const { return inner_->getSequencenumber(); }

}  // namespace tpcomm::backend
