#include "message_queue/region/futex.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
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
               int pauseRounds, const std::function<void()>& betweenRounds, bool yield) {
  for (int round = 0; round < pauseRounds || std::chrono::steady_clock::now() < until; ++round) {
    for (int i = 0; i < 16; ++i) {
      if (ready()) return true;
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    if (betweenRounds) betweenRounds();
    if (yield && round >= pauseRounds) sched_yield();
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

struct ProcStat {
  char state = 0;          // 0: unreadable
  uint64_t startTime = 0;  // clock ticks after boot (field 22)
};

// The state letter and start time of /proc/<pid>/stat ("pid (comm) S ...").
// comm may hold spaces and parentheses: the state follows the last ')'.
ProcStat procStat(int32_t pid) {
  ProcStat out;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", static_cast<int>(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  char buf[1024];
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n <= 0) return out;
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');
  if (close == nullptr || close[1] != ' ') return out;
  out.state = close[2];
  // Fields 3.. follow the state; the start time is field 22.
  const char* p = close + 2;
  for (int field = 3; field < 22 && p != nullptr; ++field) {
    p = std::strchr(p, ' ');
    if (p != nullptr) ++p;
  }
  if (p != nullptr) out.startTime = std::strtoull(p, nullptr, 10);
  return out;
}

char procState(int32_t pid) { return procStat(pid).state; }

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

PeerProcess::PeerProcess(int32_t pid) : pid_(pid) {
  if (pid_ <= 0) return;
#if defined(SYS_pidfd_open)
  fd_ = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0));
#endif
  if (fd_ < 0) startTime_ = procStat(pid_).startTime;
}

PeerProcess::~PeerProcess() {
  if (fd_ >= 0) ::close(fd_);
}

PeerProcess::PeerProcess(PeerProcess&& other) noexcept
    : pid_(other.pid_), fd_(other.fd_), startTime_(other.startTime_) {
  other.fd_ = -1;
}

PeerProcess& PeerProcess::operator=(PeerProcess&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    pid_ = other.pid_;
    fd_ = other.fd_;
    startTime_ = other.startTime_;
    other.fd_ = -1;
  }
  return *this;
}

bool PeerProcess::alive() const {
  if (pid_ < 0) return false;
  if (pid_ == 0) return true;
  if (fd_ >= 0) {
    // Readable once the whole process has exited (zombies included).
    struct pollfd p = {fd_, POLLIN, 0};
    return !(::poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP)) != 0);
  }
  const ProcStat now = procStat(pid_);
  if (now.state == 0) return !(::kill(pid_, 0) != 0 && errno == ESRCH);
  if (startTime_ != 0 && now.startTime != startTime_) return false;  // the pid was reused
  return now.state != 'Z' && now.state != 'X';
}

}  // namespace tpcomm::mq
