#pragma once
// A c10d::Backend whose ranks are threads of one process: the stand-in for
// Gloo/NCCL in coordinator and backend unit tests. Each collective posts every
// rank's input to a shared hub, waits for all ranks, and computes each rank's
// result from all inputs in rank order, in float64 where it reduces floats.
// Work is returned already completed. Also counts calls, for routing tests.

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace tpcomm::testing {

class Hub {
 public:
  explicit Hub(int size) : size_(size), slots_(size) {}
  int size() const { return size_; }
  // Posts `input` for `rank`, waits for all ranks, returns every rank's input.
  std::vector<at::Tensor> exchange(int rank, const at::Tensor& input);

 private:
  void arriveAndWait(std::unique_lock<std::mutex>& lock);
  int size_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::vector<at::Tensor> slots_;
};

class ThreadedBackend : public c10d::Backend {
 public:
  ThreadedBackend(std::shared_ptr<Hub> hub, int rank);
  const std::string getBackendName() const override { return "threaded"; }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  std::atomic<int> calls{0};

 private:
  at::Tensor reduceAll(const std::vector<at::Tensor>& all, const c10d::ReduceOp& op) const;
  std::shared_ptr<Hub> hub_;
};

// A completed Work whose future holds `outputs`.
c10::intrusive_ptr<c10d::Work> doneWork(std::vector<at::Tensor> outputs);

// A Work that fails with `message` when waited on (and through its future).
c10::intrusive_ptr<c10d::Work> failedWork(const std::string& message);

// Runs fn(rank) on `size` threads and rethrows the first exception.
void runRanks(int size, const std::function<void(int rank)>& fn);

}  // namespace tpcomm::testing
