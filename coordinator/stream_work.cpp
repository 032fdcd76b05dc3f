#include "coordinator/stream_work.hpp"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include <map>
#include <mutex>

#include "coordinator/cuda/cuda_util.hpp"

namespace tpcomm::coord {

namespace {

struct EventPool {
  std::mutex mutex;
  std::map<c10::DeviceIndex, std::vector<std::unique_ptr<at::cuda::CUDAEvent>>> free;
};

EventPool& eventPool() {
  static auto* pool = new EventPool();  // never destroyed: events may be returned at exit
  return *pool;
}

}  // namespace

std::shared_ptr<at::cuda::CUDAEvent> takePooledEvent(c10::DeviceIndex device) {
  EventPool& pool = eventPool();
  std::unique_ptr<at::cuda::CUDAEvent> event;
  {
    std::lock_guard<std::mutex> lock(pool.mutex);
    auto& free = pool.free[device];
    if (!free.empty()) {
      event = std::move(free.back());
      free.pop_back();
    }
  }
  if (!event) event = std::make_unique<at::cuda::CUDAEvent>(cudaEventDisableTiming);
  return std::shared_ptr<at::cuda::CUDAEvent>(event.release(), [device](at::cuda::CUDAEvent* e) {
    EventPool& pool = eventPool();
    std::lock_guard<std::mutex> lock(pool.mutex);
    pool.free[device].emplace_back(e);
  });
}

StreamWork::StreamWork(int rank, c10d::OpType type, c10::cuda::CUDAStream stream,
                       std::vector<at::Tensor> outputs, std::vector<at::Tensor> inputs,
                       std::function<void()> checkError)
    : c10d::Work(rank, type),
      stream_(stream),
      done_(takePooledEvent(stream.device_index())),
      outputs_(std::move(outputs)),
      inputs_(std::move(inputs)),
      checkError_(std::move(checkError)) {
  for (const auto* list : {&outputs_, &inputs_}) {
    for (const auto& t : *list) {
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
    }
  }
  done_->record(stream_);
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors(),
                                                     std::vector<c10::Device>{stream_.device()});
  // Marked under the call's stream: the future records its own event there,
  // so its consumers are ordered after the call on the GPU.
  c10::cuda::CUDAStreamGuard guard(stream_);
  future_->markCompleted(c10::IValue(outputs_));
}

bool StreamWork::isCompleted() { return done_->query(); }

bool StreamWork::isSuccess() const {
  if (!done_->query()) return false;
  try {
    if (checkError_) checkError_();
  } catch (...) {
    return false;
  }
  return true;
}

std::vector<at::Tensor> StreamWork::result() { return outputs_; }

bool StreamWork::wait(std::chrono::milliseconds /*timeout: the kernel bounds its own waits*/) {
  const auto current = c10::cuda::getCurrentCUDAStream(stream_.device_index());
  done_->block(current);
  // Under capture there is nothing to ask the GPU yet.
  if (!isCapturing(current.stream()) && checkError_ && done_->query()) checkError_();
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> StreamWork::getFuture() { return future_; }

}  // namespace tpcomm::coord
