#include "coordinator/stream_work.hpp"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include "coordinator/cuda_util.hpp"

namespace tpcomm::coord {

StreamWork::StreamWork(int rank, c10d::OpType type, c10::cuda::CUDAStream stream,
                       std::vector<at::Tensor> outputs, std::vector<at::Tensor> inputs,
                       std::function<void()> checkError)
    : c10d::Work(rank, type),
      stream_(stream),
      done_(cudaEventDisableTiming),
      outputs_(std::move(outputs)),
      inputs_(std::move(inputs)),
      checkError_(std::move(checkError)) {
  for (const auto* list : {&outputs_, &inputs_}) {
    for (const auto& t : *list) {
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
    }
  }
  done_.record(stream_);
  future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors(),
                                                     std::vector<c10::Device>{stream_.device()});
  // Marked under the call's stream: the future records its own event there,
  // so its consumers are ordered after the call on the GPU.
  c10::cuda::CUDAStreamGuard guard(stream_);
  future_->markCompleted(c10::IValue(outputs_));
}

bool StreamWork::isCompleted() { return done_.query(); }

bool StreamWork::isSuccess() const {
  if (!const_cast<at::cuda::CUDAEvent&>(done_).query()) return false;
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
  done_.block(current);
  // Under capture there is nothing to ask the GPU yet.
  if (!isCapturing(current.stream()) && checkError_ && done_.query()) checkError_();
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> StreamWork::getFuture() { return future_; }

}  // namespace tpcomm::coord
