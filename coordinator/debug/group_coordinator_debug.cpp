// GroupCoordinator: TPCOMM_DEBUG's cross-rank check of each call, one
// checked call per group at a time (debug_check.hpp does the exchange).
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

#include "common/error.hpp"
#include "coordinator/debug/debug_check.hpp"
#include "coordinator/group_coordinator.hpp"

namespace tpcomm::coord {

namespace {
// The kernel's thread id (Python's threading.get_native_id()).
long nativeThreadId() { return static_cast<long>(syscall(SYS_gettid)); }
}  // namespace

std::unique_lock<std::recursive_timed_mutex> GroupCoordinator::debugTurn() {
  std::unique_lock<std::recursive_timed_mutex> turn(debugMutex_, std::try_to_lock);
  if (!turn.owns_lock()) {
    {
      // A thread waiting here calls the group too: a mismatch of the call
      // in progress names it.
      std::lock_guard<std::mutex> note(debugNoteMutex_);
      debugThreads_[debugThreadNext_++ % debugThreads_.size()] = nativeThreadId();
    }
    // The holder's call is bounded by the group's timeout; so is this wait.
    if (!turn.try_lock_for(2 * options_.timeout)) {
      std::lock_guard<std::mutex> note(debugNoteMutex_);
      TPCOMM_THROW(kTimeout, "TPCOMM_DEBUG: group '", options_.groupName, "' is still busy with ",
                   debugCurrent_, " after twice the group's timeout (",
                   2 * options_.timeout.count(), " ms)");
    }
  }
  return turn;
}

namespace {
thread_local uint64_t checksOnThisThread = 0;
}  // namespace

uint64_t GroupCoordinator::debugChecksOnThisThread() { return checksOnThisThread; }

void GroupCoordinator::checkRefusedCall(const char* op, const std::string& why) {
  if (!options_.debugChecks) return;
  const auto turn = debugTurn();
  checkSignature(std::string(op) + " refused on this rank: " + why);
}

void GroupCoordinator::checkSignature(const std::string& signature) {
  ++checksOnThisThread;
  {
    std::lock_guard<std::mutex> note(debugNoteMutex_);
    const long thread = nativeThreadId();
    debugThreads_[debugThreadNext_++ % debugThreads_.size()] = thread;
    debugCurrent_ = "thread " + std::to_string(thread) + " (" + signature + ")";
  }
  try {
    checkSameAcrossRanks(*cpu_, options_.groupName, ++debugSequence_, signature);
  } catch (const Error& e) {
    // The threads among the group's recent checked calls: more than one
    // explains a mismatch of calls that reached the ranks in other orders.
    std::vector<long> threads;
    {
      std::lock_guard<std::mutex> note(debugNoteMutex_);
      for (long t : debugThreads_) {
        if (t != 0 && std::find(threads.begin(), threads.end(), t) == threads.end())
          threads.push_back(t);
      }
    }
    if (threads.size() < 2) throw;
    std::string names;
    for (long t : threads) names += (names.empty() ? "" : ", ") + std::to_string(t);
    throw Error(e.code(), std::string(e.what()) + " Rank " + std::to_string(rank()) +
                              " has called this group from several threads (threads " + names +
                              " among its last " + std::to_string(debugThreads_.size()) +
                              " checked calls): TPCOMM_DEBUG runs one checked call at a time, "
                              "but calls that reach the ranks in different orders still "
                              "disagree; issue a group's calls in one order on every rank (one "
                              "thread per group, or a lock).");
  }
}

}  // namespace tpcomm::coord
