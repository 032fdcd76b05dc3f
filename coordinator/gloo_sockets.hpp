#pragma once
// The TCP connections a Gloo group opened, so that breaking the group can
// shut them down: every rank's pending and later Gloo calls on the group
// then fail at once (as NCCL's communicator abort makes its calls fail),
// instead of a released call's Gloo work pairing with a peer's later call.
//
// Gloo does not expose its sockets, so they are found as the TCP socket
// descriptors that appeared in this process while the group was made (its
// pairs and its listener), less any whose local or peer port is the group
// store's (the store's own connections). A socket another thread of the
// process opened in that window would be counted too: tpcomm makes its
// Gloo groups while the group's creation blocks its caller, and nothing of
// tpcomm's opens sockets meanwhile. Each is remembered
// with its inode: a descriptor Gloo closed and the process reused for
// something else is never touched. A forked child never shuts down its
// parent's connections.
//
// The finder checks its ground once per process (ground()): that
// /proc/self/fd lists a TCP socket it just opened, with its inode and port.
// Where it does not (no /proc, a sandbox that hides it), no connection is
// ever recorded or shut down: a broken group's Gloo calls then fail at
// their timeout instead of at once, and status() says why.

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace tpcomm::coord {

struct SocketFd {
  int fd;
  uint64_t inode;
};

class GlooSockets {
 public:
  GlooSockets() = default;
  // The process's TCP socket descriptors now.
  static std::vector<SocketFd> snapshot();
  // Those listed in the descriptor folder `fdDir`; nullopt: it cannot be read.
  static std::optional<std::vector<SocketFd>> snapshotOf(const char* fdDir);
  // Empty when /proc/self/fd can serve the finder, else why not (checked
  // once per process).
  static const std::string& ground();
  // The same check against another descriptor folder (tests).
  static std::string groundOf(const char* fdDir);
  // "on (...)" or "off: <why>; <what that means>", for describe() and
  // python -m tpcomm.info.
  static std::string status();
  // Those in `after` and not in `before`, less the store's own port.
  static GlooSockets opened(const std::vector<SocketFd>& before, const std::vector<SocketFd>& after,
                            const c10::intrusive_ptr<c10d::Store>& store);
  // Runs `make` and returns the sockets it opened.
  static GlooSockets around(const std::function<void()>& make,
                            const c10::intrusive_ptr<c10d::Store>& store);
  // shutdown(SHUT_RDWR) on each that is still the same socket. Idempotent.
  void shutdownAll() const;
  size_t size() const { return fds_.size(); }
  // Adds `other`'s sockets (another Gloo group of the same tpcomm group).
  void add(const GlooSockets& other);

 private:
  std::vector<SocketFd> fds_;
  pid_t pid_ = 0;
};

}  // namespace tpcomm::coord
