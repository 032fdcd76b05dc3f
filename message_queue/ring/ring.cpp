#include "message_queue/ring/ring.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "common/error.hpp"
#include "common/settings.hpp"
#include "message_queue/region/futex.hpp"
#include "message_queue/ring/segment.hpp"

namespace tpcomm::mq {

namespace {

using Clock = std::chrono::steady_clock;

std::chrono::milliseconds remaining(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max(left, std::chrono::milliseconds(0));
}

// Largest message a reader accepts from a header before allocating for it.
constexpr uint64_t kMaxMessageBytes = 1ull << 40;

}  // namespace

std::chrono::microseconds defaultSpin() { return std::chrono::microseconds(settings().mqSpinUs); }

std::chrono::microseconds SpinLearner::next(std::chrono::microseconds spin) {
  probing_ = false;
  active_ = enabled_ && spin.count() > 0;  // spin 0 (the fixed polls) is never learnt from
  if (!active_ || !brief_) return spin;
  if (++sinceProbe_ < kProbeEvery) return std::min(spin, kBrief);
  sinceProbe_ = 0;
  probing_ = true;
  return spin;
}

void SpinLearner::record(bool atOnce, bool polled) {
  if (!active_) return;
  if (atOnce) {
    if (probing_) sinceProbe_ = kProbeEvery - 1;  // the probe learnt nothing: the next wait probes
    return;
  }
  if (brief_) {
    // Only a whole spin tells whether polling would meet the messages.
    if (probing_ && polled) brief_ = false;
    return;
  }
  ++waits_;
  polled_ += polled ? 1 : 0;
  if (waits_ < kWindow) return;
  brief_ = polled_ * 2 < waits_;
  waits_ = polled_ = sinceProbe_ = 0;
}

namespace {

// After a publish or consume: wakes sleepers when some sleep, or always for
// an end with spin 0 (the behaviour before polling was tunable).
void notify(std::atomic<uint32_t>& word, std::atomic<uint32_t>& sleepers,
            std::chrono::microseconds spin) {
  if (spin.count() > 0) {
    wakeSleepers(word, sleepers);
    return;
  }
  word.fetch_add(1, std::memory_order_seq_cst);
  futexWakeAll(word);
}

}  // namespace

// ---------------------------------------------------------------- Writer
Writer::Writer(const Geometry& geometry)
    : segment_(Segment::create(geometry)), spin_(defaultSpin()) {}

Writer::~Writer() {
  if (segment_) shutdown();
}

const std::string& Writer::name() const { return segment_->name(); }

void Writer::waitForReaders(std::chrono::milliseconds timeout) {
  Segment& s = *segment_;
  Header& h = s.header();
  const uint32_t n = s.geometry().numReaders;
  auto allAttached = [&] { return h.attached.load(std::memory_order_acquire) >= n; };
  auto attachedAlive = [&] {
    for (uint32_t r = 0; r < n; ++r) {
      if (!processAlive(s.slot(r).pid.load(std::memory_order_acquire))) return false;
    }
    return true;
  };
  try {
    s.wait(h.consumedWord, h.consumedSleepers, allAttached, attachedAlive, timeout, spin_,
           "waiting for readers to attach");
  } catch (const Error& e) {
    std::string missing;
    for (uint32_t r = 0; r < n; ++r) {
      if (s.slot(r).pid.load() == 0) missing += (missing.empty() ? "" : ",") + std::to_string(r);
    }
    if (e.code() == ErrorCode::kPeerLost) throw;  // a reader died or shut down
    TPCOMM_THROW(kTimeout, e.what(), "; readers not attached: ", missing);
  }
  s.closeForAttach();
}

uint32_t Writer::numReaders() const { return segment_->geometry().numReaders; }

bool Writer::readersAlive() const {
  Segment& s = *segment_;
  for (uint32_t r = 0; r < s.geometry().numReaders; ++r) {
    if (!processAlive(s.slot(r).pid.load(std::memory_order_acquire))) return false;
  }
  return true;
}

void Writer::write(const void* data, size_t bytes, std::chrono::milliseconds timeout) {
  write(std::vector<Part>{{data, bytes}}, timeout);
}

void Writer::write(const std::vector<Part>& parts, std::chrono::milliseconds timeout) {
  Segment& s = *segment_;
  Header& h = s.header();
  const Geometry& g = s.geometry();
  TPCOMM_CHECK(h.shutdown.load(std::memory_order_acquire) == 0, kPeerLost, "message queue ",
               s.name(), " was shut down");
  size_t bytes = 0;
  for (const Part& p : parts) bytes += p.bytes;
  const auto deadline = Clock::now() + timeout;
  size_t offset = 0;  // bytes of the message written so far
  size_t part = 0;    // current part and the offset in it
  size_t partOffset = 0;
  do {
    const uint64_t seq = next_;
    auto chunkFree = [&] {
      for (uint32_t r = 0; r < g.numReaders; ++r) {
        if (seq - s.slot(r).consumed.load(std::memory_order_acquire) >= g.numChunks) return false;
      }
      return true;
    };
    s.wait(
        h.consumedWord, h.consumedSleepers, chunkFree, [this] { return readersAlive(); },
        remaining(deadline), spin_, "waiting for readers to free a chunk");
    const size_t n = std::min<size_t>(g.chunkBytes, bytes - offset);
    ChunkHeader& chunk = s.chunkHeader(seq);
    chunk.bytes = static_cast<uint32_t>(n);
    chunk.flags = (offset == 0 ? kFirst : 0u) | (offset + n == bytes ? kLast : 0u);
    chunk.messageBytes = bytes;
    char* out = s.chunkData(seq);
    for (size_t filled = 0; filled < n;) {
      while (parts[part].bytes == partOffset) {
        ++part;
        partOffset = 0;
      }
      const size_t take = std::min(n - filled, parts[part].bytes - partOffset);
      std::memcpy(out + filled, static_cast<const char*>(parts[part].data) + partOffset, take);
      filled += take;
      partOffset += take;
    }
    h.published.store(seq + 1, std::memory_order_release);
    notify(h.publishedWord, h.publishedSleepers, spin_);
    next_ = seq + 1;
    offset += n;
  } while (offset < bytes);
}

namespace {

// Wakes every waiter of a ring (shutdown): both words, unconditionally.
void wakeEveryone(Header& h) {
  h.shutdown.store(1, std::memory_order_seq_cst);
  for (std::atomic<uint32_t>* word : {&h.publishedWord, &h.consumedWord}) {
    word->fetch_add(1, std::memory_order_seq_cst);
    futexWakeAll(*word);
  }
}

}  // namespace

void Writer::shutdown() { wakeEveryone(segment_->header()); }

// ---------------------------------------------------------------- Reader
Reader::Reader(const std::string& name, uint32_t index)
    : segment_(Segment::attach(name)),
      index_(index),
      spin_(defaultSpin()),
      learner_(settings().mqSpinAdapt) {
  Segment& s = *segment_;
  TPCOMM_CHECK(index < s.geometry().numReaders, kInvalidUsage, "message queue ", name,
               ": reader index ", index, " is out of range for ", s.geometry().numReaders,
               " readers");
  int32_t expected = 0;
  const int32_t self = ::getpid();
  TPCOMM_CHECK(s.slot(index).pid.compare_exchange_strong(expected, self), kInvalidUsage,
               "message queue ", name, ": reader index ", index, " is already taken (pid ",
               expected, ")");
  s.header().attached.fetch_add(1, std::memory_order_acq_rel);
  wakeSleepers(s.header().consumedWord, s.header().consumedSleepers);
}

Reader::~Reader() {
  // The writer treats a detached reader as lost instead of waiting for it.
  segment_->slot(index_).pid.store(kDetached, std::memory_order_release);
  wakeSleepers(segment_->header().consumedWord, segment_->header().consumedSleepers);
}

std::vector<char> Reader::read(std::chrono::milliseconds timeout) {
  std::vector<char> message;
  read(timeout, [&](uint64_t bytes) {
    message.resize(bytes);
    return message.data();
  });
  return message;
}

uint64_t Reader::read(std::chrono::milliseconds timeout,
                      const std::function<char*(uint64_t bytes)>& allocate) {
  return copyMessage(Clock::now() + timeout, allocate);
}

void Reader::awaitPublished(uint64_t seq, Clock::time_point deadline) {
  Segment& s = *segment_;
  Header& h = s.header();
  const int32_t writerPid = h.writerPid;
  const auto outcome = s.wait(
      h.publishedWord, h.publishedSleepers,
      [&] { return h.published.load(std::memory_order_acquire) > seq; },
      [&] { return processAlive(writerPid); }, remaining(deadline), learner_.next(spin_),
      "waiting for the writer");
  learner_.record(outcome == Segment::WaitOutcome::kAtOnce,
                  outcome == Segment::WaitOutcome::kPolled);
}

Reader::Checked Reader::checkedHeader(uint64_t seq) {
  Segment& s = *segment_;
  // Copy the header once: everything checks this copy, never shared memory
  // that the writer could change underneath.
  const ChunkHeader chunk = s.chunkHeader(seq);
  TPCOMM_CHECK(chunk.bytes <= s.geometry().chunkBytes && (chunk.flags & ~(kFirst | kLast)) == 0,
               kSystem, "message queue ", s.name(), ": corrupt chunk header at sequence ", seq,
               " (bytes ", chunk.bytes, ", flags ", chunk.flags, ")");
  return {chunk.bytes, chunk.flags, chunk.messageBytes};
}

void Reader::consumeUpTo(uint64_t next) {
  Header& h = segment_->header();
  segment_->slot(index_).consumed.store(next, std::memory_order_release);
  notify(h.consumedWord, h.consumedSleepers, spin_);
}

uint64_t Reader::copyMessage(Clock::time_point deadline,
                             const std::function<char*(uint64_t bytes)>& allocate) {
  Segment& s = *segment_;
  ReaderSlot& me = s.slot(index_);
  char* message = nullptr;
  uint64_t received = 0;
  uint64_t expected = 0;
  bool started = false;
  while (true) {
    const uint64_t seq = me.consumed.load(std::memory_order_relaxed);
    awaitPublished(seq, deadline);
    const Checked chunk = checkedHeader(seq);
    if (!started) {
      TPCOMM_CHECK((chunk.flags & kFirst) != 0 && chunk.messageBytes <= kMaxMessageBytes, kSystem,
                   "message queue ", s.name(), ": chunk ", seq, " does not start a message (flags ",
                   chunk.flags, ", length ", chunk.messageBytes, ")");
      expected = chunk.messageBytes;
      message = allocate(expected);
      started = true;
    } else {
      TPCOMM_CHECK((chunk.flags & kFirst) == 0 && chunk.messageBytes == expected, kSystem,
                   "message queue ", s.name(), ": chunk ", seq, " breaks the message in flight");
    }
    TPCOMM_CHECK(received + chunk.bytes <= expected, kSystem, "message queue ", s.name(),
                 ": chunk ", seq, " overruns its message of ", expected, " bytes");
    if (chunk.bytes > 0) std::memcpy(message + received, s.chunkData(seq), chunk.bytes);
    received += chunk.bytes;
    consumeUpTo(seq + 1);
    if ((chunk.flags & kLast) != 0) {
      TPCOMM_CHECK(received == expected, kSystem, "message queue ", s.name(), ": message ended at ",
                   received, " of ", expected, " bytes");
      return expected;
    }
  }
}

void Reader::readInPlace(std::chrono::milliseconds timeout,
                         const std::function<void(const char* data, uint64_t bytes)>& use,
                         const std::function<char*(uint64_t bytes)>& allocate) {
  Segment& s = *segment_;
  const Geometry& g = s.geometry();
  const auto deadline = Clock::now() + timeout;
  const uint64_t seq = s.slot(index_).consumed.load(std::memory_order_relaxed);
  awaitPublished(seq, deadline);
  const Checked first = checkedHeader(seq);
  TPCOMM_CHECK((first.flags & kFirst) != 0 && first.messageBytes <= kMaxMessageBytes, kSystem,
               "message queue ", s.name(), ": chunk ", seq, " does not start a message (flags ",
               first.flags, ", length ", first.messageBytes, ")");
  const uint64_t bytes = first.messageBytes;
  const uint64_t chunks = std::max<uint64_t>(1, (bytes + g.chunkBytes - 1) / g.chunkBytes);
  if (chunks > g.numChunks || seq % g.numChunks + chunks > g.numChunks) {
    // Wraps (or never fits the ring at once): copied out.
    std::vector<char> copy;
    char* data = nullptr;
    const uint64_t n = copyMessage(deadline, [&](uint64_t size) {
      if (allocate) return data = allocate(size);
      copy.resize(size);
      return data = copy.data();
    });
    use(data, n);
    return;
  }
  // Every chunk of the message, published and checked, before `use` sees it.
  awaitPublished(seq + chunks - 1, deadline);
  for (uint64_t i = 0; i < chunks; ++i) {
    const Checked c = checkedHeader(seq + i);
    const uint64_t want = i + 1 < chunks ? g.chunkBytes : bytes - (chunks - 1) * g.chunkBytes;
    const uint32_t flags = (i == 0 ? kFirst : 0u) | (i + 1 == chunks ? kLast : 0u);
    TPCOMM_CHECK(c.bytes == want && c.flags == flags && c.messageBytes == bytes, kSystem,
                 "message queue ", s.name(), ": chunk ", seq + i, " breaks the message of ", bytes,
                 " bytes that starts at chunk ", seq);
  }
  struct ConsumeAfter {
    Reader* reader;
    uint64_t next;
    ~ConsumeAfter() { reader->consumeUpTo(next); }
  } consume{this, seq + chunks};
  use(s.chunkData(seq), bytes);
}

void Reader::shutdown() { wakeEveryone(segment_->header()); }

}  // namespace tpcomm::mq
