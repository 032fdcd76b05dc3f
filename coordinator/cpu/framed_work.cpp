// FramedWork's completion (once, by its first waiter or a progress
// thread) and the progress thread that completes the works nobody waits on
// (framed_p2p.hpp).
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <system_error>
#include <thread>
#include <tuple>
#include <vector>

#include "common/error.hpp"
#include "coordinator/cpu/framed_p2p.hpp"

namespace tpcomm::coord {

FramedWork::FramedWork(int rank, c10d::OpType type, std::chrono::milliseconds groupTimeout)
    : c10d::Work(rank, type), groupTimeout_(groupTimeout) {}

FramedWork::~FramedWork() = default;

void FramedWork::complete(std::chrono::milliseconds timeout) {
  bool ok = false;
  std::exception_ptr failure;
  try {
    ok = run(timeout);
  } catch (...) {
    failure = std::current_exception();
  }
  std::vector<std::function<void()>> onDone;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    settled_ = true;
    ok_ = ok && !failure;
    failure_ = failure;
    onDone.swap(onDone_);
  }
  settledCv_.notify_all();
  if (ok && !failure) {
    for (auto& fn : onDone) runDone(fn);
  }
}

bool FramedWork::isCompleted() {
  std::lock_guard<std::mutex> lock(mutex_);
  return settled_;
}

bool FramedWork::isSuccess() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return settled_ && ok_;
}

std::exception_ptr FramedWork::exception() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_;
}

bool FramedWork::wait(std::chrono::milliseconds timeout) {
  if (claim()) {
    complete(timeout);
  } else {
    std::unique_lock<std::mutex> lock(mutex_);
    // A progress thread completes it: waited for up to `timeout`, the
    // group's when none (as Gloo's own wait is bounded).
    const auto bound = timeout == ::kNoTimeout ? groupTimeout_ : timeout;
    if (!settledCv_.wait_for(lock, bound, [&] { return settled_; })) {
      TPCOMM_THROW(kTimeout, "send/recv did not complete within ", bound.count(), " ms");
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (failure_) std::rethrow_exception(failure_);
  return ok_;
}

void FramedWork::runDone(const std::function<void()>& fn) {
  // On a progress thread nothing may escape.
  try {
    fn();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tpcomm: a send/recv's completion step failed: %s\n", e.what());
  }
}

void FramedWork::whenDone(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!settled_) {
      onDone_.push_back(std::move(fn));
      return;
    }
    if (!ok_) return;
  }
  runDone(fn);
}

// Completes the framed works nobody waits on (Gloo's works complete only
// inside a wait: isCompleted() never turns true by itself, and a recv's
// rest is posted only once its header was read). Each work goes into a
// list when made; the thread that claims it (dist.send, dist.recv: at once)
// takes it out. One scheduler thread looks at the list every millisecond
// while works are being made (after a second without one it waits to be
// woken); a work at least 200 us old that nobody claimed goes to its
// lane (group, direction, peer, tag: Gloo completes a lane's messages in
// order), whose thread completes its works one after another and ends when
// the lane is empty.
class FramedProgress {
 public:
  static FramedProgress& get() {
    static auto* progress = new FramedProgress();  // never destroyed: a detached thread
    return *progress;
  }
  void add(const c10::intrusive_ptr<FramedWork>& work, const void* group, bool send, int peer,
           int tag);
  // `work` out of the list (a no-op when it is not in it), its reference
  // dropped.
  static void release(FramedWork* work);

 private:
  static constexpr auto kDelay = std::chrono::microseconds(200);
  // How often the scheduler looks while works are being made, and how long
  // it goes on without one before it waits to be woken (waking it per work
  // cost a ping-pong of small messages about as much as the message).
  static constexpr auto kTick = std::chrono::milliseconds(1);
  static constexpr int kIdleTicks = 1000;
  static constexpr std::chrono::milliseconds kProgressTimeout{std::chrono::hours(24 * 365)};
  using Lane = std::tuple<const void*, bool, int, int>;
  FramedProgress() {
    std::thread([this] { schedule(); }).detach();
  }
  // Under mutex_: `work` last in the list, due at `due` (the list owns a
  // reference to it); out of the list, true when it was in it (the caller
  // then owns the list's reference).
  void link(FramedWork* work, std::chrono::steady_clock::time_point due);
  bool unlink(FramedWork* work);
  void schedule();
  void drain(Lane lane);
  std::mutex mutex_;
  std::condition_variable wake_;
  FramedWork* head_ = nullptr;                                        // by mutex_
  FramedWork* tail_ = nullptr;                                        // by mutex_
  bool idle_ = true;                                                  // by mutex_
  std::map<Lane, std::deque<c10::intrusive_ptr<FramedWork>>> lanes_;  // by mutex_
};

void FramedProgress::add(const c10::intrusive_ptr<FramedWork>& work, const void* group, bool send,
                         int peer, int tag) {
  FramedWork::Queued& q = work->queued_;
  std::lock_guard<std::mutex> lock(mutex_);
  c10::raw::intrusive_ptr::incref(work.get());  // the list's reference
  q.lane = Lane{group, send, peer, tag};
  link(work.get(), std::chrono::steady_clock::now() + kDelay);
  // Only an idle scheduler is woken: a busy one looks every tick.
  if (idle_) {
    idle_ = false;
    wake_.notify_one();
  }
}

void FramedProgress::link(FramedWork* work, std::chrono::steady_clock::time_point due) {
  FramedWork::Queued& q = work->queued_;
  q.due = due;
  q.prev = tail_;
  q.next = nullptr;
  q.queued = true;
  (tail_ != nullptr ? tail_->queued_.next : head_) = work;
  tail_ = work;
}

bool FramedProgress::unlink(FramedWork* work) {
  FramedWork::Queued& q = work->queued_;
  if (!q.queued) return false;
  (q.prev != nullptr ? q.prev->queued_.next : head_) = q.next;
  (q.next != nullptr ? q.next->queued_.prev : tail_) = q.prev;
  q.prev = q.next = nullptr;
  q.queued = false;
  return true;
}

void FramedProgress::release(FramedWork* work) {
  FramedProgress& p = get();
  bool owned;
  {
    std::lock_guard<std::mutex> lock(p.mutex_);
    owned = p.unlink(work);
  }
  // The caller holds a reference of its own: this never destroys `work`.
  if (owned) c10::raw::intrusive_ptr::decref(work);
}

void FramedProgress::schedule() {
  std::unique_lock<std::mutex> lock(mutex_);
  int emptyTicks = 0;
  for (;;) {
    if (head_ != nullptr) {
      emptyTicks = 0;
    } else if (++emptyTicks >= kIdleTicks) {
      idle_ = true;
      wake_.wait(lock, [&] { return !idle_; });
      emptyTicks = 0;
    }
    lock.unlock();
    std::this_thread::sleep_for(kTick);
    lock.lock();
    const auto now = std::chrono::steady_clock::now();
    std::vector<c10::intrusive_ptr<FramedWork>> claimed;  // released outside the lock
    for (FramedWork* w = head_; w != nullptr && w->queued_.due <= now;) {
      FramedWork* next = w->queued_.next;
      bool taken;
      {
        std::lock_guard<std::mutex> workLock(w->mutex_);
        taken = w->claimed_;
      }
      unlink(w);
      // The list's reference, now this one's.
      auto work = c10::intrusive_ptr<FramedWork>::reclaim(w);
      if (taken) {
        claimed.push_back(std::move(work));  // its claimer is about to drop it
      } else {
        const Lane key = w->queued_.lane;
        auto& lane = lanes_[key];
        lane.push_back(std::move(work));
        if (lane.size() == 1) {
          try {
            std::thread([this, key] { drain(key); }).detach();
          } catch (const std::system_error&) {
            // No thread to be had now: back in the list, tried at a later tick.
            FramedWork* raw = lane.back().release();
            lanes_.erase(key);
            link(raw, now + kTick);
          }
        }
      }
      w = next;
    }
    lock.unlock();
    claimed.clear();
    lock.lock();
  }
}

bool FramedWork::claim() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (claimed_) return false;
    claimed_ = true;
  }
  // Out of the progress list: released here, in the claimer's thread.
  FramedProgress::release(this);
  return true;
}

void FramedProgress::drain(Lane key) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    auto it = lanes_.find(key);
    if (it == lanes_.end() || it->second.empty()) {
      if (it != lanes_.end()) lanes_.erase(it);
      return;
    }
    c10::intrusive_ptr<FramedWork> work = it->second.front();
    lock.unlock();
    // Without a deadline of its own (Gloo's would count from the call, not
    // from a wait): a waiter bounds its own wait; a break or the group's end
    // ends this one.
    if (work->claim()) work->complete(kProgressTimeout);
    work.reset();
    lock.lock();
    // Popped only now: while the lane is not empty, its thread lives.
    it = lanes_.find(key);
    if (it != lanes_.end() && !it->second.empty()) it->second.pop_front();
  }
}

void trackFramedWork(const c10::intrusive_ptr<FramedWork>& work, const void* group, bool send,
                     int peer, int tag) {
  FramedProgress::get().add(work, group, send, peer, tag);
}

}  // namespace tpcomm::coord
