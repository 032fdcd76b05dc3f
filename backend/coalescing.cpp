#include "backend/coalescing.hpp"

#include <algorithm>
#include <chrono>
#include <memory>

#include <ATen/core/ivalue.h>

#include "common/error.hpp"

namespace tpcomm::backend {

CoalescedWork::CoalescedWork(int rank, std::vector<WorkPtr> works)
    : c10d::Work(rank, c10d::OpType::COALESCED), works_(std::move(works)) {}

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
    if (!bounded) {
      w->wait();
      continue;
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    // A part's wait with no time left still raises its timeout (or returns
    // when the part has completed).
    w->wait(std::max(left, std::chrono::milliseconds(1)));
  }
  return true;
}

void CoalescedWork::abort() {
  for (const WorkPtr& w : works_) w->abort();
}

c10::intrusive_ptr<c10::ivalue::Future> CoalescedWork::getFuture() {
  std::lock_guard<std::mutex> lock(futureMutex_);
  if (future_) return future_;
  // The parts' futures, and the devices any of them carries (a device
  // call's future records CUDA events; the batch's must accept its tensors).
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> parts;
  std::vector<c10::Device> devices;
  for (const WorkPtr& w : works_) {
    parts.push_back(w->getFuture());
    for (const c10::Device& d : parts.back()->devices()) {
      if (std::find(devices.begin(), devices.end(), d) == devices.end()) devices.push_back(d);
    }
  }
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors(), devices);
  if (parts.empty()) {
    future_->markCompleted(c10::IValue(std::vector<at::Tensor>()));
    return future_;
  }
  // Completed once every part has, with their results in order; the first
  // failure fails it.
  auto left = std::make_shared<std::atomic<size_t>>(parts.size());
  c10::weak_intrusive_ptr<c10::ivalue::Future> weak(future_);
  std::vector<WorkPtr> works = works_;
  for (auto& part : parts) {
    part->addCallback([left, weak, works](c10::ivalue::Future& done) {
      auto batch = weak.lock();
      if (!batch) return;
      if (done.hasError()) {
        batch->setErrorIfNeeded(done.exception_ptr());
        return;
      }
      if (left->fetch_sub(1) != 1 || batch->completed()) return;
      std::vector<at::Tensor> results;
      for (const WorkPtr& w : works) {
        auto part = w->result();
        results.insert(results.end(), part.begin(), part.end());
      }
      batch->markCompleted(c10::IValue(std::move(results)));
    });
  }
  return future_;
}

void Coalescing::start(const std::string& group) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (open_.load(std::memory_order_relaxed)) {
    const size_t dropped = batch_.calls;
    batch_ = Batch();
    open_.store(false, std::memory_order_release);
    TPCOMM_THROW(kInvalidUsage, "startCoalescing on group ", group, " while its batch of ", dropped,
                 " call(s) is still open (a coalescing block that raised before its end, or one "
                 "inside another): that batch is dropped, each of its calls keeps its own Work; "
                 "start the batch again");
  }
  batch_ = Batch();
  open_.store(true, std::memory_order_release);
}

void Coalescing::add(const WorkPtr& work) {
  if (!open()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!open_.load(std::memory_order_relaxed)) return;
  ++batch_.calls;
  if (work) batch_.works.push_back(work);
}

Coalescing::Batch Coalescing::end(const std::string& group) {
  std::lock_guard<std::mutex> lock(mutex_);
  TPCOMM_CHECK(open_.load(std::memory_order_relaxed), kInvalidUsage, "endCoalescing on group ",
               group, " without startCoalescing");
  open_.store(false, std::memory_order_release);
  Batch out = std::move(batch_);
  batch_ = Batch();
  return out;
}

}  // namespace tpcomm::backend
