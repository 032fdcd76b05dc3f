#pragma once
// Coalescing (c10d::Backend::startCoalescing/endCoalescing, what
// `dist.batch_isend_irecv` and `_coalescing_manager(group, device)` call):
// the calls a group receives between the two are one batch, and
// endCoalescing returns one Work for all of them.
//
// Each call is issued when it is made, as outside a batch: tpcomm's
// point-to-point calls never block when issued (Gloo's are asynchronous,
// framed_p2p.hpp), so no order of sends and receives that Gloo or NCCL
// accept can deadlock, and a collective runs on its usual route. Calls on
// the device backend (NCCL) go into that backend's own batch
// (GroupCoordinator::startCoalescing), which NCCL needs: its sends and
// receives issued one by one can wait on each other.
//
// The batch's Work completes when every call of it has; its wait() raises
// the first failure it meets (waiting on the calls in order: a failure on a
// CPU route breaks the group, which ends the other calls' waits too) and
// returns false when a call's wait does (aborted); its future's value is
// every call's result in order. A batch with a device backend's part has no
// future (NCCL's batch Work has none): getFuture() says so; wait() instead.
//
// A batch left open (its block raised before endCoalescing: torch's
// context manager ends nothing then) is dropped by the next
// startCoalescing, with a warning, and that batch runs, so torch's abort
// (which wraps its aborts in a batch) still works. While it stays open it
// keeps at most kMaxKeptWorks Works; a batch of more calls than that raises
// at its end, naming the count.

#include <atomic>
#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Work.hpp>

namespace tpcomm::backend {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// The Work of a batch: every call's Work (those that returned one).
class CoalescedWork : public c10d::Work {
 public:
  // `deviceParts`: works from a device backend's batch (no future).
  CoalescedWork(int rank, std::vector<WorkPtr> works, bool deviceParts);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  // Waits for each call in turn, within `timeout` for all of them together.
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  void abort() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  std::vector<WorkPtr> works_;
  bool deviceParts_;
  std::mutex futureMutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A group's open batch, if any. Thread-safe; add() is one atomic load when
// no batch is open.
class Coalescing {
 public:
  // The Works an open batch keeps, at most.
  static constexpr size_t kMaxKeptWorks = size_t{1} << 16;
  // Opens a batch. One already open is dropped (its calls stay in flight,
  // each with its own Work); returns how many calls it had (0: none open).
  size_t start();
  // Counts a call made while a batch is open, and keeps its Work (null:
  // the call completed without one).
  void add(const WorkPtr& work);
  struct Batch {
    std::vector<WorkPtr> works;
    size_t calls = 0;
    bool overflowed = false;  // more than kMaxKeptWorks Works: not all kept
  };
  // Closes the batch; InvalidUsage naming `group` when none is open or when
  // it overflowed.
  Batch end(const std::string& group);
  bool open() const { return open_.load(std::memory_order_acquire); }

 private:
  mutable std::mutex mutex_;
  std::atomic<bool> open_{false};
  Batch batch_;
};

}  // namespace tpcomm::backend
