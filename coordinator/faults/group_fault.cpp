#include "coordinator/faults/group_fault.hpp"

#include <time.h>

#include <algorithm>
#include <cstdlib>
#include <future>
#include <optional>
#include <thread>

#include "common/error.hpp"
#include "coordinator/faults/fault_watchdog.hpp"
#include "coordinator/group_life.hpp"

namespace tpcomm::coord {

namespace {

using namespace std::chrono_literals;

const std::string kFaultsKey = "tpcomm/faults";

std::string positionKey(int rank) { return "tpcomm/pos/" + std::to_string(rank); }

int64_t wallMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// One line of the faults key: no newline inside.
std::string oneLine(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

std::string secondsText(int64_t ms) {
  const int64_t tenths = std::max<int64_t>(ms, 0) / 100;
  return std::to_string(tenths / 10) + "." + std::to_string(tenths % 10) + " s";
}

// Runs `read` (store reads, which block while the store does not answer)
// on a thread of its own; its answer, or nothing after one second.
template <typename Read>
std::optional<std::string> withinOneSecond(Read read) {
  auto answer = std::make_shared<std::promise<std::string>>();
  auto future = answer->get_future();
  std::thread([answer, read = std::move(read)] {
    try {
      answer->set_value(read());
    } catch (...) {
      answer->set_value(std::string());
    }
  }).detach();
  if (future.wait_for(1s) != std::future_status::ready) return std::nullopt;
  return future.get();
}

}  // namespace

std::shared_ptr<GroupFault> GroupFault::create(c10::intrusive_ptr<c10d::Store> store,
                                               std::string groupName, int rank, int size,
                                               std::chrono::milliseconds timeout) {
  std::shared_ptr<GroupFault> fault(
      new GroupFault(std::move(store), std::move(groupName), rank, size, timeout));
  if (fault->store_ && size > 1) Watchdog::get().add(fault);
  return fault;
}

GroupFault::GroupFault(c10::intrusive_ptr<c10d::Store> store, std::string groupName, int rank,
                       int size, std::chrono::milliseconds timeout)
    : store_(std::move(store)),
      groupName_(std::move(groupName)),
      rank_(rank),
      size_(size),
      timeout_(timeout) {}

GroupFault::~GroupFault() = default;

std::string GroupFault::reason() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reason_;
}

void GroupFault::setTimeout(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  timeout_ = timeout;
}

void GroupFault::setReleaser(std::function<void(const std::string&)> releaser) {
  std::lock_guard<std::mutex> lock(releaseMutex_);
  releaser_ = std::move(releaser);
}

void GroupFault::setDeviceProbe(std::function<bool()> probe) {
  std::lock_guard<std::mutex> lock(releaseMutex_);
  deviceProbe_ = std::move(probe);
}

namespace {

// A coarse monotonic clock (a few ns; its ms resolution is plenty for a
// 200 ms threshold), as the steady clock's time point.
GroupFault::Clock::time_point coarseNow() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return GroupFault::Clock::time_point(std::chrono::seconds(ts.tv_sec) +
                                       std::chrono::nanoseconds(ts.tv_nsec));
}

void raiseTo(std::atomic<uint64_t>& value, uint64_t seq) {
  uint64_t seen = value.load(std::memory_order_relaxed);
  while (seq > seen && !value.compare_exchange_weak(seen, seq, std::memory_order_relaxed)) {
  }
}

}  // namespace

uint64_t GroupFault::enter(uint64_t seq, const char* op, bool p2p,
                           std::weak_ptr<Interruptible> release) {
  const auto now = coarseNow();
  if (!p2p) raiseTo(startedSeq_, seq);
  if (!p2p && seq != 0 && release.expired()) {
    for (size_t i = 0; i < slots_.size(); ++i) {
      // Claimed with a sentinel, filled, then published: a reader never
      // sees a call without its op and start.
      uint64_t free = 0;
      if (slots_[i].seq.compare_exchange_strong(free, kClaimed, std::memory_order_acq_rel)) {
        slots_[i].op.store(op, std::memory_order_relaxed);
        slots_[i].startNs.store(now.time_since_epoch().count(), std::memory_order_relaxed);
        slots_[i].seq.store(seq, std::memory_order_release);
        return kSlotTicket | i;
      }
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t ticket = nextTicket_++;
  calls_.push_back(Call{ticket, seq, op, p2p, now, std::move(release)});
  return ticket;
}

void GroupFault::leave(uint64_t ticket) {
  if (ticket & kSlotTicket) {
    Slot& slot = slots_[ticket & 0xff];
    lastSeq_.store(slot.seq.load(std::memory_order_relaxed), std::memory_order_relaxed);
    lastOp_.store(slot.op.load(std::memory_order_relaxed), std::memory_order_relaxed);
    slot.seq.store(0, std::memory_order_release);
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = calls_.begin(); it != calls_.end(); ++it) {
    if (it->ticket == ticket) {
      if (!it->p2p) {
        lastSeq_.store(it->seq, std::memory_order_relaxed);
        lastOp_.store(it->op, std::memory_order_relaxed);
      }
      calls_.erase(it);
      return;
    }
  }
}

bool GroupFault::idle() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !oldestLocked().has_value();
}

std::optional<GroupFault::Call> GroupFault::oldestLocked() const {
  std::optional<Call> oldest;
  for (const auto& call : calls_) {
    if (!oldest || call.start < oldest->start) oldest = call;
  }
  for (const auto& slot : slots_) {
    const uint64_t seq = slot.seq.load(std::memory_order_acquire);
    if (seq == 0 || seq == kClaimed) continue;
    const auto start =
        Clock::time_point(Clock::duration(slot.startNs.load(std::memory_order_acquire)));
    if (!oldest || start < oldest->start) {
      oldest = Call{0, seq, slot.op.load(std::memory_order_relaxed), false, start, {}};
    }
  }
  return oldest;
}

bool GroupFault::refusedHereLocked(uint64_t seq) const { return ownRefusals_.count(seq) != 0; }

void GroupFault::refused(uint64_t seq, const char* op, const std::string& why) {
  if (size_ < 2) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    raiseTo(startedSeq_, seq);
    ownRefusals_.insert(seq);
    if (!store_) return;
    toSettle_[seq] = op;
    state_.fetch_or(kSettle, std::memory_order_acq_rel);
  }
  try {
    publish(detail::concat("R ", rank_, " ", seq, " ", op, " ", oneLine(why), "\n"));
  } catch (...) {
    // A store that went away: the caller's own error is what it raises;
    // the settle wait then reports the store.
  }
}

void GroupFault::breakGroup(const std::string& why) { breakFrom(why, true); }

void GroupFault::breakFrom(const std::string& why, bool publishIt) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!reason_.empty()) return;
    reason_ = why;
    if (publishIt && store_ && size_ > 1) {
      outbox_.push_back(detail::concat("B ", rank_, " ", oneLine(why), "\n"));
    }
  }
  state_.fetch_or(kBroken, std::memory_order_acq_rel);
  // The break is published first, then released here (the peers that see
  // a released wait or a closed connection find the cause in the store).
  if (Watchdog::get().running() && store_ && size_ > 1) {
    Watchdog::get().wake(shared_from_this());
  } else {
    flush();
  }
}

void GroupFault::addGlooSockets(const GlooSockets& sockets) {
  std::lock_guard<std::mutex> lock(mutex_);
  sockets_.add(sockets);
  if (released_) sockets.shutdownAll();
}

GlooSockets GroupFault::glooSockets() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return sockets_;
}

void GroupFault::flush(Clock::time_point deadline) {
  std::vector<std::string> out;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    out.swap(outbox_);
    if (!out.empty()) publishing_.fetch_add(1);
  }
  if (!out.empty()) {
    // At most a second for a store that does not answer (one deadline for
    // the whole flush): the local release must not wait longer for it.
    auto self = shared_from_this();
    try {
      withinOneSecond([self, out] {
        struct Done {
          GroupFault* fault;
          ~Done() { fault->publishing_.fetch_sub(1); }
        } done{self.get()};
        for (const auto& line : out) self->publish(line);
        return std::string();
      });
    } catch (const std::exception&) {
      // No thread to write them (std::thread refused): dropped, not waited for.
      publishing_.fetch_sub(1);
    }
  }
  release(deadline);
}

void GroupFault::publishQueued() {
  const auto deadline = Clock::now() + 1s;
  flush(deadline);
  awaitPublishing(deadline);
}

void GroupFault::awaitPublishing(Clock::time_point deadline) const {
  while (publishing_.load() > 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void GroupFault::release(Clock::time_point deadline) {
  if (!broken()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (released_) return;
  }
  // A break another thread took from the queue is written before the
  // connections close (a peer whose call fails on them reads the cause),
  // within what is left of the flush's second.
  awaitPublishing(deadline);
  std::string why;
  std::vector<std::shared_ptr<Interruptible>> waiting;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (released_) return;
    released_ = true;
    why = reason_;
    sockets_.shutdownAll();
    for (const auto& call : calls_) {
      if (auto r = call.release.lock()) waiting.push_back(std::move(r));
    }
  }
  {
    std::lock_guard<std::mutex> lock(releaseMutex_);
    if (releaser_) releaser_(why);
  }
  for (const auto& r : waiting) r->interrupt(why);
}

void GroupFault::retire() {
  awaitPublishing(Clock::now() + 1s);
  std::lock_guard<std::mutex> lock(writes_);
  retired_ = true;
}

void GroupFault::publish(const std::string& line) {
  if (!store_) return;
  std::lock_guard<std::mutex> lock(writes_);
  if (retired_) return;
  store_->append(kFaultsKey, std::vector<uint8_t>(line.begin(), line.end()));
}

std::vector<GroupFault::Line> GroupFault::readLines() const {
  std::vector<Line> lines;
  if (!store_) return lines;
  const auto read = readWithoutWaiting(store_, kFaultsKey);
  if (!read) return lines;
  const std::vector<uint8_t>& bytes = *read;
  for (const std::string& row : detail::splitLines(std::string(bytes.begin(), bytes.end()))) {
    // "B <rank> <why>" or "R <rank> <seq> <op> <why>"
    Line line{};
    if (row.size() < 3 || (row[0] != 'B' && row[0] != 'R') || row[1] != ' ') continue;
    line.kind = row[0];
    char* next = nullptr;
    line.rank = static_cast<int>(std::strtol(row.c_str() + 2, &next, 10));
    std::string rest = next && *next == ' ' ? std::string(next + 1) : std::string();
    if (line.kind == 'R') {
      line.seq = std::strtoull(rest.c_str(), &next, 10);
      rest = next && *next == ' ' ? std::string(next + 1) : std::string();
      const size_t space = rest.find(' ');
      line.op = rest.substr(0, space);
      rest = space == std::string::npos ? std::string() : rest.substr(space + 1);
    }
    line.why = rest;
    lines.push_back(std::move(line));
  }
  return lines;
}

void GroupFault::checkBeforeCall(const char* op) {
  if (broken()) {
    TPCOMM_THROW(kPeerLost, "the group is unusable: ", reason(), positions());
  }
  uint64_t seq = 0;
  std::string refusedOp;
  std::chrono::milliseconds timeout;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (toSettle_.empty()) return;
    seq = toSettle_.begin()->first;
    refusedOp = toSettle_.begin()->second;
    timeout = timeout_;
  }
  // This rank refused call #seq: go on only once every peer refused it too
  // (its next call would otherwise pair with a peer's #seq).
  const auto deadline = Clock::now() + timeout;
  auto pause = 200us;
  for (;;) {
    std::vector<bool> refusedToo(size_, false);
    refusedToo[rank_] = true;
    for (const auto& line : readLines()) {
      if (line.kind == 'B' && line.rank != rank_) breakFrom(line.why, false);
      if (line.kind == 'R' && line.seq == seq && line.rank >= 0 && line.rank < size_) {
        refusedToo[line.rank] = true;
      }
    }
    if (broken()) {
      TPCOMM_THROW(kPeerLost, "the group is unusable: ", reason(), positions());
    }
    if (std::all_of(refusedToo.begin(), refusedToo.end(), [](bool b) { return b; })) break;
    if (Clock::now() >= deadline) {
      std::string missing;
      for (int r = 0; r < size_; ++r) {
        if (!refusedToo[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      breakGroup(detail::concat("rank ", rank_, " refused ", refusedOp, " #", seq, " and ranks ",
                                missing,
                                " neither refused it nor reported "
                                "being in it within the group's timeout"));
      TPCOMM_THROW(kTimeout, "before ", op, ": ", reason());
    }
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, 10ms);
  }
  bool more = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    toSettle_.erase(seq);
    if (toSettle_.empty()) {
      state_.fetch_and(~kSettle, std::memory_order_acq_rel);
    } else {
      more = true;
    }
  }
  if (more) checkBeforeCall(op);  // another thread's refusal, older or newer
}

void GroupFault::visit(Clock::time_point now, std::chrono::milliseconds stuckAfter) {
  flush();
  bool stuck = false, deviceOnly = false;
  std::string position, stuckIn, stuckOp;
  uint64_t stuckSeq = 0;
  int stuckRoot = -1;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::optional<Call> oldest = oldestLocked();
    if (oldest && now - oldest->start >= stuckAfter) {
      stuck = true;
      stuckIn = detail::concat(oldest->op, " #", oldest->seq);
      const int64_t sinceMs =
          wallMs() -
          std::chrono::duration_cast<std::chrono::milliseconds>(now - oldest->start).count();
      const uint64_t rooted = rootOfSeq_.load(std::memory_order_relaxed);
      if (!oldest->p2p && (rooted >> 16) == oldest->seq && (rooted & 0xffff) != 0) {
        stuckRoot = static_cast<int>(rooted & 0xffff) - 1;
        stuckOp = oldest->op;
        stuckSeq = oldest->seq;
      }
      position = detail::concat("in ", oldest->op, " #", oldest->seq, oldest->p2p ? " (p2p)" : "",
                                stuckRoot >= 0 ? detail::concat(" (root ", stuckRoot, ")") : "",
                                " since ", sinceMs);
    } else if (!publishedPosition_.empty() && publishedPosition_.rfind("in ", 0) == 0) {
      position = detail::concat("after ", lastOp_.load(), " #", lastSeq_.load());
    }
  }
  if (!stuck && !broken()) {
    // Device work (the custom kernel) that may wait for a peer: its host
    // call returned at once, so only the GPU says whether it is stuck.
    bool pending = false;
    {
      std::lock_guard<std::mutex> lock(releaseMutex_);
      pending = deviceProbe_ && deviceProbe_();
    }
    if (!pending) {
      devicePendingSince_.reset();
    } else if (!devicePendingSince_) {
      devicePendingSince_ = now;
      devicePendingWallMs_ = wallMs();
    } else if (now - *devicePendingSince_ >= stuckAfter) {
      // A GPU merely busy with earlier work looks the same: reading the
      // faults (one store check while there are none) is all it costs.
      stuck = deviceOnly = true;
      stuckIn = detail::concat("the custom kernel's call (#", startedSeq_.load(), " or before)");
      position = detail::concat("in ", lastOp_.load(), " #", lastSeq_.load(),
                                " (on the GPU, custom kernel) since ", devicePendingWallMs_);
    }
  }
  if (!store_ || storeLost_) return;
  std::pair<std::string, bool> found;
  try {
    if (!position.empty() && position != publishedPosition_) {
      std::lock_guard<std::mutex> lock(writes_);
      if (retired_) return;
      store_->set(positionKey(rank_), std::vector<uint8_t>(position.begin(), position.end()));
      publishedPosition_ = position;
    }
    if (!stuck || broken()) return;
    found = causeIn(readLines());
    if (found.first.empty() && stuckRoot >= 0) {
      found = {rootMismatch(stuckOp, stuckSeq, stuckRoot), true};
    }
  } catch (const std::exception& e) {
    // The store's host (usually rank 0) is gone: nothing will answer this
    // rank's call either. Asked once (the store logs every failed request).
    storeLost_ = true;
    // Device work may only be queued behind a busy GPU: no break for it (the
    // kernel still ends at its own timeout).
    if (stuck && !deviceOnly && !broken()) {
      std::string what = e.what();
      what = what.substr(0, what.find('\n'));
      breakFrom(detail::concat("the group's store stopped answering (", what, ") while rank ",
                               rank_, " was in ", stuckIn, ": the rank that hosts it may be gone"),
                false);
    }
    return;
  }
  // A peer's break is in the store already; a refusal found here is news.
  if (!found.first.empty()) breakFrom(found.first, found.second);
}

std::string GroupFault::rootMismatch(const std::string& op, uint64_t seq, int root) {
  const std::string same = detail::concat("in ", op, " #", seq, " (root ");
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const auto read = readWithoutWaiting(store_, positionKey(r));
    if (!read) continue;
    const std::vector<uint8_t>& bytes = *read;
    const std::string value(bytes.begin(), bytes.end());
    if (value.rfind(same, 0) != 0) continue;
    const int theirs = std::atoi(value.c_str() + same.size());
    if (theirs != root) {
      return detail::concat("rank ", r, " called ", op, " #", seq, " with root ", theirs,
                            " and rank ", rank_, " with root ", root,
                            ": every rank must give a rooted collective the same root");
    }
  }
  return "";
}

std::pair<std::string, bool> GroupFault::causeIn(const std::vector<Line>& lines) {
  const uint64_t started = startedSeq_.load();
  for (const auto& line : lines) {
    if (line.rank == rank_) continue;
    if (line.kind == 'B') return {line.why, false};
    bool mine = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      mine = refusedHereLocked(line.seq);
    }
    if (!mine && line.seq <= started) {
      return {detail::concat("rank ", line.rank, " refused ", line.op, " #", line.seq, " (",
                             line.why, ") while rank ", rank_, " made that call"),
              true};
    }
  }
  return {"", false};
}

void GroupFault::learnFromPeers() {
  if (!store_ || size_ < 2 || broken()) return;
  auto self = shared_from_this();
  // The answer's first character says whether it is a refusal found here
  // (news to publish) or a peer's break (in the store already).
  const auto cause = withinOneSecond([self] {
    auto found = self->causeIn(self->readLines());
    return found.first.empty() ? std::string() : (found.second ? "R" : "B") + found.first;
  });
  if (!cause || cause->empty()) return;
  breakFrom(cause->substr(1), (*cause)[0] == 'R');
}

std::string GroupFault::positions(const char* op, uint64_t seq) const {
  if (!store_ || size_ < 2) return "";
  std::string own;
  if (op != nullptr) {
    own = detail::concat("this rank (", rank_, ") in ", op, " #", seq);
  } else {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::optional<Call> oldest = oldestLocked();
    if (oldest) {
      own = detail::concat("this rank (", rank_, ") in ", oldest->op, " #", oldest->seq);
    } else if (lastSeq_.load() == 0) {
      own = detail::concat("this rank (", rank_, ") finished no collective yet");
    } else {
      own = detail::concat("this rank (", rank_, ") after ", lastOp_.load(), " #", lastSeq_.load());
    }
  }
  {
    // Once broken, the peers' part is read once (every released call of
    // the group names it; a slow store then costs one second, not one each).
    std::lock_guard<std::mutex> lock(mutex_);
    if (!brokenPositions_.empty()) return " [across ranks: " + own + brokenPositions_ + "]";
  }
  const bool wasBroken = broken();
  auto self = shared_from_this();
  std::string peers =
      withinOneSecond([self] {
        std::string text;
        try {
          const int64_t now = wallMs();
          int said = 0;
          for (int r = 0; r < self->size_ && said < 32; ++r) {
            if (r == self->rank_) continue;
            const auto read = readWithoutWaiting(self->store_, positionKey(r));
            if (!read) continue;
            const std::vector<uint8_t>& bytes = *read;
            std::string value(bytes.begin(), bytes.end());
            const size_t since = value.find(" since ");
            if (since != std::string::npos) {
              const int64_t start = std::strtoll(value.c_str() + since + 7, nullptr, 10);
              value = value.substr(0, since) + " for " + secondsText(now - start);
            }
            text += detail::concat("; rank ", r, ": ", value);
            ++said;
          }
          if (said == 0) text = "; no peer has waited in a call of this group";
        } catch (const std::exception& e) {
          // c10's errors carry a stack trace after their first line.
          const std::string what = e.what();
          text = "; the peers' positions are unreadable: " + what.substr(0, what.find('\n'));
        }
        return text;
      }).value_or("; the store did not answer within 1 s");
  if (wasBroken) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (brokenPositions_.empty()) brokenPositions_ = peers;
  }
  return " [across ranks: " + own + peers + "]";
}

}  // namespace tpcomm::coord
