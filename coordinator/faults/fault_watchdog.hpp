#pragma once
// The process's one fault watchdog (group_fault.hpp says what it does for a
// group): a thread that visits every live group's fault state every half
// TPCOMM_WATCHDOG_MS, and at once when a group broke and has a line to
// publish. Leaked on purpose: its thread may still run while the process's
// static objects are destroyed, so it touches none of them. A forked child
// starts its own thread on its first group.
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

namespace tpcomm::coord {

class GroupFault;

class Watchdog {
 public:
  static Watchdog& get();

  // Watches `group` from now on (nothing when TPCOMM_WATCHDOG_MS is 0).
  void add(std::weak_ptr<GroupFault> group);
  // Visits at once. `keep`: a group with a break to publish, held until the
  // visit (its owner may destroy it at once, e.g. abort() then
  // destroy_process_group).
  void wake(std::shared_ptr<GroupFault> keep);
  bool running() const { return interval_.count() > 0; }
  std::chrono::milliseconds interval() const { return interval_; }

 private:
  Watchdog();
  void loop();

  const std::chrono::milliseconds interval_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool woken_ = false;                                // by mutex_
  pid_t threadPid_ = 0;                               // by mutex_
  std::vector<std::weak_ptr<GroupFault>> groups_;     // by mutex_
  std::vector<std::shared_ptr<GroupFault>> pending_;  // by mutex_
  std::atomic<bool> exiting_{false};
};

}  // namespace tpcomm::coord
