// CurrentFault and waitWork (group_fault.hpp): waits inside a route that
// end when the calling thread's group breaks.
#include <condition_variable>
#include <mutex>

#include "common/error.hpp"
#include "coordinator/faults/group_fault.hpp"

namespace tpcomm::coord {

using namespace std::chrono_literals;

namespace {
thread_local GroupFault* currentFault = nullptr;

// Aborts a point-to-point work when its group breaks.
struct AbortOnBreak : Interruptible {
  c10::intrusive_ptr<c10d::Work> work;  // owned: the caller may drop its own first
  explicit AbortOnBreak(c10d::Work* w)
      : work(c10::intrusive_ptr<c10d::Work>::reclaim_copy(w)) {}
  void interrupt(const std::string&) override {
    try {
      work->abort();
    } catch (...) {
    }
  }
};
}  // namespace

CurrentFault::CurrentFault(GroupFault* fault) : previous_(currentFault) { currentFault = fault; }
CurrentFault::~CurrentFault() { currentFault = previous_; }
GroupFault* CurrentFault::get() { return currentFault; }

bool waitWork(c10d::Work& work, std::chrono::milliseconds timeout) {
  GroupFault* fault = currentFault;
  if (fault == nullptr) return work.wait(timeout);
  const auto type = work.retrieveOpType();
  if (type == c10d::OpType::SEND || type == c10d::OpType::RECV ||
      type == c10d::OpType::RECVANYSOURCE) {
    auto release = std::make_shared<AbortOnBreak>(&work);
    const uint64_t ticket = fault->enter(0, "internal send/recv", true, release);
    struct Leave {
      GroupFault* f;
      uint64_t t;
      ~Leave() { f->leave(t); }
    } leave{fault, ticket};
    if (fault->broken()) TPCOMM_THROW(kPeerLost, "released: ", fault->reason());
    try {
      return work.wait(timeout);
    } catch (...) {
      if (fault->broken()) TPCOMM_THROW(kPeerLost, "released: ", fault->reason());
      throw;
    }
  }
  // A collective: wait for its future, looking at the group between naps.
  struct Done {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
  };
  auto done = std::make_shared<Done>();
  work.getFuture()->addCallback([done](c10::ivalue::Future&) {
    std::lock_guard<std::mutex> lock(done->mutex);
    done->done = true;
    done->cv.notify_all();
  });
  const auto deadline = timeout == kNoTimeout
                            ? GroupFault::Clock::time_point::max()
                            : GroupFault::Clock::now() + timeout;
  {
    std::unique_lock<std::mutex> lock(done->mutex);
    while (!done->done) {
      if (fault->broken()) TPCOMM_THROW(kPeerLost, "released: ", fault->reason());
      if (GroupFault::Clock::now() >= deadline) break;
      done->cv.wait_for(lock, 20ms);
    }
  }
  return work.wait(timeout);  // returns at once, or raises the work's error
}

}  // namespace tpcomm::coord
