#include "coordinator/interpreter_lock.hpp"

#include <atomic>

namespace tpcomm::coord {

namespace {
std::atomic<InterpreterLockReleaser> releaser{nullptr};
}  // namespace

void setInterpreterLockReleaser(InterpreterLockReleaser r) { releaser.store(r); }

void withoutInterpreterLock(const std::function<void()>& fn) {
  if (auto r = releaser.load()) {
    r(fn);
  } else {
    fn();
  }
}

}  // namespace tpcomm::coord
