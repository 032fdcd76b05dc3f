#pragma once
// tpcomm::mq::WorkerPool — a few threads that split one large copy or
// reduction of the shared-memory collectives (shm_group.hpp) with the
// calling thread, so that a large message is not capped at one core's
// bandwidth. Internal to message_queue/; plain C++.
//
// run(parts, fn) calls fn(0) .. fn(parts - 1), each exactly once, part 0 on
// the caller and the others on the pool's threads, and returns when all
// returned; the first exception a part threw is rethrown in the caller.
// Parts never wait for anything outside the pool, so run() ends. One run()
// at a time (the group's lock serialises them). Idle threads sleep on a
// condition variable; the destructor wakes and joins them. Worker i is
// named "tpcomm-shm:<i>" (top -H, perf). With a polling window (workers on
// CPUs of their own), a worker that ran out of parts polls that long for the
// next task before it sleeps, and run()'s caller polls for the last parts
// before it sleeps: a large call's chunks then pay no wake-up each.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tpcomm::mq {

class WorkerPool {
 public:
  // `threads` counts the caller: threads - 1 are started (none for 1).
  // With `cpus` (threads - 1 of them), worker i runs pinned to cpus[i - 1];
  // a CPU the kernel refuses leaves that worker where it was.
  // `spin`: the polling window (0: sleep at once).
  explicit WorkerPool(int threads, const std::vector<int>& cpus = {},
                      std::chrono::microseconds spin = std::chrono::microseconds(0));
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  // The workers pinned as asked.
  int pinned() const { return pinned_; }
  void run(size_t parts, const std::function<void(size_t)>& fn);
  // Parts of every run() of more than one part so far (tests: how a
  // caller split its work).
  uint64_t partsSplit() const { return partsSplit_.load(std::memory_order_relaxed); }

 private:
  void loop(size_t index);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;                       // a new task, or stop
  std::condition_variable done_;                       // a part finished
  const std::function<void(size_t)>* task_ = nullptr;  // guarded by mutex_
  size_t parts_ = 0;                                   // guarded by mutex_
  size_t next_ = 0;                                    // the next part to take; guarded by mutex_
  size_t finished_ = 0;                                // parts done; guarded by mutex_
  uint64_t generation_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  int pinned_ = 0;
  const std::chrono::microseconds spin_;
  std::atomic<uint64_t> posted_{0};      // generation_, for polling workers
  std::atomic<size_t> finishedSeen_{0};  // finished_, for the polling caller
  std::atomic<uint64_t> partsSplit_{0};
};

}  // namespace tpcomm::mq
