#include "backend/coalescing.hpp"

#include <algorithm>
#include <chrono>
#include <memory>

#include <ATen/core/ivalue.h>

#include "common/error.hpp"

namespace tpcomm::backend {

CoalescedWork::CoalescedWork(int rank, std::vector<WorkPtr> works, bool deviceParts)
    : c10d::Work(rank, c10d::OpType::COALESCED),
      works_(std::move(works)),
      deviceParts_(deviceParts) {}

bool CoalescedWork::isCompleted() {
  return std::all_of(works_.begin(), works_.end(),
                     [](const WorkPtr& w) { return w->isCompleted(); });
}

bool CoalescedWork::isSuccess() const {
  return std::all_of(works_.begin(), works_.end(),
                     [](const WorkPtr& w) { return w->exception() == nullptr; });
}

std::exception_ptr CoalescedWork::exception() const {
  for (const WorkPtr& w : works_) {
    if (auto e = w->exception()) return e;
  }
  return nullptr;
}

std::vector<at::Tensor> CoalescedWork::result() {
  std::vector<at::Tensor> out;
  for (const WorkPtr& w : works_) {
    auto part = w->result();
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

bool CoalescedWork::wait(std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const bool bounded = timeout != kNoTimeout;
  const auto deadline = Clock::now() + timeout;
  for (const WorkPtr& w : works_) {
    bool done;
    if (!bounded) {
      done = w->wait();
    } else {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      // A part's wait with no time left still raises its timeout (or returns
      // when the part has completed).
      done = w->wait(std::max(left, std::chrono::milliseconds(1)));
    }
    if (!done) return false;  // aborted, as that part's wait says
  }
  return true;
}

void CoalescedWork::abort() {
  for (const WorkPtr& w : works_) w->abort();
}

c10::intrusive_ptr<c10::ivalue::Future> CoalescedWork::getFuture() {
  TORCH_CHECK(!deviceParts_,
              "tpcomm: a coalesced batch with calls on the device backend (NCCL) has no future "
              "(the device backend's batch Work has none): wait() on it instead");
  std::lock_guard<std::mutex> lock(futureMutex_);
  if (future_) return future_;
  // CPU calls only: their results are CPU tensors, and a CPU future takes
  // them with no stream to order.
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> parts;
  for (const WorkPtr& w : works_) {
    parts.push_back(w->getFuture());
    TORCH_CHECK(parts.back(), "tpcomm: a call of the coalesced batch has no future");
  }
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
  if (parts.empty()) {
    future_->markCompleted(c10::IValue(std::vector<at::Tensor>()));
    return future_;
  }
  // Completed once every part has, with their results in order; the first
  // failure fails it. Each part's value is kept as it completes (no Work
  // kept: no cycle through the parts' callbacks).
  struct Gathered {
    std::mutex mutex;
    std::vector<std::vector<at::Tensor>> values;
    size_t left;
  };
  auto gathered = std::make_shared<Gathered>();
  gathered->values.resize(parts.size());
  gathered->left = parts.size();
  c10::weak_intrusive_ptr<c10::ivalue::Future> weak(future_);
  for (size_t i = 0; i < parts.size(); ++i) {
    parts[i]->addCallback([gathered, weak, i](c10::ivalue::Future& done) {
      auto batch = weak.lock();
      if (!batch) return;
      if (done.hasError()) {
        batch->setErrorIfNeeded(done.exception_ptr());
        return;
      }
      std::vector<at::Tensor> results;
      {
        std::lock_guard<std::mutex> lock(gathered->mutex);
        const c10::IValue& value = done.constValue();
        if (value.isTensorList()) gathered->values[i] = value.toTensorVector();
        if (--gathered->left != 0) return;
        for (auto& part : gathered->values) results.insert(results.end(), part.begin(), part.end());
      }
      if (!batch->completed()) batch->markCompleted(c10::IValue(std::move(results)));
    });
  }
  return future_;
}

size_t Coalescing::start() {
  std::lock_guard<std::mutex> lock(mutex_);
  const size_t dropped = open_.load(std::memory_order_relaxed) ? batch_.calls : 0;
  batch_ = Batch();
  open_.store(true, std::memory_order_release);
  return dropped;
}

void Coalescing::add(const WorkPtr& work) {
  if (!open()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!open_.load(std::memory_order_relaxed)) return;
  ++batch_.calls;
  if (!work) return;
  if (batch_.works.size() < kMaxKeptWorks) {
    batch_.works.push_back(work);
  } else {
    batch_.overflowed = true;
  }
}

Coalescing::Batch Coalescing::end(const std::string& group) {
  std::lock_guard<std::mutex> lock(mutex_);
  TPCOMM_CHECK(open_.load(std::memory_order_relaxed), kInvalidUsage, "endCoalescing on group ",
               group, " without startCoalescing");
  open_.store(false, std::memory_order_release);
  Batch out = std::move(batch_);
  batch_ = Batch();
  TPCOMM_CHECK(!out.overflowed, kInvalidUsage, "endCoalescing on group ", group, ": a batch of ",
               out.calls, " calls, more than the ", kMaxKeptWorks,
               " whose Works a batch keeps (each call ran; wait on their own Works)");
  return out;
}

}  // namespace tpcomm::backend
