#include "message_queue/shm_group.hpp"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>

#include "coordinator/common/error.hpp"
#include "message_queue/futex.hpp"

namespace tpcomm::mq {

namespace {

constexpr uint64_t kMagic = 0x7470636f6d6d7332ULL;  // "tpcomms2"
constexpr uint32_t kVersion = 2;
constexpr size_t kLine = 64;
constexpr size_t kControlOffset = 256;
constexpr size_t kPage = 4096;
constexpr int kMaxRanks = 1024;
constexpr auto kSleepSlice = std::chrono::milliseconds(10);
constexpr int kPausePolls = 8;  // rounds of 16 polls before the first sched_yield
// The least a worker thread is given of a copy or reduction (a smaller part
// costs more to hand over than it saves).
constexpr size_t kSplitMinBytes = 256 << 10;

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

std::string describeFailure(uint64_t word) {
  const uint64_t code = word >> 48;
  const int by = static_cast<int>((word >> 24) & 0xffffff);
  const int culprit = static_cast<int>(word & 0xffffff) - 1;
  if (code == kLeft) {
    return detail::concat("rank ", by, " left the group (it destroyed the group while its peers ",
                          "still use it)");
  }
  const char* cause = code == kTimedOut ? "timed out" : code == kDied ? "lost a peer" : "aborted";
  return detail::concat("rank ", by, " of the group ", cause,
                        culprit >= 0 ? detail::concat(" (rank ", culprit, " died)") : "");
}

enum class Op : uint8_t {
  kBarrier = 1,
  kAllreduce,
  kAllgather,
  kReduceScatter,
  kBroadcast,
  kAllreduceAddRmsNorm
};

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

int reductionCode(const ReduceSpec& spec) {
  return static_cast<int>(spec.kind) | (spec.divisor != 1 ? 4 : 0) | (spec.premultiply ? 8 : 0);
}

}  // namespace

// What every rank of one call must agree on: op, dtype, reduction and root
// in `head`, the element (or byte) count in full in `count`, and in `extra`
// the fused call's eps (its bits) or the call's place in a coalesced list
// (top bit set, then index and length; 0 for a call on its own).
struct ShmGroup::Signature {
  uint64_t head = 0;
  uint64_t count = 0;
  uint64_t extra = 0;
  Signature(int op, int dtype, int reduction, int root, uint64_t n, uint64_t x = 0)
      : head((static_cast<uint64_t>(op) << 56) | (static_cast<uint64_t>(dtype & 0xff) << 48) |
             (static_cast<uint64_t>(reduction & 0xff) << 40) |
             static_cast<uint64_t>(static_cast<uint32_t>(root))),
        count(n),
        extra(x) {}
  Signature(uint64_t h, uint64_t c, uint64_t x) : head(h), count(c), extra(x) {}
  static uint64_t ofPart(const ShmPart& part) {
    if (part.of <= 1) return 0;
    return (1ull << 63) | (static_cast<uint64_t>(part.index & 0x7fffffff) << 32) | part.of;
  }
  static uint64_t ofEps(double eps) {
    uint64_t bits;
    std::memcpy(&bits, &eps, sizeof(bits));
    return bits;
  }
  bool operator==(const Signature& o) const {
    return head == o.head && count == o.count && extra == o.extra;
  }
  std::string describe() const {
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
  std::string partOf() const {
    if ((extra >> 63) == 0) return "";
    return detail::concat(" (tensor ", ((extra >> 32) & 0x7fffffff) + 1, " of a coalesced list of ",
                          static_cast<uint32_t>(extra), ")");
  }
};

namespace {

size_t alignUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

size_t dataOffset(int size) { return alignUp(kControlOffset + kLine * size, kPage); }

// Elements of each rank's slice in a two-phase chunk of n elements: whole
// cache lines, so ranks never write the same line.
size_t sliceElements(size_t n, int size, size_t elementBytes) {
  const size_t perLine = kLine / elementBytes;
  return alignUp((n + size - 1) / size, perLine);
}

}  // namespace

struct ShmGroup::Header {
  uint64_t magic;
  uint32_t version;
  int32_t size;
  uint64_t bufferBytes;
  uint64_t twoPhaseMinBytes;
  alignas(kLine) std::atomic<uint64_t> failure;  // packFailure() of the first failure; 0: none
  alignas(kLine) std::atomic<uint32_t> wake;     // futex word: bumped to wake sleepers
  std::atomic<uint32_t> sleepers;
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
  return dataOffset(size) + static_cast<size_t>(size) * 2 * bufferBytes;
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
  sources_.resize(options_.size);
  for (int32_t pid : pids) peers_.emplace_back(pid);
  // This rank's halves are allocated by this rank (on its NUMA node), now.
  region_->prefault(static_cast<size_t>(half(options_.rank, 0) - region_->base()),
                    2 * options_.bufferBytes, true);
  if (options_.threads > 1) pool_ = std::make_unique<WorkerPool>(options_.threads);
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
    region_->prefault(static_cast<size_t>(half(r, 0) - region_->base()), 2 * options_.bufferBytes,
                      false);
  }
}

void ShmGroup::setSpin(std::chrono::microseconds spin, bool yield) {
  spinUs_.store(spin.count(), std::memory_order_relaxed);
  yield_.store(yield, std::memory_order_relaxed);
}

ShmGroup::Header& ShmGroup::header() const { return *reinterpret_cast<Header*>(region_->base()); }

ShmGroup::Control& ShmGroup::control(int r) const {
  return *reinterpret_cast<Control*>(region_->base() + kControlOffset + kLine * r);
}

char* ShmGroup::half(int r, uint64_t chunk) const {
  return data_ + (static_cast<size_t>(r) * 2 + (chunk & 1)) * options_.bufferBytes;
}

const void* const* ShmGroup::sourcesAt(uint64_t chunk, size_t byteOffset) const {
  thread_local std::vector<const void*> sources;  // one per thread: parts run at once
  sources.resize(options_.size);
  for (int r = 0; r < options_.size; ++r) sources[r] = half(r, chunk) + byteOffset;
  return sources.data();
}

template <typename Fn>
void ShmGroup::split(size_t count, size_t esize, const Fn& fn) {
  const size_t bytes = count * esize;
  const size_t parts =
      pool_ ? std::min<size_t>(pool_->threads(), bytes / kSplitMinBytes) : size_t{1};
  if (parts <= 1) return fn(0, count);
  const size_t perLine = std::max<size_t>(1, kLine / esize);
  const size_t each = alignUp((count + parts - 1) / parts, perLine);
  pool_->run(parts, [&](size_t p) {
    const size_t a = std::min(count, p * each);
    const size_t b = std::min(count, a + each);
    if (b > a) fn(a, b);
  });
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
  setFailure(describeFailure(word));
  TPCOMM_THROW(kPeerLost, "the group's shared-memory collectives stopped: ", describeFailure(word));
}

void ShmGroup::publishFailure(uint64_t code, int culprit) {
  Header& h = header();
  uint64_t none = 0;
  h.failure.compare_exchange_strong(none, packFailure(code, options_.rank, culprit));
  h.wake.fetch_add(1);
  futexWakeAll(h.wake);
}

void ShmGroup::abort(const std::string& why) {
  if (!forked()) publishFailure(kAborted, -1);
  setFailure(why);
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
  mine.arrived.store(s, std::memory_order_seq_cst);  // publishes this rank's half
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
    calls += detail::concat(r == 0 ? "" : "; ", "rank ", r, " called ", theirs(r).describe());
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
  if (ready()) return;
  const auto start = std::chrono::steady_clock::now();
  const auto spinUntil = start + std::chrono::microseconds(spinUs_.load(std::memory_order_relaxed));
  const auto limit = timeout();
  const auto deadline = start + limit;
  const auto failed = [&] { return h.failure.load(std::memory_order_acquire) != 0; };
  const auto joinFailure = [&] {
    fail(kAborted, -1,
         detail::concat(describeFailure(h.failure.load()), " during ", signature.describe()));
  };
  // A rank that arrived, finished the call and then failed or left the
  // group published the failure after its arrival: all arrived wins.
  if (pollUntil(
          ready, spinUntil, kPausePolls,
          [&] {
            if (failed() && !ready()) joinFailure();
          },
          yield_.load(std::memory_order_relaxed))) {
    return;
  }
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
               detail::concat("rank ", r, " (pid ", peers_[r].pid(), ") died before it reached ",
                              signature.describe()));
        }
      }
    }
    if (now >= deadline) {
      if (ready()) return;  // the last peer arrived just now
      std::string missing;
      for (int r = next; r < n; ++r) {
        if (control(r).arrived.load(std::memory_order_acquire) < s)
          missing += detail::concat(missing.empty() ? "" : ", ", r);
      }
      fail(kTimedOut, -1,
           detail::concat("ranks ", missing, " did not reach ", signature.describe(), " within ",
                          limit.count(), " ms"));
    }
  }
}

void ShmGroup::barrier() {
  checkNotForked();  // before the lock: a fork may have copied it held
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  step(Signature(static_cast<int>(Op::kBarrier), 0, 0, 0, 0));
}

void ShmGroup::allreduceAddRmsNorm(const void* in, size_t rows, DType dtype, const NormRows& norm) {
  checkNotForked();  // before the lock: a fork may have copied it held
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  const ReduceIsa isa = reduceIsa_.load(std::memory_order_relaxed);
  const size_t esize = dtypeBytes(dtype);
  const size_t rowBytes = norm.hidden * esize;
  // The hidden size travels as the signature's root: ranks that disagree on
  // it (same count, other rows) are named too.
  const Signature sig(static_cast<int>(Op::kAllreduceAddRmsNorm), static_cast<int>(dtype), 0,
                      static_cast<int>(norm.hidden), rows * norm.hidden,
                      Signature::ofEps(norm.eps));
  TPCOMM_CHECK(rowBytes <= options_.bufferBytes, kInvalidUsage, "allreduce_add_rms_norm: a row of ",
               rowBytes, " bytes exceeds the shared-memory chunk of ", options_.bufferBytes);
  if (rows == 0) return step(sig);
  const int n = options_.size;
  const int me = options_.rank;
  const size_t chunkRows = options_.bufferBytes / rowBytes;
  const bool twoPhase = n > 1 && rows * rowBytes >= options_.twoPhaseMinBytes;
  std::vector<const void*>& srcs = sources_;
  ReduceSpec sum;
  for (size_t first = 0; first < rows; first += chunkRows) {
    const size_t m = std::min(chunkRows, rows - first);
    const uint64_t k = chunks_++;
    std::memcpy(half(me, k), static_cast<const char*>(in) + first * rowBytes, m * rowBytes);
    step(sig);
    NormRows at = norm;
    auto rowsFrom = [&](size_t row) {
      const size_t offset = (first + row) * rowBytes;
      at.residual = static_cast<const char*>(norm.residual) + offset;
      at.residualOut = static_cast<char*>(norm.residualOut) + offset;
      at.normed = static_cast<char*>(norm.normed) + offset;
    };
    if (!twoPhase) {
      for (int r = 0; r < n; ++r) srcs[r] = half(r, k);
      rowsFrom(0);
      reduceAddRmsNorm(srcs.data(), n, m, dtype, at);
      continue;
    }
    // Rank r sums rows [per x r, per x (r + 1)) of the chunk into its own
    // half; after the second step every rank finishes every row from its
    // owner's sums with its own residual.
    const size_t per = (m + n - 1) / n;
    const size_t from = std::min(m, per * me);
    const size_t to = std::min(m, from + per);
    for (int r = 0; r < n; ++r) srcs[r] = half(r, k) + from * rowBytes;
    reduceIntoWith(isa, half(me, k) + from * rowBytes, srcs.data(), n, (to - from) * norm.hidden,
                   dtype, sum);
    step(sig);
    for (int r = 0; r < n; ++r) {
      const size_t a = std::min(m, per * r);
      const size_t b = std::min(m, a + per);
      if (b == a) continue;
      const void* owner = half(r, k) + a * rowBytes;
      rowsFrom(a);
      reduceAddRmsNorm(&owner, 1, b - a, dtype, at);
    }
  }
}

void ShmGroup::allreduce(const void* in, void* out, size_t count, DType dtype,
                         const ReduceSpec& spec, const ShmPart& part) {
  checkNotForked();  // before the lock: a fork may have copied it held
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  const ReduceIsa isa = reduceIsa_.load(std::memory_order_relaxed);
  const Signature sig(static_cast<int>(Op::kAllreduce), static_cast<int>(dtype),
                      reductionCode(spec), 0, count, Signature::ofPart(part));
  const int n = options_.size;
  const int me = options_.rank;
  const size_t esize = dtypeBytes(dtype);
  if (count == 0) return step(sig);
  const bool twoPhase = n > 1 && count * esize >= options_.twoPhaseMinBytes;
  const size_t chunkElements = options_.bufferBytes / esize;
  ReduceSpec reduce = spec;
  reduce.premultiply = false;  // applied while copying in
  for (size_t offset = 0; offset < count; offset += chunkElements) {
    const size_t m = std::min(chunkElements, count - offset);
    const uint64_t k = chunks_++;
    const char* src = static_cast<const char*>(in) + offset * esize;
    split(m, esize, [&](size_t a, size_t b) {
      copyScaled(half(me, k) + a * esize, src + a * esize, b - a, dtype, spec);
    });
    step(sig);
    char* dst = static_cast<char*>(out) + offset * esize;
    if (!twoPhase) {
      split(m, esize, [&](size_t a, size_t b) {
        reduceIntoWith(isa, dst + a * esize, sourcesAt(k, a * esize), n, b - a, dtype, reduce);
      });
      continue;
    }
    const size_t slice = sliceElements(m, n, esize);
    const size_t from = std::min(m, slice * me);
    const size_t to = std::min(m, from + slice);
    split(to - from, esize, [&](size_t a, size_t b) {
      reduceIntoWith(isa, half(me, k) + (from + a) * esize, sourcesAt(k, (from + a) * esize), n,
                     b - a, dtype, reduce);
    });
    step(sig);
    split(m, esize, [&](size_t a, size_t b) {
      for (int r = 0; r < n; ++r) {  // the part of [a, b) that rank r owns
        const size_t lo = std::max(a, std::min(m, slice * r));
        const size_t hi = std::min(b, std::min(m, slice * r + slice));
        if (hi > lo) std::memcpy(dst + lo * esize, half(r, k) + lo * esize, (hi - lo) * esize);
      }
    });
  }
}

void ShmGroup::allgather(const void* in, size_t bytes, const std::vector<void*>& outs,
                         const ShmPart& part) {
  checkNotForked();  // before the lock: a fork may have copied it held
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  TPCOMM_CHECK_EQ(outs.size(), static_cast<size_t>(options_.size), "(all_gather outputs)");
  const Signature sig(static_cast<int>(Op::kAllgather), 0, 0, 0, bytes, Signature::ofPart(part));
  if (bytes == 0) return step(sig);
  const size_t chunk = options_.bufferBytes;
  for (size_t offset = 0; offset < bytes; offset += chunk) {
    const size_t m = std::min(chunk, bytes - offset);
    const uint64_t k = chunks_++;
    const char* src = static_cast<const char*>(in) + offset;
    split(m, 1,
          [&](size_t a, size_t b) { std::memcpy(half(options_.rank, k) + a, src + a, b - a); });
    step(sig);
    split(m, 1, [&](size_t a, size_t b) {
      for (int r = 0; r < options_.size; ++r) {
        // An in-place call's own part is in place already.
        if (r == options_.rank && outs[r] == in) continue;
        std::memcpy(static_cast<char*>(outs[r]) + offset + a, half(r, k) + a, b - a);
      }
    });
  }
}

void ShmGroup::reduceScatter(const std::vector<const void*>& ins, void* out, size_t count,
                             DType dtype, const ReduceSpec& spec, const ShmPart& part) {
  checkNotForked();  // before the lock: a fork may have copied it held
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  const ReduceIsa isa = reduceIsa_.load(std::memory_order_relaxed);
  const int n = options_.size;
  TPCOMM_CHECK_EQ(ins.size(), static_cast<size_t>(n), "(reduce_scatter inputs)");
  const Signature sig(static_cast<int>(Op::kReduceScatter), static_cast<int>(dtype),
                      reductionCode(spec), 0, count, Signature::ofPart(part));
  if (count == 0) return step(sig);
  const size_t esize = dtypeBytes(dtype);
  // Each half holds one piece per destination rank, whole cache lines each
  // where the buffer allows.
  const size_t perLine = kLine / esize;
  size_t piece = options_.bufferBytes / n / esize;
  if (piece >= perLine) piece = piece / perLine * perLine;
  TPCOMM_CHECK(piece >= 1, kInvalidUsage, "shared-memory buffer of ", options_.bufferBytes,
               " bytes is too small for a reduce-scatter of ", dtypeName(dtype), " over ", n,
               " ranks");
  ReduceSpec reduce = spec;
  reduce.premultiply = false;
  const size_t mine = options_.rank * piece * esize;  // this rank's piece in every half
  for (size_t offset = 0; offset < count; offset += piece) {
    const size_t m = std::min(piece, count - offset);
    const uint64_t k = chunks_++;
    split(m, esize, [&](size_t a, size_t b) {
      for (int r = 0; r < n; ++r) {
        copyScaled(half(options_.rank, k) + (r * piece + a) * esize,
                   static_cast<const char*>(ins[r]) + (offset + a) * esize, b - a, dtype, spec);
      }
    });
    step(sig);
    split(m, esize, [&](size_t a, size_t b) {
      reduceIntoWith(isa, static_cast<char*>(out) + (offset + a) * esize,
                     sourcesAt(k, mine + a * esize), n, b - a, dtype, reduce);
    });
  }
}

void ShmGroup::broadcast(void* data, size_t bytes, int root) {
  checkNotForked();  // before the lock: a fork may have copied it held
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  TPCOMM_CHECK(root >= 0 && root < options_.size, kInvalidUsage, "broadcast root ", root,
               " outside a group of ", options_.size);
  const Signature sig(static_cast<int>(Op::kBroadcast), 0, 0, root, bytes);
  if (bytes == 0) return step(sig);
  const size_t chunk = options_.bufferBytes;
  for (size_t offset = 0; offset < bytes; offset += chunk) {
    const size_t m = std::min(chunk, bytes - offset);
    const uint64_t k = chunks_++;
    char* mine = static_cast<char*>(data) + offset;
    if (options_.rank == root) {
      split(m, 1, [&](size_t a, size_t b) { std::memcpy(half(root, k) + a, mine + a, b - a); });
    }
    step(sig);
    if (options_.rank != root) {
      split(m, 1, [&](size_t a, size_t b) { std::memcpy(mine + a, half(root, k) + a, b - a); });
    }
  }
}

}  // namespace tpcomm::mq
