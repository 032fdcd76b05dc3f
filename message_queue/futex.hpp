#pragma once
// Futex sleep and wake on a 32-bit word in shared memory, and whether a peer
// process is still alive: the waiting primitives the ring (segment.cpp) and
// the shared-memory collectives (shm_group.cpp) share. Internal to
// message_queue/.

#include <atomic>
#include <chrono>
#include <cstdint>

namespace tpcomm::mq {

// Sleeps while `word` still holds `expected`, at most `slice`; returns early
// on a wake, a changed word or a signal (callers re-check their condition).
void futexWait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::microseconds slice);
// Wakes every process sleeping on `word`.
void futexWakeAll(std::atomic<uint32_t>& word);

// Whether process `pid` is alive: false once it exited, including a zombie
// (dead but not yet reaped by its parent, which kill(pid, 0) still reports
// as existing). 0 counts as alive (a peer that has not attached yet), a
// negative pid as gone (a reader that detached).
bool processAlive(int32_t pid);

}  // namespace tpcomm::mq
