#include "threaded_backend.hpp"

#include <exception>
#include <thread>

namespace tpcomm::testing {

void Hub::arriveAndWait(std::unique_lock<std::mutex>& lock) {
  const uint64_t generation = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  cv_.wait(lock, [&] { return generation_ != generation; });
}

std::vector<at::Tensor> Hub::exchange(int rank, const at::Tensor& input) {
  std::unique_lock<std::mutex> lock(mutex_);
  slots_[rank] = input.clone();
  arriveAndWait(lock);
  std::vector<at::Tensor> all = slots_;
  arriveAndWait(lock);  // nobody overwrites a slot until all have read
  return all;
}

namespace {

class CompletedWork : public c10d::Work {
 public:
  CompletedWork(std::vector<at::Tensor> outputs, std::exception_ptr error)
      : future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))),
        error_(error) {
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs));
    }
  }
  bool isCompleted() override { return true; }
  bool wait(std::chrono::milliseconds) override {
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::exception_ptr error_;
};

}  // namespace

c10::intrusive_ptr<c10d::Work> doneWork(std::vector<at::Tensor> outputs) {
  return c10::make_intrusive<CompletedWork>(std::move(outputs), nullptr);
}

c10::intrusive_ptr<c10d::Work> failedWork(const std::string& message) {
  return c10::make_intrusive<CompletedWork>(std::vector<at::Tensor>{},
                                            std::make_exception_ptr(std::runtime_error(message)));
}

void runRanks(int size, const std::function<void(int rank)>& fn) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(size);
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

ThreadedBackend::ThreadedBackend(std::shared_ptr<Hub> hub, int rank)
    : c10d::Backend(rank, hub->size()), hub_(std::move(hub)) {}

at::Tensor ThreadedBackend::reduceAll(const std::vector<at::Tensor>& all,
                                      const c10d::ReduceOp& op) const {
  at::Tensor acc = all[0].clone();
  for (size_t r = 1; r < all.size(); ++r) {
    const auto& x = all[r];
    switch (op.op_) {
      case c10d::ReduceOp::SUM:
        acc.add_(x);
        break;
      case c10d::ReduceOp::PRODUCT:
        acc.mul_(x);
        break;
      case c10d::ReduceOp::MIN:
        acc = at::minimum(acc, x);
        break;
      case c10d::ReduceOp::MAX:
        acc = at::maximum(acc, x);
        break;
      case c10d::ReduceOp::BAND:
        acc.bitwise_and_(x);
        break;
      case c10d::ReduceOp::BOR:
        acc.bitwise_or_(x);
        break;
      case c10d::ReduceOp::BXOR:
        acc.bitwise_xor_(x);
        break;
      default:
        TORCH_CHECK(false, "ThreadedBackend: op not supported (like Gloo: no AVG/PREMUL_SUM)");
    }
  }
  return acc;
}

c10::intrusive_ptr<c10d::Work> ThreadedBackend::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  ++calls;
  tensors[0].copy_(reduceAll(hub_->exchange(rank_, tensors[0]), opts.reduceOp));
  return doneWork(tensors);
}

c10::intrusive_ptr<c10d::Work> ThreadedBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  ++calls;
  for (auto& t : tensors) t.copy_(reduceAll(hub_->exchange(rank_, t), opts.reduceOp));
  return doneWork(tensors);
}

c10::intrusive_ptr<c10d::Work> ThreadedBackend::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  ++calls;
  at::Tensor result = reduceAll(hub_->exchange(rank_, tensors[0]), opts.reduceOp);
  if (rank_ == opts.rootRank) tensors[0].copy_(result);
  return doneWork(tensors);
}

c10::intrusive_ptr<c10d::Work> ThreadedBackend::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  ++calls;
  tensors[0].copy_(hub_->exchange(rank_, tensors[0])[opts.rootRank]);
  return doneWork(tensors);
}

c10::intrusive_ptr<c10d::Work> ThreadedBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions&) {
  ++calls;
  auto all = hub_->exchange(rank_, inputs[0]);
  for (size_t r = 0; r < all.size(); ++r) outputs[0][r].copy_(all[r]);
  return doneWork(outputs[0]);
}

c10::intrusive_ptr<c10d::Work> ThreadedBackend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  ++calls;
  at::Tensor full = reduceAll(hub_->exchange(rank_, input), opts.reduceOp).reshape({-1});
  output.copy_(full.narrow(0, rank_ * output.numel(), output.numel()).view(output.sizes()));
  return doneWork({output});
}

c10::intrusive_ptr<c10d::Work> ThreadedBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                              std::vector<int64_t>& outputSplits,
                                                              std::vector<int64_t>& inputSplits,
                                                              const c10d::AllToAllOptions&) {
  ++calls;
  // Every rank also posts its split sizes so each can find its part.
  at::Tensor splits = at::tensor(inputSplits, at::kLong);
  auto allInputs = hub_->exchange(rank_, input);
  auto allSplits = hub_->exchange(rank_, splits);
  int64_t outOffset = 0;
  for (int src = 0; src < size_; ++src) {
    auto s = allSplits[src];
    int64_t start = s.narrow(0, 0, rank_).sum().item<int64_t>();
    int64_t n = s[rank_].item<int64_t>();
    TORCH_CHECK(n == outputSplits[src], "ThreadedBackend: split mismatch");
    output.narrow(0, outOffset, n).copy_(allInputs[src].narrow(0, start, n));
    outOffset += n;
  }
  return doneWork({output});
}

c10::intrusive_ptr<c10d::Work> ThreadedBackend::barrier(const c10d::BarrierOptions&) {
  ++calls;
  hub_->exchange(rank_, at::zeros({1}));
  return doneWork({});
}

}  // namespace tpcomm::testing
