#include "coordinator/faults/gloo_sockets.hpp"

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

#include "common/error.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

namespace tpcomm::coord {

namespace {

constexpr const char* kFdDir = "/proc/self/fd";
// Devices of one Gloo group looked for (GLOO_SOCKET_IFNAME lists one per
// interface).
constexpr int kMaxDevices = 16;

bool isTcpSocket(int fd) {
  int type = 0;
  socklen_t len = sizeof(type);
  if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) return false;
  sockaddr_storage addr{};
  socklen_t alen = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &alen) != 0) return false;
  return addr.ss_family == AF_INET || addr.ss_family == AF_INET6;
}

bool listens(int fd) {
  int on = 0;
  socklen_t len = sizeof(on);
  return getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &on, &len) == 0 && on != 0;
}

uint64_t inodeOf(int fd) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

// An IPv4 or IPv6 address; an IPv4-mapped IPv6 one as IPv4, so that the
// two spellings of one endpoint compare equal.
std::optional<Endpoint> endpointOf(const sockaddr_storage& addr) {
  Endpoint e;
  if (addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    e.family = AF_INET;
    std::memcpy(e.address.data(), &in->sin_addr, 4);
    e.port = ntohs(in->sin_port);
    return e;
  }
  if (addr.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&addr);
    e.port = ntohs(in6->sin6_port);
    if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
      e.family = AF_INET;
      std::memcpy(e.address.data(), in6->sin6_addr.s6_addr + 12, 4);
    } else {
      e.family = AF_INET6;
      std::memcpy(e.address.data(), in6->sin6_addr.s6_addr, 16);
    }
    return e;
  }
  return std::nullopt;
}

std::optional<Endpoint> localOf(int fd) {
  sockaddr_storage addr{};
  socklen_t alen = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &alen) != 0) return std::nullopt;
  return endpointOf(addr);
}

// `listener` is where `local` listens or was accepted: the same endpoint,
// or the same port of a listener bound to every address.
bool sameListener(const Endpoint& listener, const Endpoint& local) {
  if (listener.anyAddress()) return listener.port == local.port;
  return listener == local;
}

size_t readSize(const std::vector<uint8_t>& record, size_t at) {
  size_t value = 0;
  std::memcpy(&value, record.data() + at, sizeof(value));
  return value;
}

std::string recordKey(int device, int rank) {
  return std::to_string(device) + "/" + std::to_string(rank);
}

}  // namespace

bool Endpoint::anyAddress() const {
  return std::all_of(address.begin(), address.end(), [](uint8_t b) { return b == 0; });
}

std::string Endpoint::str() const {
  char text[INET6_ADDRSTRLEN] = "?";
  inet_ntop(family, address.data(), text, sizeof(text));
  return family == AF_INET6 ? detail::concat("[", text, "]:", port)
                            : detail::concat(text, ":", port);
}

std::optional<Endpoint> GlooSockets::parseRecord(const std::vector<uint8_t>& record,
                                                 std::string* why) {
  // host name length, host name, address length, address
  // (sockaddr_storage, then Gloo's sequence number), pair identifiers.
  auto fail = [&](const std::string& what) -> std::optional<Endpoint> {
    if (why) *why = detail::concat("its rendezvous record (", record.size(), " bytes) ", what);
    return std::nullopt;
  };
  if (record.size() < sizeof(size_t)) return fail("is shorter than a length");
  const size_t hostLen = readSize(record, 0);
  if (hostLen > 4096 || sizeof(size_t) + hostLen + sizeof(size_t) > record.size())
    return fail(detail::concat("does not hold a host name's length (", hostLen, ")"));
  const size_t at = sizeof(size_t) + hostLen;
  const size_t addrLen = readSize(record, at);
  const size_t addrAt = at + sizeof(size_t);
  if (addrLen < sizeof(sockaddr_in) || addrLen > record.size() - addrAt)
    return fail(detail::concat("does not hold an address's length (", addrLen, ")"));
  if ((record.size() - addrAt - addrLen) % sizeof(int64_t) != 0)
    return fail("ends inside a pair identifier");
  sockaddr_storage addr{};
  std::memcpy(&addr, record.data() + addrAt, std::min(addrLen, sizeof(addr)));
  if (addr.ss_family == AF_INET6 && addrLen < sizeof(sockaddr_in6))
    return fail("holds an IPv6 address too short for one");
  auto endpoint = endpointOf(addr);
  if (!endpoint) return fail(detail::concat("holds address family ", addr.ss_family));
  if (endpoint->port == 0) return fail("holds port 0");
  return endpoint;
}

GlooSockets GlooSockets::unknown(std::string why) {
  GlooSockets sockets;
  sockets.pid_ = getpid();
  sockets.problem_ = std::move(why);
  return sockets;
}

GlooSockets GlooSockets::ofGroup(const c10::intrusive_ptr<c10d::Store>& glooStore, int rank,
                                 int size) {
  if (!glooStore) return unknown("the Gloo group's store is not known");
  GlooSockets sockets;
  sockets.pid_ = getpid();
  std::string why;
  try {
    for (int device = 0; device < kMaxDevices && why.empty(); ++device) {
      // torch's ProcessGroupGloo: one PrefixStore per device, named by its index.
      if (!glooStore->check({recordKey(device, rank)})) {
        if (device == 0)
          why = detail::concat("Gloo published no record of rank ", rank, " (key ",
                               recordKey(device, rank), ")");
        break;
      }
      for (int r = 0; r < size && why.empty(); ++r) {
        const std::string key = recordKey(device, r);
        // A peer's record in Gloo's lazy mode may come later: its pairs
        // then connect to this rank's listener, which is known.
        if (r != rank && !glooStore->check({key})) continue;
        std::string bad;
        auto endpoint = parseRecord(glooStore->get(key), &bad);
        if (!endpoint) {
          why = detail::concat("Gloo's key ", key, ": ", bad);
        } else {
          (r == rank ? sockets.own_ : sockets.peers_).push_back(*endpoint);
        }
      }
    }
  } catch (const std::exception& e) {
    why = detail::concat("reading Gloo's rendezvous records: ", e.what());
  }
  if (why.empty() && !ground().empty()) why = ground();
  // The record names this rank's own listener: the layout is read right.
  const auto open = why.empty() ? snapshot() : std::vector<SocketFd>{};
  for (const auto& own : sockets.own_) {
    if (!why.empty()) break;
    bool found = false;
    for (const auto& s : open) {
      if (!listens(s.fd)) continue;
      const auto local = localOf(s.fd);
      if (local && sameListener(*local, own)) found = true;
    }
    if (!found)
      why = detail::concat("Gloo's record of rank ", rank, " names ", own.str(),
                           ", where this process has no listening socket");
  }
  if (!why.empty()) {
    // Nothing is shut down.
    sockets.own_.clear();
    sockets.peers_.clear();
    sockets.problem_ = why;
  }
  return sockets;
}

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
    const auto local = localOf(probe);
    if (!listed) {
      why = detail::concat(fdDir, " cannot be read: ", std::strerror(errno));
    } else if (inode == 0 || !local || local->port == 0 ||
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
  if (ground().empty())
    return "on (a group's Gloo connections, by the listening addresses its ranks exchanged)";
  return "off: " + ground() +
         "; a broken group's connections are left open: its Gloo calls fail at their timeout "
         "instead of at once";
}

std::optional<std::pair<Endpoint, Endpoint>> GlooSockets::endpointsOf(int fd) {
  if (listens(fd)) return std::nullopt;
  sockaddr_storage peer{};
  socklen_t plen = sizeof(peer);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &plen) != 0) return std::nullopt;
  auto local = localOf(fd);
  auto remote = endpointOf(peer);
  if (!local || !remote) return std::nullopt;
  return std::make_pair(*local, *remote);
}

std::vector<int> GlooSockets::connections() const {
  std::vector<int> out;
  if (pid_ != getpid() || (own_.empty() && peers_.empty())) return out;
  for (const auto& s : snapshot()) {
    const auto ends = endpointsOf(s.fd);
    if (!ends) continue;
    const auto& [local, peer] = *ends;
    const bool accepted = std::any_of(own_.begin(), own_.end(), [&](const Endpoint& listener) {
      return sameListener(listener, local);
    });
    const bool opened = std::find(peers_.begin(), peers_.end(), peer) != peers_.end();
    if (accepted || opened) out.push_back(s.fd);
  }
  return out;
}

void GlooSockets::add(const GlooSockets& other) {
  if (pid_ == 0) pid_ = other.pid_;
  if (!other.problem_.empty())
    problem_ = problem_.empty() ? other.problem_ : problem_ + "; " + other.problem_;
  own_.insert(own_.end(), other.own_.begin(), other.own_.end());
  peers_.insert(peers_.end(), other.peers_.begin(), other.peers_.end());
}

void GlooSockets::shutdownAll() const {
  for (const int fd : connections()) ::shutdown(fd, SHUT_RDWR);
}

}  // namespace tpcomm::coord
