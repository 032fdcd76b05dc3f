#include "message_queue/collectives/worker_pool.hpp"

#include <pthread.h>
#include <sched.h>

#include <cstdio>

namespace tpcomm::mq {

namespace {

inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Polls `done` for at most `window`; true when it held.
template <typename Done>
bool pollFor(std::chrono::microseconds window, const Done& done) {
  if (window.count() <= 0) return done();
  const auto until = std::chrono::steady_clock::now() + window;
  while (!done()) {
    for (int i = 0; i < 32; ++i) pause();
    if (std::chrono::steady_clock::now() >= until) return done();
  }
  return true;
}

}  // namespace

WorkerPool::WorkerPool(int threads, const std::vector<int>& cpus, std::chrono::microseconds spin)
    : spin_(spin) {
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
    posted_.fetch_add(1, std::memory_order_release);  // ends a polling worker's window
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void WorkerPool::run(size_t parts, const std::function<void(size_t)>& fn) {
  if (parts <= 1 || workers_.empty()) {
    for (size_t p = 0; p < parts; ++p) fn(p);
    return;
  }
  partsSplit_.fetch_add(parts, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    task_ = &fn;
    parts_ = parts;
    next_ = 1;  // part 0 is the caller's
    finished_ = 0;
    finishedSeen_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    ++generation_;
    posted_.store(generation_, std::memory_order_release);
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
    finishedSeen_.store(finished_, std::memory_order_release);
    if (next_ < parts_) {
      part = next_++;
      continue;
    }
    if (finished_ != parts_ && spin_.count() > 0) {
      // The workers' last parts end about now: poll before sleeping.
      lock.unlock();
      pollFor(spin_, [&] { return finishedSeen_.load(std::memory_order_acquire) == parts; });
      lock.lock();
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
    const auto ready = [&] { return stop_ || (generation_ != seen && next_ < parts_); };
    if (!ready() && spin_.count() > 0) {
      // A large call hands out parts chunk after chunk: poll for the next
      // task a while (without the lock) before sleeping on the condition.
      lock.unlock();
      pollFor(spin_, [&] { return posted_.load(std::memory_order_acquire) != seen; });
      lock.lock();
    }
    wake_.wait(lock, ready);
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
      finishedSeen_.store(++finished_, std::memory_order_release);
      if (finished_ == parts_) done_.notify_all();
    }
  }
}

}  // namespace tpcomm::mq
