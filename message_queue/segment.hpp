#pragma once
// The shared-memory segment behind a ring (layout drawn in ring.hpp) and the
// bounded waits on it. Internal to message_queue/.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "message_queue/futex.hpp"  // processAlive (0: not attached yet; kDetached: gone)
#include "message_queue/ring.hpp"

namespace tpcomm::mq {

constexpr uint64_t kMagic = 0x7470636f6d6d7131ULL;  // "tpcommq1"
constexpr uint32_t kVersion = 1;
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
  alignas(kCacheLine) std::atomic<uint64_t> published;
  std::atomic<uint32_t> publishedWord;  // futex: bumped after each publish
  std::atomic<uint32_t> shutdown;
  alignas(kCacheLine) std::atomic<uint32_t> consumedWord;  // futex: bumped after each consume
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
  // Creates a new segment with a random name, mode 0600.
  static std::unique_ptr<Segment> create(const Geometry& g);
  // Attaches to an existing one; validates magic, version and geometry
  // against the mapped size.
  static std::unique_ptr<Segment> attach(const std::string& name);
  ~Segment();

  const std::string& name() const { return name_; }
  // The geometry checked at create/attach: offsets never depend on values
  // re-read from shared memory.
  const Geometry& geometry() const { return geometry_; }
  Header& header() { return *static_cast<Header*>(base_); }
  ReaderSlot& slot(uint32_t r);
  ChunkHeader& chunkHeader(uint64_t seq);
  char* chunkData(uint64_t seq);
  // Removes the name from /dev/shm (idempotent).
  void unlink();

  // Waits until ready() is true: spins, then sleeps on `word`. Throws Timeout
  // (with `what`), or PeerLost when shutdown is set or peerAlive() says no.
  void wait(std::atomic<uint32_t>& word, const std::function<bool()>& ready,
            const std::function<bool()>& peerAlive, std::chrono::milliseconds timeout,
            const char* what);
  // Bumps `word` and wakes every process sleeping on it.
  static void notify(std::atomic<uint32_t>& word);

 private:
  Segment(std::string name, void* base, size_t bytes, bool owner, Geometry geometry);
  std::string name_;
  Geometry geometry_;
  void* base_;
  size_t bytes_;
  bool owner_;
  bool unlinked_ = false;
};

}  // namespace tpcomm::mq
