// torch's ProcessGroupGloo made from C++, through torch's own exported
// constructor and device makers, with torch's real header compiled against
// the declarations in gloo_decl/ (its README says why that is sound).
#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "common/error.hpp"
#include "cpp/src/torch_backends.hpp"

namespace tpcomm::cpp {

namespace {

using Device = std::shared_ptr<::gloo::transport::Device>;
using DeviceMaker = std::function<std::vector<Device>()>;

// The host of the TCPStore under `store` (through PrefixStores), or "".
std::string storeHost(c10::intrusive_ptr<c10d::Store> store) {
  for (int depth = 0; depth < 64 && store; ++depth) {
    if (auto* prefix = dynamic_cast<c10d::PrefixStore*>(store.get())) {
      store = prefix->getUnderlyingStore();
      continue;
    }
    if (auto* tcp = dynamic_cast<c10d::TCPStore*>(store.get())) return tcp->getHost();
    return "";
  }
  return "";
}

// This host's address on the route to `host` (no packet is sent), or "".
std::string routeSource(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  // IPv4 unless the host is written as IPv6 (as the Python package picks).
  hints.ai_family = host.find(':') == std::string::npos ? AF_INET : AF_INET6;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || found == nullptr) return "";
  std::string source;
  const int fd = ::socket(found->ai_family, SOCK_DGRAM, 0);
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
    sockaddr_storage local{};
    socklen_t length = sizeof(local);
    char text[INET6_ADDRSTRLEN] = {0};
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0 &&
        ::getnameinfo(reinterpret_cast<sockaddr*>(&local), length, text, sizeof(text), nullptr,
                      0, NI_NUMERICHOST) == 0) {
      source = text;
    }
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(found);
  return source;
}

bool isLoopback(const std::string& address) {
  in_addr v4{};
  if (::inet_pton(AF_INET, address.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  const std::string bare = address.substr(0, address.find('%'));
  in6_addr v6{};
  return ::inet_pton(AF_INET6, bare.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

DeviceMaker deviceMaker(const c10::intrusive_ptr<c10d::Store>& groupStore) {
  const bool lazy = c10d::getDefaultGlooLazyInit();
  std::vector<std::string> names;
  if (const char* env = std::getenv("GLOO_SOCKET_IFNAME")) {
    const std::string list = env;
    for (size_t start = 0; start <= list.size();) {
      const size_t end = std::min(list.find(',', start), list.size());
      if (end > start) names.push_back(list.substr(start, end - start));
      start = end + 1;
    }
  }
  if (!names.empty()) {
    return [names, lazy] {
      std::vector<Device> devices;
      for (const auto& name : names) {
        devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name, lazy));
      }
      return devices;
    };
  }
  const std::string host = storeHost(groupStore);
  if (!host.empty()) {
    const std::string source = routeSource(host);
    if (!source.empty() && !isLoopback(source)) {
      return [source, lazy] {
        return std::vector<Device>{c10d::ProcessGroupGloo::createDeviceForHostname(source, lazy)};
      };
    }
  }
  return [lazy] { return std::vector<Device>{c10d::ProcessGroupGloo::createDefaultDevice(lazy)}; };
}

}  // namespace

coord::BackendFactory glooFactory(const c10::intrusive_ptr<c10d::Store>& groupStore) {
  DeviceMaker makeDevices = deviceMaker(groupStore);
  return [makeDevices](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout) -> c10::intrusive_ptr<c10d::Backend> {
    auto options = c10::make_intrusive<c10d::ProcessGroupGloo::Options>(timeout);
    options->devices = makeDevices();
    options->threads = 2;  // the Python package's (torch's Options default)
    return checkMade(c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options),
                     "gloo", rank, size, timeout);
  };
}

}  // namespace tpcomm::cpp
