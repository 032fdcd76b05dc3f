#pragma once
// The TCP connections of a Gloo group, so that breaking the group can shut
// them down: every rank's pending and later Gloo calls on the group then
// fail at once (as NCCL's communicator abort makes its calls fail), instead
// of a released call's Gloo work pairing with a peer's later call.
//
// Gloo does not expose its sockets; they are told apart exactly by their
// endpoints, never by when they were opened. Gloo's rendezvous has every
// rank publish its device's listening address through the store the group
// was made with (key "<device index>/<rank>": torch's ProcessGroupGloo
// prefixes the device index; the record holds the host name, the address
// as a sockaddr_storage and the pairs' sequence numbers). Every pair of the
// group is a connection from one rank to another rank's listener, so on
// this rank a connection is the group's exactly when
//  - its local end is this rank's listening address (a pair it accepted), or
//  - its peer end is a peer rank's listening address (a pair it opened).
// A listening address names one socket of its host while the group lives,
// and every Gloo group tpcomm makes has a device (a listener) of its own,
// so no other connection of the process matches, whenever and by whichever
// thread it was opened. The connections are looked up when the group
// breaks (Gloo's lazy mode opens them on first use); the listener itself
// is left alone (Gloo's loop would treat its end as fatal).
//
// Ground checks, each with its reason when it fails (then nothing is shut
// down, and a broken group's Gloo calls fail at their timeout instead of at
// once):
//  - per process (ground()): /proc/self/fd lists a TCP socket it just
//    opened;
//  - per group (problem()): the record Gloo published for this rank parses
//    and names a socket that listens in this process.
// A forked child never shuts down its parent's connections.

#include <sys/types.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace tpcomm::coord {

struct SocketFd {
  int fd;
  uint64_t inode;
};

// A TCP endpoint: family (AF_INET / AF_INET6), address, port.
struct Endpoint {
  int family = 0;
  std::array<uint8_t, 16> address{};  // IPv4 in the first 4 bytes
  uint16_t port = 0;
  bool operator==(const Endpoint& other) const {
    return family == other.family && address == other.address && port == other.port;
  }
  // Bound to every address of the host (0.0.0.0, ::).
  bool anyAddress() const;
  std::string str() const;
};

class GlooSockets {
 public:
  GlooSockets() = default;
  // The group made by a Gloo group of `size` ranks through `glooStore` (the
  // store handed to ProcessGroupGloo), this process being `rank`: reads
  // every rank's record (one store round trip per key). Never throws: a
  // record that is missing or unreadable becomes problem().
  static GlooSockets ofGroup(const c10::intrusive_ptr<c10d::Store>& glooStore, int rank, int size);
  // A group whose connections cannot be told apart (`why`).
  static GlooSockets unknown(std::string why);
  // The listening address in one rank's record; nullopt and `why` when the
  // record is not laid out as this build reads it.
  static std::optional<Endpoint> parseRecord(const std::vector<uint8_t>& record, std::string* why);

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
  // The local and peer endpoints of a connected TCP socket (nullopt: it is
  // not one, or it listens).
  static std::optional<std::pair<Endpoint, Endpoint>> endpointsOf(int fd);

  // The group's connections open in this process now (descriptors).
  std::vector<int> connections() const;
  // shutdown(SHUT_RDWR) on each of connections(). Idempotent; nothing in a
  // forked child. A Gloo group with a problem() has no endpoints: its
  // connections are left open.
  void shutdownAll() const;
  // Adds `other`'s endpoints (another Gloo group of the same tpcomm group:
  // those between hosts); the problems of both are kept.
  void add(const GlooSockets& other);
  // Empty when every Gloo group added is known, else why not (each).
  const std::string& problem() const { return problem_; }
  // The listening addresses known (this rank's and its peers').
  size_t listeners() const { return own_.size() + peers_.size(); }

 private:
  std::vector<Endpoint> own_;    // this rank's listeners (one per device)
  std::vector<Endpoint> peers_;  // the peers' listeners
  std::string problem_;
  pid_t pid_ = 0;
};

}  // namespace tpcomm::coord
