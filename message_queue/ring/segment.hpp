#pragma once
// The shared-memory segment behind a ring (layout drawn in ring.hpp) and the
// bounded waits on it. Internal to message_queue/.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "message_queue/region/futex.hpp"  // processAlive (0: not attached yet; kDetached: gone)
#include "message_queue/region/shared_region.hpp"
#include "message_queue/ring/ring.hpp"

namespace tpcomm::mq {

constexpr uint64_t kMagic = 0x7470636f6d6d7132ULL;  // "tpcommq2"
constexpr uint32_t kVersion = 3;
constexpr size_t kCacheLine = 64;
constexpr size_t kHeaderBytes = 256;
constexpr uint32_t kMaxReaders = 64;

constexpr int32_t kDetached = -1;

constexpr uint32_t kFirst = 1;  // chunk flags
constexpr uint32_t kLast = 2;

struct Header {
  uint64_t magic;
  uint32_t version;
  uint32_t numReaders;
  uint64_t numChunks;
  uint64_t chunkBytes;
  uint64_t totalBytes;
  int32_t writerPid;
  uint64_t token;  // the region nonce's first word, also in the name
  alignas(kCacheLine) std::atomic<uint64_t> published;
  std::atomic<uint32_t> publishedWord;      // futex: bumped after each publish
  std::atomic<uint32_t> publishedSleepers;  // readers asleep on publishedWord
  std::atomic<uint32_t> shutdown;
  alignas(kCacheLine) std::atomic<uint32_t> consumedWord;  // futex: bumped after each consume
  std::atomic<uint32_t> consumedSleepers;                  // the writer, asleep on it
  std::atomic<uint32_t> attached;
};
static_assert(sizeof(Header) <= kHeaderBytes, "header must fit its reserved bytes");

struct alignas(kCacheLine) ReaderSlot {
  std::atomic<uint64_t> consumed;
  std::atomic<int32_t> pid;  // 0 until the reader attached, kDetached after it left
};

struct ChunkHeader {
  uint32_t bytes;         // payload bytes in this chunk
  uint32_t flags;         // ChunkFlags
  uint64_t messageBytes;  // total message length (first chunk)
};

// Bytes of a segment with this geometry; throws InvalidUsage if absurd.
uint64_t segmentBytes(const Geometry& g);

class Segment {
 public:
  // Creates a new segment: anonymous shared memory (memfd, mode 0600) that
  // readers map through this process's descriptor; its name says where.
  static std::unique_ptr<Segment> create(const Geometry& g);
  // Attaches to an existing one by name; validates magic, version and
  // geometry against the mapped size.
  static std::unique_ptr<Segment> attach(const std::string& name);
  ~Segment();

  const std::string& name() const { return name_; }
  // The geometry checked at create/attach: offsets never depend on values
  // re-read from shared memory.
  const Geometry& geometry() const { return geometry_; }
  Header& header() { return *reinterpret_cast<Header*>(region_->base()); }
  ReaderSlot& slot(uint32_t r);
  ChunkHeader& chunkHeader(uint64_t seq);
  // Chunk payloads are laid out back to back: chunks seq .. seq + k - 1 are
  // one contiguous range when seq % numChunks + k <= numChunks.
  char* chunkData(uint64_t seq);
  // Closes the creator's descriptor: no reader can attach any more (the
  // memory stays until the last process unmaps it). Idempotent.
  void closeForAttach();

  // How a wait ended.
  enum class WaitOutcome { kAtOnce, kPolled, kSlept };
  // Waits until ready() is true: polls for `spin` (0: a fixed 4,000 polls),
  // then sleeps on `word`, counted in `sleepers`. Throws Timeout (with
  // `what`), or PeerLost when shutdown is set or peerAlive() says no.
  WaitOutcome wait(std::atomic<uint32_t>& word, std::atomic<uint32_t>& sleepers,
                   const std::function<bool()>& ready, const std::function<bool()>& peerAlive,
                   std::chrono::milliseconds timeout, std::chrono::microseconds spin,
                   const char* what);

 private:
  Segment(std::string name, std::unique_ptr<SharedRegion> region, Geometry geometry);
  std::string name_;
  Geometry geometry_;
  std::unique_ptr<SharedRegion> region_;
};

}  // namespace tpcomm::mq
