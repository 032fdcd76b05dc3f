#pragma once
// GroupFault: what has gone wrong on one group, made known to every rank,
// and the one watchdog that carries it (fault_watchdog.hpp), for every route.
//
// A group breaks (for good: every current and later call raises naming the
// cause) when
//  - a rank calls abort() (from any thread);
//  - a CPU call fails on a rank (a timeout, a lost peer): the routes' own
//    state may then disagree between ranks;
//  - a rank refused a collective (a bad argument, raised before it
//    communicated) that another rank made: that rank is left in a call the
//    refusing rank never joins.
// A collective that every rank refused (the same bad call everywhere, or a
// mismatch the route found on every rank) breaks nothing.
//
// How the ranks learn it (one store key per group, `tpcomm/faults`, lines
// appended; the group's store reaches every host, and is its life's
// (group_life.hpp): the lines of an earlier group made under the same name
// on the same store never reach this one):
//  - "B <rank> <why>": the group broke on <rank>;
//  - "R <rank> <seq> <op> <why>": <rank> refused collective #<seq>.
// Once a rank knows the group broke it also shuts down the group's Gloo
// connections (gloo_sockets.hpp): its peers' Gloo calls on the group fail at
// once and none can pair with a call this rank gave up.
// A rank publishes its own breaks (from the watchdog's thread: abort() never
// blocks) and refusals (from the refusing call). The watchdog reads the key
// for a group only while one of its calls has waited longer than
// TPCOMM_WATCHDOG_MS; a call in flight on a broken group is then released:
// the shared-memory and hierarchical paths are aborted (their waits end at
// once, on every rank of the host), a routed work's waiters are failed
// (Interruptible) and the device backend is aborted. A refusing rank's next
// call on the group waits until every peer refused the same call too (then
// the group is healthy) or the group broke: it never pairs its next call
// with a peer's call that it refused.
//
// Positions: while a call waits longer than TPCOMM_WATCHDOG_MS the rank
// publishes where it is ("tpcomm/pos/<rank>": op, call number, its root for
// a rooted collective, since when; ranks in the same rooted call with
// different roots break the group naming both),
// and where it went after; a failed call's error reads the peers' (bounded
// by one second) and names them: "rank 1: in allreduce #1042 for 3.1 s".
//
// Thread-safe. Hot path: usable() (one atomic load), enter()/leave() (one
// uncontended mutex each).

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "coordinator/faults/gloo_sockets.hpp"

namespace tpcomm::coord {

// A routed call's waiters, which a broken group ends (TpcommWork).
class Interruptible {
 public:
  virtual ~Interruptible() = default;
  virtual void interrupt(const std::string& why) = 0;
};

class GroupFault : public std::enable_shared_from_this<GroupFault> {
 public:
  using Clock = std::chrono::steady_clock;
  // `store` null: nothing is published or read (a group of fake backends).
  static std::shared_ptr<GroupFault> create(c10::intrusive_ptr<c10d::Store> store,
                                            std::string groupName, int rank, int size,
                                            std::chrono::milliseconds timeout);
  GroupFault(const GroupFault&) = delete;
  GroupFault& operator=(const GroupFault&) = delete;
  ~GroupFault();

  // Whether a call may go ahead without checkBeforeCall().
  bool usable() const { return state_.load(std::memory_order_acquire) == 0; }
  bool broken() const { return (state_.load(std::memory_order_acquire) & kBroken) != 0; }
  // Whether no call of this rank is in flight on the group.
  bool idle() const;
  // Publishes what is queued (a break of this rank's) and releases the
  // calls now, on the caller's thread, and returns once every line taken
  // from the queue (by the watchdog too) is written, within a second: what
  // the watchdog's next visit would do. An abort calls it before it closes
  // its connections, so that a peer that sees them close finds the cause.
  void publishQueued();
  // This rank is done with the group: nothing more of it is written to the
  // store (a fault line still queued or a position still to publish is
  // dropped; a line already taken from the queue is written first, within
  // a second), so that the life's keys, once removed (group_life.hpp,
  // endLife), stay gone. Returns once no write is under way.
  void retire();
  // Why the group broke (empty while it works).
  std::string reason() const;
  // Before a call when !usable(): raises PeerLost naming the cause when the
  // group broke; after this rank refused a collective, waits until every
  // peer refused it too (the group's timeout bounds it) or the group broke.
  void checkBeforeCall(const char* op);

  // A call in flight: `seq` its number in the group's collective (or p2p)
  // sequence, `op` a static name. `release` (may be null) is ended when the
  // group breaks. Returns the ticket leave() takes.
  uint64_t enter(uint64_t seq, const char* op, bool p2p, std::weak_ptr<Interruptible> release = {});
  void leave(uint64_t ticket);
  // The root of the collective this thread just entered (broadcast, reduce,
  // gather, scatter): published with its position while it waits, so that
  // ranks in the same call with different roots find it (visit()) and
  // break the group naming both, instead of waiting out the timeout. Two
  // relaxed stores.
  void noteRoot(int root) {
    rootOfSeq_.store(startedSeq_.load(std::memory_order_relaxed) << 16 |
                         (static_cast<uint64_t>(root + 1) & 0xffff),
                     std::memory_order_relaxed);
  }

  // This rank refused collective #seq before communicating: tells the peers
  // (a peer in that call breaks the group) and makes this rank's next call
  // wait for the outcome.
  void refused(uint64_t seq, const char* op, const std::string& why);
  // Breaks the group on this rank and tells the peers; the first reason
  // wins. Never blocks: the publication goes through the watchdog.
  void breakGroup(const std::string& why);
  // What breaking the group must end besides the registered calls (the
  // coordinator's shared-memory paths and device backend). Cleared with an
  // empty function before they go away.
  void setReleaser(std::function<void(const std::string&)> releaser);
  // Whether the group has device work that may be waiting for a peer (the
  // custom kernel's last launch has not ended): the watchdog treats such
  // work, once older than its interval, as a call in flight (its host call
  // returned long ago). Cleared with an empty function, as the releaser.
  void setDeviceProbe(std::function<bool()> probe);
  void setTimeout(std::chrono::milliseconds timeout);
  // Connections of the group's Gloo groups (its own, those between hosts):
  // shut down once the group broke (after the break is published, so that
  // a peer whose Gloo call fails at once finds the cause in the store).
  void addGlooSockets(const GlooSockets& sockets);
  // A copy of the Gloo connections' finder (tests, describe()).
  GlooSockets glooSockets() const;

  // After a call failed here: when a peer published that the group broke
  // (it aborted, its own call failed), that is the cause; reads the store
  // once, within one second.
  void learnFromPeers();
  // " [across ranks: this rank (0) in allreduce #12; rank 1: in broadcast
  // #11 for 4.1 s; ...]" from what the peers published, read within one
  // second (empty for a group of one or without a store). `op` and `seq`:
  // the failing call (null: this rank's oldest call in flight).
  std::string positions(const char* op = nullptr, uint64_t seq = 0) const;

  // The watchdog's visit (every half TPCOMM_WATCHDOG_MS): publishes what is
  // queued, and while a call has waited longer than `stuckAfter`, reads the
  // peers' faults and publishes this rank's position.
  void visit(Clock::time_point now, std::chrono::milliseconds stuckAfter);

 private:
  GroupFault(c10::intrusive_ptr<c10d::Store> store, std::string groupName, int rank, int size,
             std::chrono::milliseconds timeout);
  static constexpr uint32_t kBroken = 1;
  static constexpr uint32_t kSettle = 2;
  struct Call {
    uint64_t ticket;
    uint64_t seq;
    const char* op;
    bool p2p;
    Clock::time_point start;
    std::weak_ptr<Interruptible> release;
  };
  struct Line {
    char kind;  // 'B' or 'R'
    int rank;
    uint64_t seq;
    std::string op;
    std::string why;
  };
  std::vector<Line> readLines() const;
  void publish(const std::string& line);
  // Breaks from a peer's line (nothing to publish: it is in the store).
  void breakFrom(const std::string& why, bool publish);
  bool refusedHereLocked(uint64_t seq) const;

  const c10::intrusive_ptr<c10d::Store> store_;
  const std::string groupName_;
  const int rank_;
  const int size_;
  std::atomic<uint32_t> state_{0};
  mutable std::mutex mutex_;
  std::chrono::milliseconds timeout_;  // by mutex_
  std::string reason_;                 // by mutex_
  std::vector<Call> calls_;            // by mutex_
  // In-thread calls (nothing to release) without the mutex: a slot's seq
  // is 0 while free. The rest go to calls_.
  struct Slot {
    std::atomic<uint64_t> seq{0};
    std::atomic<const char*> op{""};
    std::atomic<int64_t> startNs{0};
  };
  static constexpr uint64_t kSlotTicket = uint64_t{1} << 63;
  static constexpr uint64_t kClaimed = ~uint64_t{0};
  std::array<Slot, 4> slots_;
  // The oldest call in flight, slots and calls_ alike (mutex_ held).
  std::optional<Call> oldestLocked() const;
  uint64_t nextTicket_ = 1;                   // by mutex_
  std::map<uint64_t, std::string> toSettle_;  // by mutex_: refused calls (seq -> op) to settle
  std::set<uint64_t> ownRefusals_;            // by mutex_: every collective refused here
  std::vector<std::string> outbox_;           // by mutex_: lines for the watchdog to append
  std::atomic<uint64_t> startedSeq_{0};       // the highest collective entered or refused
  std::atomic<uint64_t> lastSeq_{0};          // the last collective that left
  std::atomic<const char*> lastOp_{""};
  // Held while the releaser runs, so that clearing it waits for a release.
  std::mutex releaseMutex_;
  std::function<void(const std::string&)> releaser_;  // by releaseMutex_
  std::function<bool()> deviceProbe_;                 // by releaseMutex_
  GlooSockets sockets_;                               // by mutex_
  bool released_ = false;                             // by mutex_
  // Publishes the queued lines (waiting at most a second for the store),
  // then release()s.
  // Within `deadline` for the release's wait (the lines' own write: a
  // second at most).
  void flush(Clock::time_point deadline = Clock::now() + std::chrono::seconds(1));
  // The cause a peer published: a break, or a refusal of a call this rank
  // made ("" when none). mutex_ not held.
  std::pair<std::string, bool> causeIn(const std::vector<Line>& lines);
  // The peers' part of positions() once the group broke (read once).
  mutable std::string brokenPositions_;  // by mutex_
  // Once the group broke: shuts its Gloo connections down, runs the
  // releaser and interrupts the calls in flight (once).
  void release(Clock::time_point deadline);
  // The watchdog thread's own: the position this rank last published, and
  // whether the store stopped answering (then it is not asked again).
  std::string publishedPosition_;
  // The last rooted collective: its sequence number << 16 | root + 1.
  std::atomic<uint64_t> rootOfSeq_{0};
  // Another rank in the same rooted call with another root, from the
  // peers' positions: the reason to break the group, or "".
  std::string rootMismatch(const std::string& op, uint64_t seq, int root);
  bool storeLost_ = false;
  // Serialises this rank's store writes with retire().
  std::mutex writes_;
  bool retired_ = false;  // guarded by writes_
  // Lines taken from outbox_ (by mutex_) and not yet written (flush).
  std::atomic<int> publishing_{0};
  // Until publishing_ is 0, at most until `deadline`.
  void awaitPublishing(Clock::time_point deadline) const;
  // Since when the device probe has said "pending" without a break (the
  // watchdog's own; unset while it says "ended").
  std::optional<Clock::time_point> devicePendingSince_;
  int64_t devicePendingWallMs_ = 0;  // the same moment, wall clock (for positions)
};

// The group whose call this thread runs (the backend sets it around each
// call), so that waits deep inside a route (set-up exchanges, steps between
// hosts) end when that group breaks.
class CurrentFault {
 public:
  explicit CurrentFault(GroupFault* fault);
  ~CurrentFault();
  CurrentFault(const CurrentFault&) = delete;
  CurrentFault& operator=(const CurrentFault&) = delete;
  static GroupFault* get();

 private:
  GroupFault* previous_;
};

// Waits for `work`, a routed backend's work issued inside a call, as
// work.wait(timeout) does, but ends with PeerLost naming the cause when the
// thread's current group breaks first (a point-to-point work is aborted
// then; a collective is left to finish in its backend's thread).
bool waitWork(c10d::Work& work, std::chrono::milliseconds timeout = kNoTimeout);

// TPCOMM_WATCHDOG_MS (0: no watchdog; faults then reach a rank only through
// shared memory or its own calls).
std::chrono::milliseconds watchdogInterval();

}  // namespace tpcomm::coord
