#pragma once
// StreamWork: the Work of a call the coordinator enqueued on a CUDA stream
// itself (the custom allreduce), with ProcessGroupNCCL's semantics:
//  - wait() makes the caller's current stream wait for the call (it does
//    not block the host) and raises if the call is known to have failed;
//  - isCompleted() asks the GPU without blocking;
//  - getFuture() is a CUDA-aware future, completed at once with the
//    outputs; whoever waits on it or chains to it is ordered after the call
//    on the GPU (what DDP's communication hooks expect);
//  - the tensors are kept alive by this Work and recorded on the stream, so
//    the caching allocator does not reuse their memory before the call ends.

#include <functional>
#include <memory>
#include <vector>

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace tpcomm::coord {

// CUDA events reused across calls (per device): the async path records one
// per call, and creating an event costs more than the launch it marks. An
// event goes back to the pool when the last holder drops it.
std::shared_ptr<at::cuda::CUDAEvent> takePooledEvent(c10::DeviceIndex device);

class StreamWork : public c10d::Work {
 public:
  // Records the completion event on `stream` now: call it right after the
  // enqueue. `checkError` throws if the call failed on the GPU (it reads a
  // host-mapped error word; it runs only once the event has completed).
  // `inputs` are only kept alive (and recorded on the stream) with the outputs.
  StreamWork(int rank, c10d::OpType type, c10::cuda::CUDAStream stream,
             std::vector<at::Tensor> outputs, std::vector<at::Tensor> inputs,
             std::function<void()> checkError);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  c10::cuda::CUDAStream stream_;
  std::shared_ptr<at::cuda::CUDAEvent> done_;  // pooled
  std::vector<at::Tensor> outputs_;
  std::vector<at::Tensor> inputs_;
  std::function<void()> checkError_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace tpcomm::coord
