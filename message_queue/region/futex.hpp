#pragma once
// Futex sleep and wake on a 32-bit word in shared memory, and whether a peer
// process is still alive: the waiting primitives the ring (segment.cpp) and
// the shared-memory collectives (shm_group.cpp) share. Internal to
// message_queue/.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>

namespace tpcomm::mq {

// Sleeps while `word` still holds `expected`, at most `slice`; returns early
// on a wake, a changed word or a signal (callers re-check their condition).
void futexWait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::microseconds slice);
// Wakes every process sleeping on `word`.
void futexWakeAll(std::atomic<uint32_t>& word);

// Waits that poll first, then sleep: the waiter counts itself in `sleepers`
// while it sleeps on `word`, and whoever publishes what it waits for calls
// wakeSleepers, which costs a system call only when someone sleeps.
//
// Bumps `word` and wakes its sleepers if there are any. Call after the store
// that publishes (ordered before it: the bump and the load of `sleepers` are
// sequentially consistent, as are the sleeper's count and its load of word).
void wakeSleepers(std::atomic<uint32_t>& word, std::atomic<uint32_t>& sleepers);
// Polls ready() in rounds of 16 with the CPU's pause hint; after the first
// `pauseRounds` rounds each round also yields the core (sched_yield) when
// `yield` is set, so that ranks outnumbering cores still progress. Stops when
// ready() is true (returns true) or when `until` has passed and at least
// `pauseRounds` rounds ran (false). `betweenRounds` (may throw) runs after
// every round.
bool pollUntil(const std::function<bool()>& ready, std::chrono::steady_clock::time_point until,
               int pauseRounds, const std::function<void()>& betweenRounds = {}, bool yield = true);
// One sleep: counts itself a sleeper, re-checks ready(), sleeps on `word` at
// most `slice` (woken by wakeSleepers), uncounts itself. Returns ready().
bool sleepOn(std::atomic<uint32_t>& word, std::atomic<uint32_t>& sleepers,
             const std::function<bool()>& ready, std::chrono::microseconds slice);

// Whether process `pid` is alive: false once it exited, including a zombie
// (dead but not yet reaped by its parent, which kill(pid, 0) still reports
// as existing). 0 counts as alive (a peer that has not attached yet), a
// negative pid as gone (a reader that detached).
bool processAlive(int32_t pid);

// A peer process watched for its exit, taken while the peer is known to be
// alive (a group's set-up): a pidfd (Linux 5.3 on), which names the process
// itself, so a reused pid never passes for it, needs no permission to
// signal it, and reports the exit of the whole process (a peer whose main
// thread ended while other threads run is alive). Where pidfds are not
// available: the pid and its start time from /proc/<pid>/stat (a reused pid
// has another). Pid 0 counts as alive (not known yet), a negative one as
// gone. Move-only; alive() is thread-safe.
class PeerProcess {
 public:
  explicit PeerProcess(int32_t pid);
  ~PeerProcess();
  PeerProcess(PeerProcess&& other) noexcept;
  PeerProcess& operator=(PeerProcess&& other) noexcept;
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  bool alive() const;
  int32_t pid() const { return pid_; }
  // Whether it is watched through a pidfd (else by pid and start time).
  bool byPidfd() const { return fd_ >= 0; }

 private:
  int32_t pid_;
  int fd_ = -1;
  uint64_t startTime_ = 0;  // the fallback's (0: unknown)
};

}  // namespace tpcomm::mq
