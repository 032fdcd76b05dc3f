#include "message_queue/collectives/worker_pool.hpp"

#include <pthread.h>
#include <sched.h>

#include <cstdio>

namespace tpcomm::mq {

WorkerPool::WorkerPool(int threads, const std::vector<int>& cpus) {
  for (int i = 1; i < threads; ++i) {
    workers_.emplace_back([this, i] { loop(i); });
    if (static_cast<size_t>(i - 1) >= cpus.size()) continue;
    const int cpu = cpus[i - 1];
    if (cpu < 0 || cpu >= CPU_SETSIZE) continue;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (::pthread_setaffinity_np(workers_.back().native_handle(), sizeof(set), &set) == 0)
      ++pinned_;
  }
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void WorkerPool::run(size_t parts, const std::function<void(size_t)>& fn) {
  if (parts <= 1 || workers_.empty()) {
    for (size_t p = 0; p < parts; ++p) fn(p);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    task_ = &fn;
    parts_ = parts;
    next_ = 1;  // part 0 is the caller's
    finished_ = 0;
    error_ = nullptr;
    ++generation_;
  }
  wake_.notify_all();
  // The caller takes parts too, starting with part 0.
  size_t part = 0;
  while (true) {
    std::exception_ptr error;
    try {
      fn(part);
    } catch (...) {
      error = std::current_exception();
    }
    std::unique_lock<std::mutex> lock(mutex_);
    if (error && !error_) error_ = error;
    ++finished_;
    if (next_ < parts_) {
      part = next_++;
      continue;
    }
    done_.wait(lock, [&] { return finished_ == parts_; });
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
    return;
  }
}

void WorkerPool::loop(size_t index) {
  // Named for top -H, perf and the tests: "tpcomm-shm:1" ...
  char name[16];
  std::snprintf(name, sizeof(name), "tpcomm-shm:%zu", index);
  ::pthread_setname_np(::pthread_self(), name);
  uint64_t seen = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait(lock, [&] { return stop_ || (generation_ != seen && next_ < parts_); });
    if (stop_) return;
    seen = generation_;
    while (task_ != nullptr && next_ < parts_) {
      const size_t part = next_++;
      const auto* fn = task_;
      lock.unlock();
      std::exception_ptr error;
      try {
        (*fn)(part);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      if (error && !error_) error_ = error;
      if (++finished_ == parts_) done_.notify_all();
    }
  }
}

}  // namespace tpcomm::mq
