#include "message_queue/collectives/shm_group.hpp"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>

#include "common/error.hpp"
#include "message_queue/collectives/shm_group_internal.hpp"
#include "message_queue/region/futex.hpp"

namespace tpcomm::mq {

namespace {

constexpr uint64_t kMagic = 0x7470636f6d6d7332ULL;  // "tpcomms2"
constexpr uint32_t kVersion = 5;  // 4: the pipelined two-phase allreduce; 5: places in a slot
constexpr int kMaxRanks = 1024;
constexpr auto kSleepSlice = std::chrono::milliseconds(10);
constexpr int kPausePolls = 8;  // rounds of 16 polls before the first sched_yield

// The first failure, in the header's failure word: cause, the rank that
// reported it and the rank it blames, published together by one CAS.
enum FailureCode : uint64_t { kNone = 0, kTimedOut = 1, kDied = 2, kAborted = 3, kLeft = 4 };

// Forks of this process so far, counted in the child (pthread_atfork): a
// group set up before a fork is not the child's to use.
std::atomic<uint64_t> gForks{0};
const bool kCountsForks = [] {
  ::pthread_atfork(nullptr, nullptr, [] { gForks.fetch_add(1, std::memory_order_relaxed); });
  return true;
}();

uint64_t packFailure(uint64_t code, int by, int culprit) {
  return (code << 48) | (static_cast<uint64_t>(by & 0xffffff) << 24) |
         static_cast<uint64_t>((culprit + 1) & 0xffffff);
}

template <typename Named>
std::string describeFailure(uint64_t word, Named named) {
  const uint64_t code = word >> 48;
  const int by = named(static_cast<int>((word >> 24) & 0xffffff));
  const int raw = static_cast<int>(word & 0xffffff) - 1;
  const int culprit = raw >= 0 ? named(raw) : -1;
  if (code == kLeft) {
    return detail::concat("rank ", by, " left the group (it destroyed the group while its peers ",
                          "still use it)");
  }
  const char* cause = code == kTimedOut ? "timed out" : code == kDied ? "lost a peer" : "aborted";
  return detail::concat("rank ", by, " of the group ", cause,
                        culprit >= 0 ? detail::concat(" (rank ", culprit, " died)") : "");
}

}  // namespace

const char* opName(Op op) {
  switch (op) {
    case Op::kBarrier:
      return "barrier";
    case Op::kAllreduce:
      return "allreduce";
    case Op::kAllreduceAddRmsNorm:
      return "allreduce_add_rms_norm";
    case Op::kAllgather:
      return "all_gather";
    case Op::kReduceScatter:
      return "reduce_scatter";
    case Op::kBroadcast:
      return "broadcast";
  }
  return "unknown";
}

std::string ShmGroup::Signature::describe() const {
  const auto op = static_cast<Op>(head >> 56);
  const int dtype = static_cast<int>((head >> 48) & 0xff);
  const int reduction = static_cast<int>((head >> 40) & 0xff);
  const int root = static_cast<int>(static_cast<uint32_t>(head));
  std::string out = opName(op);
  switch (op) {
    case Op::kBarrier:
      return out;
    case Op::kAllgather:
      return detail::concat(out, " of ", count, " bytes", partOf());
    case Op::kBroadcast:
      return detail::concat(out, " of ", count, " bytes from root ", root);
    case Op::kAllreduceAddRmsNorm: {
      double eps;
      std::memcpy(&eps, &extra, sizeof(eps));
      char text[32];
      std::snprintf(text, sizeof(text), "%.9g", eps);
      return detail::concat(out, " ", dtypeName(static_cast<DType>(dtype)), "[", count,
                            "] in rows of ", root, " with eps ", text);
    }
    default:
      break;
  }
  std::string how = reduceKindName(static_cast<ReduceKind>(reduction & 3));
  if (reduction & 4) how = "avg";
  if (reduction & 8) how = "premul_sum";
  return detail::concat(out, " ", how, " ", dtypeName(static_cast<DType>(dtype)), "[", count, "]",
                        partOf());
}
std::string ShmGroup::Signature::partOf() const {
  if ((extra >> 63) == 0) return "";
  return detail::concat(" (tensor ", ((extra >> 32) & 0x7fffffff) + 1, " of a coalesced list of ",
                        static_cast<uint32_t>(extra), ")");
}

struct ShmGroup::Header {
  uint64_t magic;
  uint32_t version;
  int32_t size;
  uint64_t bufferBytes;
  uint64_t twoPhaseMinBytes;
  alignas(kLine) std::atomic<uint64_t> failure;  // packFailure() of the first failure; 0: none
  alignas(kLine) std::atomic<uint32_t> wake;     // futex word: bumped to wake sleepers
  std::atomic<uint32_t> sleepers;
  // abort(why)'s text, for the peers' messages: claimed once (reasonOwner
  // 0 -> 1), written, then its length published (release).
  alignas(kLine) std::atomic<uint32_t> reasonOwner;
  std::atomic<uint32_t> reasonLength;
  char reason[kReasonBytes];
};

struct alignas(kLine) ShmGroup::Control {
  std::atomic<uint64_t> arrived;
  struct {
    std::atomic<uint64_t> head;
    std::atomic<uint64_t> count;
    std::atomic<uint64_t> extra;
  } signature[2];
};

size_t ShmGroup::regionBytes(int size, uint64_t bufferBytes) {
  static_assert(sizeof(Header) <= kControlOffset, "header must fit before the controls");
  TPCOMM_CHECK(size >= 1 && size <= kMaxRanks, kInvalidUsage, "shared-memory group of ", size,
               " ranks (1..", kMaxRanks, ")");
  TPCOMM_CHECK(bufferBytes >= kLine && bufferBytes % kLine == 0 && bufferBytes <= (1ull << 32),
               kInvalidUsage, "shared-memory buffer of ", bufferBytes,
               " bytes: must be a multiple of 64 within 64..4 GiB");
  return dataOffset(size) + static_cast<size_t>(size) * kSlots * bufferBytes;
}

void ShmGroup::initRegion(char* base, int size, uint64_t bufferBytes, uint64_t twoPhaseMinBytes) {
  auto* h = new (base) Header();
  h->magic = kMagic;
  h->version = kVersion;
  h->size = size;
  h->bufferBytes = bufferBytes;
  h->twoPhaseMinBytes = twoPhaseMinBytes;
  for (int r = 0; r < size; ++r) new (base + kControlOffset + kLine * r) Control();
}

ShmGroup::ShmGroup(std::unique_ptr<SharedRegion> region, const ShmGroupOptions& options,
                   std::vector<int32_t> pids)
    : region_(std::move(region)), options_(options), forkGeneration_(gForks.load()) {
  TPCOMM_CHECK(region_ != nullptr, kInvalidUsage, "ShmGroup without a region");
  TPCOMM_CHECK(options_.rank >= 0 && options_.rank < options_.size, kInvalidUsage, "rank ",
               options_.rank, " of a group of ", options_.size);
  TPCOMM_CHECK_EQ(pids.size(), static_cast<size_t>(options_.size), "(one pid per rank)");
  TPCOMM_CHECK_EQ(region_->bytes(), regionBytes(options_.size, options_.bufferBytes),
                  "(shared region size)");
  const Header& h = header();
  TPCOMM_CHECK(h.magic == kMagic && h.version == kVersion && h.size == options_.size &&
                   h.bufferBytes == options_.bufferBytes &&
                   h.twoPhaseMinBytes == options_.twoPhaseMinBytes,
               kSystem, "the shared region is not a tpcomm group of ", options_.size,
               " ranks with ", options_.bufferBytes, "-byte buffers and a two-phase crossover of ",
               options_.twoPhaseMinBytes, " bytes");
  setReduceIsa(options_.reduceIsa);
  setSpin(options_.spin, options_.yield);
  timeoutMs_.store(options_.timeout.count());
  data_ = region_->base() + dataOffset(options_.size);
  for (int32_t pid : pids) peers_.emplace_back(pid);
  // This rank's slots are allocated by this rank, now, on its NUMA node:
  // bound there first where the kernel lets it (a policy of the memfd's, so
  // a peer's touch cannot move them), else first touched by this thread.
  const size_t mine = static_cast<size_t>(slots(options_.rank) - region_->base());
  if (options_.memoryNode >= 0)
    memoryBinding_ = region_->bindToNode(mine, kSlots * options_.bufferBytes, options_.memoryNode);
  region_->prefault(mine, kSlots * options_.bufferBytes, true);
  if (options_.threads > 1)
    pool_ =
        std::make_unique<WorkerPool>(options_.threads, options_.workerCpus, options_.workerSpin);
}

ShmGroup::~ShmGroup() {
  if (forked()) {
    (void)pool_.release();  // its threads are the parent's: nothing to join here
    return;
  }
  if (options_.size > 1) publishFailure(kLeft, options_.rank);
}

bool ShmGroup::forked() const { return gForks.load(std::memory_order_relaxed) != forkGeneration_; }

void ShmGroup::checkNotForked() const {
  TPCOMM_CHECK(!forked(), kInvalidUsage, "a shared-memory collective called in a process (pid ",
               ::getpid(), ") forked from the one that set the group up (rank ", options_.rank,
               "): a forked child cannot use its parent's group; create a new group in the child");
}

void ShmGroup::prefaultPeers() {
  for (int r = 0; r < options_.size; ++r) {
    if (r == options_.rank) continue;
    region_->prefault(static_cast<size_t>(slots(r) - region_->base()),
                      kSlots * options_.bufferBytes, false);
  }
}

void ShmGroup::setSpin(std::chrono::microseconds spin, bool yield) {
  spinUs_.store(spin.count(), std::memory_order_relaxed);
  yield_.store(yield, std::memory_order_relaxed);
}

ShmWaitStats ShmGroup::waitStats() const {
  ShmWaitStats out;
  out.waits = waits_.load(std::memory_order_relaxed);
  out.atOnce = waitsAtOnce_.load(std::memory_order_relaxed);
  out.metPolling = waitsPolled_.load(std::memory_order_relaxed);
  out.slept = waitsSlept_.load(std::memory_order_relaxed);
  out.pollNs = pollNs_.load(std::memory_order_relaxed);
  out.sleepNs = sleepNs_.load(std::memory_order_relaxed);
  for (int b = 0; b < ShmWaitStats::kLateBuckets; ++b)
    out.late[b] = late_[b].load(std::memory_order_relaxed);
  return out;
}

ShmGroup::Header& ShmGroup::header() const { return *reinterpret_cast<Header*>(region_->base()); }

ShmGroup::Control& ShmGroup::control(int r) const {
  return *reinterpret_cast<Control*>(region_->base() + kControlOffset + kLine * r);
}

char* ShmGroup::slots(int r) const {
  return data_ + static_cast<size_t>(r) * kSlots * options_.bufferBytes;
}

char* ShmGroup::slot(int r, uint64_t chunk) const {
  return slots(r) + chunk % kSlots * options_.bufferBytes + place_;
}

void ShmGroup::beginCall(size_t slotBytes) {
  // A call whose chunks fill at most half a slot takes the next place of
  // its size (chunks of one parity, k / 2, count the calls), so calls of
  // one size write a line again only after they went through every place
  // of both slots, when the peers that read it have let it go. Rewriting a
  // line a peer's core has just read waits for that copy to be invalidated
  // (`python -m tpcomm.bench cpu --reuse`; 2-core AMD EPYC Zen 4: 64 KiB
  // written in 9.7 us into the same two places each time, 4.0 us into 32
  // in turn). Safe, since chunks of one parity are two apart, with a step
  // between (the header comment's protocol): any chunk may overlap the
  // one two before it. A call of several chunks fills more than half a
  // slot and stays at the start.
  place_ = 0;
  const size_t window = std::min<size_t>(options_.bufferBytes, kMovingWindowBytes);
  if (slotBytes < kMovingMinBytes || slotBytes > window / 2) return;
  const size_t stride = alignUp(slotBytes, kPage);
  place_ = chunks_ / kSlots % (window / stride) * stride;
}

void ShmGroup::setReduceIsa(ReduceIsa isa) {
  reduceIsa_.store(cpuRunsReduceIsa(isa) ? isa : bestReduceIsa(), std::memory_order_relaxed);
}

void ShmGroup::setTimeout(std::chrono::milliseconds timeout) { timeoutMs_.store(timeout.count()); }

std::chrono::milliseconds ShmGroup::timeout() const {
  return std::chrono::milliseconds(timeoutMs_.load());
}

std::string ShmGroup::failure() const {
  std::lock_guard<std::mutex> lock(failureMutex_);
  return failure_;
}

void ShmGroup::setFailure(const std::string& message) {
  std::lock_guard<std::mutex> lock(failureMutex_);
  if (failure_.empty()) failure_ = message;
}

void ShmGroup::throwIfFailed() {
  const std::string earlier = failure();
  TPCOMM_CHECK(earlier.empty(), kPeerLost, "the group's shared-memory collectives stopped after ",
               "an earlier failure: ", earlier);
  // A failure another rank reported ends this rank's calls too, even those
  // whose peers had all arrived already.
  const uint64_t word = header().failure.load(std::memory_order_acquire);
  if (word == 0) return;
  setFailure(describePublished(word));
  TPCOMM_THROW(kPeerLost,
               "the group's shared-memory collectives stopped: ", describePublished(word));
}

void ShmGroup::publishFailure(uint64_t code, int culprit) {
  Header& h = header();
  uint64_t none = 0;
  h.failure.compare_exchange_strong(none, packFailure(code, options_.rank, culprit));
  h.wake.fetch_add(1);
  futexWakeAll(h.wake);
}

void ShmGroup::abort(const std::string& why) {
  if (!forked()) {
    Header& h = header();
    uint32_t none = 0;
    if (!why.empty() && h.reasonOwner.compare_exchange_strong(none, 1)) {
      const size_t n = std::min(why.size(), kReasonBytes);
      std::memcpy(h.reason, why.data(), n);
      h.reasonLength.store(static_cast<uint32_t>(n), std::memory_order_release);
    }
    publishFailure(kAborted, -1);
  }
  setFailure(why);
}

std::string ShmGroup::describePublished(uint64_t word) const {
  std::string text = describeFailure(word, [this](int r) { return named(r); });
  const Header& h = header();
  const uint32_t n = h.reasonLength.load(std::memory_order_acquire);
  if ((word >> 48) == kAborted && n > 0 && n <= kReasonBytes)
    text += ": " + std::string(h.reason, n);
  return text;
}

void ShmGroup::fail(int code, int culprit, const std::string& message) {
  publishFailure(static_cast<uint64_t>(code), culprit);
  setFailure(message);
  if (code == kTimedOut) TPCOMM_THROW(kTimeout, message);
  TPCOMM_THROW(kPeerLost, message);
}

void ShmGroup::step(const Signature& signature) {
  const uint64_t s = ++steps_;
  Control& mine = control(options_.rank);
  mine.signature[s & 1].head.store(signature.head, std::memory_order_relaxed);
  mine.signature[s & 1].count.store(signature.count, std::memory_order_relaxed);
  mine.signature[s & 1].extra.store(signature.extra, std::memory_order_relaxed);
  mine.arrived.store(s, std::memory_order_seq_cst);  // publishes this rank's slot
  Header& h = header();
  wakeSleepers(h.wake, h.sleepers);
  waitAll(s, signature);
  const auto theirs = [&](int r) {
    const auto& theirs = control(r).signature[s & 1];
    return Signature(theirs.head.load(std::memory_order_relaxed),
                     theirs.count.load(std::memory_order_relaxed),
                     theirs.extra.load(std::memory_order_relaxed));
  };
  bool agree = true;
  for (int r = 0; r < options_.size; ++r) agree &= theirs(r) == signature;
  if (agree) return;
  // Every rank sees the same signatures at this step, so every rank throws
  // here, with the same step count. Calls that disagree may have used
  // different numbers of chunks (a barrier against an allreduce): restart
  // the chunk count from the step, which every rank agrees on. That is
  // safe: every read of an earlier chunk ended before its reader arrived
  // here, and nobody reads this call's chunk.
  chunks_ = s;
  std::string calls;
  for (int r = 0; r < options_.size; ++r)
    calls +=
        detail::concat(r == 0 ? "" : "; ", "rank ", named(r), " called ", theirs(r).describe());
  TPCOMM_THROW(kInvalidUsage, "ranks disagree on a shared-memory collective: ", calls);
}

void ShmGroup::waitAll(uint64_t s, const Signature& signature) {
  Header& h = header();
  const int n = options_.size;
  int next = 0;  // ranks below `next` are known to have arrived
  const auto ready = [&] {
    while (next < n && control(next).arrived.load(std::memory_order_acquire) >= s) ++next;
    return next == n;
  };
  const auto count = [](std::atomic<uint64_t>& field, uint64_t by) {
    field.store(field.load(std::memory_order_relaxed) + by, std::memory_order_relaxed);
  };
  count(waits_, 1);
  if (ready()) {
    count(waitsAtOnce_, 1);
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  const auto since = [](std::chrono::steady_clock::time_point from) {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                             from)
            .count());
  };
  const auto lateBy = [&](uint64_t ns) {
    int b = 0;
    for (uint64_t us = ns / 2000; us > 0 && b + 1 < ShmWaitStats::kLateBuckets; us >>= 1) ++b;
    count(late_[b], 1);
  };
  const auto spinUntil = start + std::chrono::microseconds(spinUs_.load(std::memory_order_relaxed));
  const auto limit = timeout();
  const auto deadline = start + limit;
  const auto failed = [&] { return h.failure.load(std::memory_order_acquire) != 0; };
  const auto joinFailure = [&] {
    fail(kAborted, -1,
         detail::concat(describePublished(h.failure.load()), " during ", signature.describe()));
  };
  // A rank that arrived, finished the call and then failed or left the
  // group published the failure after its arrival: all arrived wins.
  if (pollUntil(
          ready, spinUntil, kPausePolls,
          [&] {
            if (failed() && !ready()) joinFailure();
          },
          yield_.load(std::memory_order_relaxed))) {
    const uint64_t polled = since(start);
    count(waitsPolled_, 1);
    count(pollNs_, polled);
    lateBy(polled);
    return;
  }
  const auto slept = std::chrono::steady_clock::now();
  count(waitsSlept_, 1);
  count(pollNs_, static_cast<uint64_t>(
                     std::chrono::duration_cast<std::chrono::nanoseconds>(slept - start).count()));
  // Counted on every way out, the failures' included.
  struct SleepClock {
    std::function<void()> done;
    ~SleepClock() { done(); }
  } sleepClock{[&] {
    count(sleepNs_, since(slept));
    lateBy(since(start));
  }};
  auto lastLivenessCheck = start;
  while (true) {
    auto now = std::chrono::steady_clock::now();
    const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - now);
    const auto slice = failed() || now >= deadline
                           ? std::chrono::microseconds(0)
                           : std::min<std::chrono::microseconds>(left, kSleepSlice);
    // A published failure bumps the word too: it ends the sleep.
    if (sleepOn(
            h.wake, h.sleepers, [&] { return ready() || failed(); }, slice) &&
        ready())
      return;
    if (failed()) {
      if (ready()) return;  // every rank arrived before the failure was published
      joinFailure();
    }
    now = std::chrono::steady_clock::now();
    // Peers' liveness at most once per sleep slice (every arrival wakes
    // every sleeper; the check costs system calls).
    if (now - lastLivenessCheck >= kSleepSlice || now >= deadline) {
      lastLivenessCheck = now;
      for (int r = next; r < n; ++r) {
        if (control(r).arrived.load(std::memory_order_acquire) >= s) continue;
        // Dead, unless it arrived (and left) after the load above.
        if (!peers_[r].alive() && control(r).arrived.load(std::memory_order_acquire) < s) {
          fail(kDied, r,
               detail::concat("rank ", named(r), " (pid ", peers_[r].pid(),
                              ") died before it reached ",
                              signature.describe()));
        }
      }
    }
    if (now >= deadline) {
      if (ready()) return;  // the last peer arrived just now
      std::string missing;
      for (int r = next; r < n; ++r) {
        if (control(r).arrived.load(std::memory_order_acquire) < s)
          missing += detail::concat(missing.empty() ? "" : ", ", named(r));
      }
      fail(kTimedOut, -1,
           detail::concat("ranks ", missing, " did not reach ", signature.describe(), " within ",
                          limit.count(), " ms"));
    }
  }
}

}  // namespace tpcomm::mq
