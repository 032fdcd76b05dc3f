#include "coordinator/faults/fault_watchdog.hpp"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "common/settings.hpp"
#include "coordinator/faults/group_fault.hpp"

namespace tpcomm::coord {

Watchdog& Watchdog::get() {
  static Watchdog* watchdog = new Watchdog();
  return *watchdog;
}

std::chrono::milliseconds watchdogInterval() { return Watchdog::get().interval(); }

Watchdog::Watchdog() : interval_(std::chrono::milliseconds(settings().watchdogMs)) {
  // A fork while the thread holds the lock would leave it locked in the
  // child; the child starts its own thread on its first group.
  pthread_atfork([] { Watchdog::get().mutex_.lock(); }, [] { Watchdog::get().mutex_.unlock(); },
                 [] {
                   Watchdog& w = Watchdog::get();
                   w.mutex_.unlock();
                   w.groups_.clear();
                   w.pending_.clear();
                 });
  std::atexit([] { Watchdog::get().exiting_.store(true); });
}

void Watchdog::add(std::weak_ptr<GroupFault> group) {
  if (interval_.count() == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  groups_.push_back(std::move(group));
  if (threadPid_ != getpid()) {
    threadPid_ = getpid();
    std::thread([this] { loop(); }).detach();
  }
}

void Watchdog::wake(std::shared_ptr<GroupFault> keep) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    woken_ = true;
    if (keep) pending_.push_back(std::move(keep));
  }
  cv_.notify_one();
}

void Watchdog::loop() {
  const pid_t self = getpid();
  const auto step = std::max(interval_ / 2, std::chrono::milliseconds(1));
  while (!exiting_.load()) {
    std::vector<std::shared_ptr<GroupFault>> live;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait_for(lock, step, [&] { return woken_; });
      woken_ = false;
      if (threadPid_ != self) return;  // a forked child's copy of the state
      groups_.erase(std::remove_if(groups_.begin(), groups_.end(),
                                   [](const auto& g) { return g.expired(); }),
                    groups_.end());
      for (const auto& g : groups_) {
        if (auto group = g.lock()) live.push_back(std::move(group));
      }
      for (auto& group : pending_) live.push_back(std::move(group));
      pending_.clear();
    }
    const auto now = GroupFault::Clock::now();
    for (const auto& group : live) {
      if (exiting_.load()) return;
      try {
        group->visit(now, interval_);
      } catch (...) {
        // A store that went away: the group's own calls report it.
      }
    }
  }
}

}  // namespace tpcomm::coord
