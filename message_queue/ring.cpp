#include "message_queue/ring.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "coordinator/common/error.hpp"
#include "message_queue/segment.hpp"

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

// ---------------------------------------------------------------- Writer
Writer::Writer(const Geometry& geometry) : segment_(Segment::create(geometry)) {}

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
    s.wait(h.consumedWord, allAttached, attachedAlive, timeout, "waiting for readers to attach");
  } catch (const Error& e) {
    std::string missing;
    for (uint32_t r = 0; r < n; ++r) {
      if (s.slot(r).pid.load() == 0) missing += (missing.empty() ? "" : ",") + std::to_string(r);
    }
    TPCOMM_THROW(kTimeout, e.what(), "; readers not attached: ", missing);
  }
  s.unlink();
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
    auto readersAlive = [&] {
      for (uint32_t r = 0; r < g.numReaders; ++r) {
        if (!processAlive(s.slot(r).pid.load(std::memory_order_acquire))) return false;
      }
      return true;
    };
    s.wait(h.consumedWord, chunkFree, readersAlive, remaining(deadline),
           "waiting for readers to free a chunk");
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
    Segment::notify(h.publishedWord);
    next_ = seq + 1;
    offset += n;
  } while (offset < bytes);
}

void Writer::shutdown() {
  Header& h = segment_->header();
  h.shutdown.store(1, std::memory_order_release);
  Segment::notify(h.publishedWord);
  Segment::notify(h.consumedWord);
}

// ---------------------------------------------------------------- Reader
Reader::Reader(const std::string& name, uint32_t index)
    : segment_(Segment::attach(name)), index_(index) {
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
  Segment::notify(s.header().consumedWord);
}

Reader::~Reader() {
  // The writer treats a detached reader as lost instead of waiting for it.
  segment_->slot(index_).pid.store(kDetached, std::memory_order_release);
  Segment::notify(segment_->header().consumedWord);
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
  Segment& s = *segment_;
  Header& h = s.header();
  const Geometry& g = s.geometry();
  ReaderSlot& me = s.slot(index_);
  const int32_t writerPid = h.writerPid;
  const auto deadline = Clock::now() + timeout;
  char* message = nullptr;
  uint64_t received = 0;
  uint64_t expected = 0;
  bool started = false;
  while (true) {
    const uint64_t seq = me.consumed.load(std::memory_order_relaxed);
    s.wait(
        h.publishedWord, [&] { return h.published.load(std::memory_order_acquire) > seq; },
        [&] { return processAlive(writerPid); }, remaining(deadline), "waiting for the writer");
    // Copy the header once: everything below checks this copy, never shared
    // memory that the writer could change underneath.
    const ChunkHeader chunk = s.chunkHeader(seq);
    TPCOMM_CHECK(chunk.bytes <= g.chunkBytes && (chunk.flags & ~(kFirst | kLast)) == 0, kSystem,
                 "message queue ", s.name(), ": corrupt chunk header at sequence ", seq, " (bytes ",
                 chunk.bytes, ", flags ", chunk.flags, ")");
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
    me.consumed.store(seq + 1, std::memory_order_release);
    Segment::notify(h.consumedWord);
    if ((chunk.flags & kLast) != 0) {
      TPCOMM_CHECK(received == expected, kSystem, "message queue ", s.name(), ": message ended at ",
                   received, " of ", expected, " bytes");
      return expected;
    }
  }
}

void Reader::shutdown() {
  Header& h = segment_->header();
  h.shutdown.store(1, std::memory_order_release);
  Segment::notify(h.publishedWord);
  Segment::notify(h.consumedWord);
}

}  // namespace tpcomm::mq
