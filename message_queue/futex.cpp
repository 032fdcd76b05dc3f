#include "message_queue/futex.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>

namespace tpcomm::mq {

void futexWait(std::atomic<uint32_t>& word, uint32_t expected, std::chrono::microseconds slice) {
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(slice.count() / 1000000);
  ts.tv_nsec = static_cast<long>(slice.count() % 1000000) * 1000L;
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futexWakeAll(std::atomic<uint32_t>& word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr,
            0);
}

void wakeSleepers(std::atomic<uint32_t>& word, std::atomic<uint32_t>& sleepers) {
  word.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers.load(std::memory_order_seq_cst) != 0) futexWakeAll(word);
}

bool pollUntil(const std::function<bool()>& ready, std::chrono::steady_clock::time_point until,
               int pauseRounds, const std::function<void()>& betweenRounds) {
  for (int round = 0; round < pauseRounds || std::chrono::steady_clock::now() < until; ++round) {
    for (int i = 0; i < 16; ++i) {
      if (ready()) return true;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    if (betweenRounds) betweenRounds();
    if (round >= pauseRounds) sched_yield();
  }
  return ready();
}

bool sleepOn(std::atomic<uint32_t>& word, std::atomic<uint32_t>& sleepers,
             const std::function<bool()>& ready, std::chrono::microseconds slice) {
  sleepers.fetch_add(1, std::memory_order_seq_cst);
  const uint32_t seen = word.load(std::memory_order_seq_cst);
  if (!ready() && slice.count() > 0) futexWait(word, seen, slice);
  sleepers.fetch_sub(1, std::memory_order_seq_cst);
  return ready();
}

namespace {

// The state letter of /proc/<pid>/stat ("pid (comm) S ..."), or 0 when the
// file cannot be read. comm may hold spaces and parentheses: the state
// follows the last ')'.
char procState(int32_t pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[512];
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');
  if (close == nullptr || close[1] != ' ') return 0;
  return close[2];
}

}  // namespace

bool processAlive(int32_t pid) {
  if (pid < 0) return false;
  if (pid == 0) return true;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  // kill() succeeds on a zombie; /proc tells (Z: zombie, X: being reaped).
  // Where /proc is unreadable, the process counts as alive (the wait's
  // timeout still bounds it).
  const char state = procState(pid);
  return state != 'Z' && state != 'X';
}

}  // namespace tpcomm::mq
