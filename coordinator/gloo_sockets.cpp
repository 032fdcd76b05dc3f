#include "coordinator/gloo_sockets.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "coordinator/common/error.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace tpcomm::coord {

namespace {

bool isTcpSocket(int fd) {
  int type = 0;
  socklen_t len = sizeof(type);
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) return false;
  sockaddr_storage addr{};
  socklen_t alen = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &alen) != 0) return false;
  return addr.ss_family == AF_INET || addr.ss_family == AF_INET6;
}

int portOf(int fd, bool peer) {
  sockaddr_storage addr{};
  socklen_t alen = sizeof(addr);
  const int rc = peer ? getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &alen)
                      : getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &alen);
  if (rc != 0) return -1;
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return -1;
}

uint64_t inodeOf(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

// The TCP port of the TCPStore under `store` (-1: another kind of store).
int storePort(const c10::intrusive_ptr<c10d::Store>& store) {
  c10::intrusive_ptr<c10d::Store> s = store;
  while (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(s.get())) {
    s = prefixed->getUnderlyingStore();
  }
  if (auto* tcp = dynamic_cast<c10d::TCPStore*>(s.get())) return tcp->getPort();
  return -1;
}

}  // namespace

constexpr const char* kFdDir = "/proc/self/fd";

std::vector<SocketFd> GlooSockets::snapshot() {
  if (!ground().empty()) return {};
  return snapshotOf(kFdDir).value_or(std::vector<SocketFd>{});
}

std::optional<std::vector<SocketFd>> GlooSockets::snapshotOf(const char* fdDir) {
  std::vector<SocketFd> out;
  DIR* dir = opendir(fdDir);
  if (dir == nullptr) return std::nullopt;
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (*end != '\0' || fd < 0 || fd == dirfd(dir)) continue;  // not a descriptor's name
    const uint64_t inode = inodeOf(static_cast<int>(fd));
    if (inode != 0 && isTcpSocket(static_cast<int>(fd))) {
      out.push_back(SocketFd{static_cast<int>(fd), inode});
    }
  }
  closedir(dir);
  return out;
}

std::string GlooSockets::groundOf(const char* fdDir) {
  const int probe = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (probe < 0)
    return detail::concat("cannot open a TCP socket to check ", fdDir, ": ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);  // port 0: any free one, on any interface
  std::string why;
  if (::bind(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    why = detail::concat("cannot bind a TCP socket to check ", fdDir, ": ", std::strerror(errno));
  } else {
    const uint64_t inode = inodeOf(probe);
    const auto listed = snapshotOf(fdDir);
    if (!listed) {
      why = detail::concat(fdDir, " cannot be read: ", std::strerror(errno));
    } else if (inode == 0 || portOf(probe, false) <= 0 ||
               std::none_of(listed->begin(), listed->end(),
                            [&](const SocketFd& s) { return s.fd == probe && s.inode == inode; })) {
      why = detail::concat(fdDir, " does not list a TCP socket this process just opened");
    }
  }
  ::close(probe);
  return why;
}

const std::string& GlooSockets::ground() {
  static const std::string why = groundOf(kFdDir);
  return why;
}

std::string GlooSockets::status() {
  if (ground().empty()) return "on (a group's Gloo connections, from /proc/self/fd)";
  return "off: " + ground() +
         "; a broken group's connections are left open: its Gloo calls fail at their timeout "
         "instead of at once";
}

GlooSockets GlooSockets::opened(const std::vector<SocketFd>& before,
                                const std::vector<SocketFd>& after,
                                const c10::intrusive_ptr<c10d::Store>& store) {
  GlooSockets sockets;
  sockets.pid_ = getpid();
  const int skipPort = store ? storePort(store) : -1;
  for (const auto& s : after) {
    const bool old = std::any_of(before.begin(), before.end(), [&](const SocketFd& b) {
      return b.fd == s.fd && b.inode == s.inode;
    });
    // The store's own connections (a server's accepted ones, a client's)
    // are not Gloo's.
    if (!old && portOf(s.fd, false) != skipPort && portOf(s.fd, true) != skipPort) {
      sockets.fds_.push_back(s);
    }
  }
  return sockets;
}

GlooSockets GlooSockets::around(const std::function<void()>& make,
                                const c10::intrusive_ptr<c10d::Store>& store) {
  const auto before = snapshot();
  make();
  return opened(before, snapshot(), store);
}

void GlooSockets::add(const GlooSockets& other) {
  if (pid_ == 0) pid_ = other.pid_;
  fds_.insert(fds_.end(), other.fds_.begin(), other.fds_.end());
}

void GlooSockets::shutdownAll() const {
  if (pid_ != getpid()) return;
  for (const auto& s : fds_) {
    if (inodeOf(s.fd) == s.inode) ::shutdown(s.fd, SHUT_RDWR);
  }
}

}  // namespace tpcomm::coord
