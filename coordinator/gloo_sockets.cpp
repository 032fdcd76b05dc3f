#include "coordinator/gloo_sockets.hpp"

#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

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

std::vector<SocketFd> GlooSockets::snapshot() {
  std::vector<SocketFd> out;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return out;
  while (dirent* entry = readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    const int fd = std::atoi(entry->d_name);
    if (fd == dirfd(dir)) continue;
    const uint64_t inode = inodeOf(fd);
    if (inode != 0 && isTcpSocket(fd)) out.push_back(SocketFd{fd, inode});
  }
  closedir(dir);
  return out;
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
