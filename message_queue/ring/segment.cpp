#include "message_queue/ring/segment.hpp"

#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <cstdio>
#include <new>

#include "common/error.hpp"
#include "message_queue/region/futex.hpp"

namespace tpcomm::mq {

namespace {

constexpr int kLegacyPauseRounds = 250;  // spin 0: 4,000 polls, then sleep
constexpr int kPauseRounds = 8;          // rounds of 16 polls before the first yield
constexpr auto kSleepSlice = std::chrono::milliseconds(50);

size_t alignUp(size_t n) { return (n + kCacheLine - 1) / kCacheLine * kCacheLine; }

size_t slotsOffset() { return kHeaderBytes; }

size_t chunkHeadersOffset(uint32_t numReaders) {
  return alignUp(slotsOffset() + numReaders * sizeof(ReaderSlot));
}

size_t payloadOffset(const Geometry& g) {
  return alignUp(chunkHeadersOffset(g.numReaders) + g.numChunks * sizeof(ChunkHeader));
}

}  // namespace

uint64_t segmentBytes(const Geometry& g) {
  TPCOMM_CHECK(g.numReaders >= 1 && g.numReaders <= kMaxReaders, kInvalidUsage,
               "message queue: numReaders must be in [1, ", kMaxReaders, "], got ", g.numReaders);
  TPCOMM_CHECK(g.numChunks >= 1 && g.numChunks <= (1u << 20), kInvalidUsage,
               "message queue: numChunks must be in [1, 2^20], got ", g.numChunks);
  TPCOMM_CHECK(g.chunkBytes >= 64 && g.chunkBytes <= (1ull << 32) - 64, kInvalidUsage,
               "message queue: chunkBytes must be in [64, 2^32 - 64], got ", g.chunkBytes);
  TPCOMM_CHECK(g.numChunks * g.chunkBytes <= (64ull << 30), kInvalidUsage,
               "message queue: a ring of ", g.numChunks, " x ", g.chunkBytes,
               " bytes exceeds 64 GiB");
  return payloadOffset(g) + g.numChunks * g.chunkBytes;
}

Segment::Segment(std::string name, std::unique_ptr<SharedRegion> region, Geometry geometry)
    : name_(std::move(name)), geometry_(geometry), region_(std::move(region)) {}

Segment::~Segment() = default;  // the region unmaps (and closes its descriptor)

void Segment::closeForAttach() { region_->closeDescriptor(); }

std::unique_ptr<Segment> Segment::create(const Geometry& g) {
  const uint64_t bytes = segmentBytes(g);
  std::unique_ptr<SharedRegion> region = SharedRegion::create(bytes);  // zeroed, 0600
  const uint64_t token = region->nonce().words[0];
  // Where a reader finds the creator's descriptor, and the region's random
  // nonce (a closed ring's descriptor number is reused by the next one; a pid
  // may belong to another pid namespace), checked at attach.
  const std::string name = region->name();
  auto segment = std::unique_ptr<Segment>(new Segment(name, std::move(region), g));
  Header* h = new (segment->region_->base()) Header();
  h->magic = kMagic;
  h->version = kVersion;
  h->numReaders = g.numReaders;
  h->numChunks = g.numChunks;
  h->chunkBytes = g.chunkBytes;
  h->totalBytes = bytes;
  h->writerPid = ::getpid();
  h->token = token;
  for (uint32_t r = 0; r < g.numReaders; ++r) new (&segment->slot(r)) ReaderSlot();
  return segment;
}

std::unique_ptr<Segment> Segment::attach(const std::string& name) {
  RegionName where;
  TPCOMM_CHECK(RegionName::parse(name, &where) && where.bytes >= kHeaderBytes, kInvalidUsage, "'",
               name, "' is not the name of a tpcomm message queue");
  const int pid = where.pid;
  const uint64_t bytes = where.bytes;
  const RegionNonce& nonce = where.nonce;
  std::unique_ptr<SharedRegion> region;
  try {
    region = SharedRegion::attach(where.pid, where.fd, static_cast<size_t>(bytes), nonce);
  } catch (const Error& e) {
    TPCOMM_THROW(kSystem, "message queue ", name, ": ", e.what(),
                 " (the writer closes its descriptor once every reader attached, and it is gone "
                 "when the writer exited)");
  }
  const Header& h = *reinterpret_cast<const Header*>(region->base());
  TPCOMM_CHECK(h.magic == kMagic && h.version == kVersion && h.writerPid == pid, kSystem,
               "message queue ", name, " is not a tpcomm message queue (version ", kVersion, ")");
  TPCOMM_CHECK(h.token == nonce.words[0], kSystem, "message queue ", name,
               " is gone (its descriptor now holds another ring)");
  Geometry g;
  g.numReaders = h.numReaders;
  g.numChunks = h.numChunks;
  g.chunkBytes = h.chunkBytes;
  uint64_t expected = 0;
  try {
    expected = segmentBytes(g);
  } catch (const Error&) {
    expected = 0;
  }
  TPCOMM_CHECK(expected == bytes && h.totalBytes == bytes, kSystem, "message queue ", name,
               ": geometry does not match its size (", bytes, " bytes)");
  return std::unique_ptr<Segment>(new Segment(name, std::move(region), g));
}

ReaderSlot& Segment::slot(uint32_t r) {
  return *reinterpret_cast<ReaderSlot*>(region_->base() + slotsOffset() + r * sizeof(ReaderSlot));
}

ChunkHeader& Segment::chunkHeader(uint64_t seq) {
  return *reinterpret_cast<ChunkHeader*>(region_->base() +
                                         chunkHeadersOffset(geometry_.numReaders) +
                                         (seq % geometry_.numChunks) * sizeof(ChunkHeader));
}

char* Segment::chunkData(uint64_t seq) {
  return region_->base() + payloadOffset(geometry_) +
         (seq % geometry_.numChunks) * geometry_.chunkBytes;
}

Segment::WaitOutcome Segment::wait(std::atomic<uint32_t>& word, std::atomic<uint32_t>& sleepers,
                                   const std::function<bool()>& ready,
                                   const std::function<bool()>& peerAlive,
                                   std::chrono::milliseconds timeout,
                                   std::chrono::microseconds spin, const char* what) {
  if (ready()) return WaitOutcome::kAtOnce;
  Header& h = header();
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout;
  // What a peer published before it shut down or exited is still read:
  // ready() is checked again after seeing either (the shutdown store and the
  // exit come after the publishing store).
  const auto checkShutdown = [&] {
    TPCOMM_CHECK(h.shutdown.load(std::memory_order_acquire) == 0 || ready(), kPeerLost,
                 "message queue ", name_, " was shut down while ", what);
  };
  // Busy: poll (yielding the core) for `spin`, so that a round trip never
  // pays a wake-up; idle: sleep, costing no CPU.
  if (pollUntil(ready, std::min(start + spin, deadline),
                spin.count() == 0 ? kLegacyPauseRounds : kPauseRounds, checkShutdown)) {
    return WaitOutcome::kPolled;
  }
  // Shutdown and a detaching reader bump the word too: they end a sleep.
  const auto readyOrShutdown = [&] {
    return ready() || h.shutdown.load(std::memory_order_acquire) != 0;
  };
  while (true) {
    checkShutdown();
    if (ready()) return WaitOutcome::kSlept;
    TPCOMM_CHECK(peerAlive() || ready(), kPeerLost, "message queue ", name_,
                 ": a peer process died while ", what);
    const auto now = std::chrono::steady_clock::now();
    TPCOMM_CHECK(now < deadline, kTimeout, "message queue ", name_, ": timed out after ",
                 timeout.count(), " ms ", what);
    const auto left = std::chrono::duration_cast<std::chrono::microseconds>(deadline - now);
    if (sleepOn(word, sleepers, readyOrShutdown,
                std::min<std::chrono::microseconds>(left + std::chrono::milliseconds(1),
                                                    kSleepSlice)) &&
        ready()) {
      return WaitOutcome::kSlept;
    }
  }
}

}  // namespace tpcomm::mq
