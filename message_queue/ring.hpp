#pragma once
// tpcomm::mq — one writer, N readers, a ring of chunks in POSIX shared memory.
// Plain C++ (no torch). The public header of message_queue/.
//
// Segment layout (all offsets 64-byte aligned):
//
//   +--------------------------+ 0
//   | Header                   |  magic, version, geometry, writer pid,
//   |                          |  published (u64), publishedWord (futex),
//   |                          |  consumedWord (futex), attached, shutdown
//   +--------------------------+ kHeaderBytes
//   | ReaderSlot[numReaders]   |  one cache line each: consumed (u64), pid
//   +--------------------------+
//   | Chunk[numChunks]         |  ChunkHeader {bytes, flags, messageBytes}
//   |                          |  then chunkBytes of payload
//   +--------------------------+
//
// Sequence numbers never reset (no flag is ever cleared, so a stale flag
// cannot be mistaken for a fresh one): chunk s lives in slot s % numChunks.
//
//   state of chunk s          | condition                       | who may act
//   --------------------------+---------------------------------+--------------
//   free for the writer       | s - min(consumed[r]) < numChunks| writer fills it
//   published                 | published > s                   | readers copy
//   consumed by reader r      | consumed[r] > s                 | -
//
// The writer fills a chunk, then stores published = s + 1 (release); a reader
// loads published (acquire), copies, then stores consumed[r] = s + 1
// (release); the writer loads every consumed[r] (acquire) before reusing a
// slot. Waiters spin briefly, then sleep on a futex word that the other side
// bumps after each publish/consume; every wait has a deadline, notices
// shutdown(), and checks that the peer process is still alive.
//
// A message of n bytes takes max(1, ceil(n / chunkBytes)) chunks; the first
// carries kFirst and the total length, the last kLast. Every length read from
// shared memory is checked against the geometry before it is used.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace tpcomm::mq {

struct Geometry {
  uint32_t numReaders = 1;
  uint64_t numChunks = 8;
  uint64_t chunkBytes = 1 << 20;
};

class Segment;

// Creates the segment (mode 0600, unguessable name). Readers attach by name;
// once all have attached the writer unlinks it (waitForReaders), so nothing
// is left in /dev/shm after any exit.
class Writer {
 public:
  explicit Writer(const Geometry& geometry);
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  const std::string& name() const;
  // Waits until every reader attached, then unlinks the name. Throws Timeout
  // naming the readers that did not attach.
  void waitForReaders(std::chrono::milliseconds timeout);
  // Writes one message (any size, 0 included). Blocks while the ring is full;
  // throws Timeout, or PeerLost when a reader died or shutdown() was called.
  void write(const void* data, size_t bytes, std::chrono::milliseconds timeout);
  // Writes one message made of `parts` back to back, each copied straight
  // into the chunks (no staging copy).
  struct Part {
    const void* data;
    size_t bytes;
  };
  void write(const std::vector<Part>& parts, std::chrono::milliseconds timeout);
  // Wakes every waiter on both sides; later calls throw PeerLost.
  void shutdown();

 private:
  std::unique_ptr<Segment> segment_;
  uint64_t next_ = 0;  // sequence number of the next chunk
};

class Reader {
 public:
  // Attaches as reader `index` (0 <= index < numReaders; each index once).
  Reader(const std::string& name, uint32_t index);
  ~Reader();
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  // Reads the next message. Throws Timeout, PeerLost (writer died or shut
  // down), or System for a corrupt chunk header.
  std::vector<char> read(std::chrono::milliseconds timeout);
  // Same, copying straight into the memory `allocate(bytes)` returns, called
  // once per message as soon as its length is known. Returns the length.
  uint64_t read(std::chrono::milliseconds timeout,
                const std::function<char*(uint64_t bytes)>& allocate);
  void shutdown();

 private:
  std::unique_ptr<Segment> segment_;
  uint32_t index_;
};

}  // namespace tpcomm::mq
