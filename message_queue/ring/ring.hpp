#pragma once
// tpcomm::mq — one writer, N readers, a ring of chunks in shared memory.
// Plain C++ (no torch). The public header of message_queue/.
//
// The segment is anonymous shared memory (memfd, mode 0600): it never has a
// name in /dev/shm, readers of this host map it through the writer's
// descriptor (/proc/<pid>/fd/<fd>) until every reader attached, and the
// kernel frees it with its last user, so no exit (SIGKILL at any step of the
// creation included) leaves anything behind.
//
// Segment layout (all offsets 64-byte aligned):
//
//   +--------------------------+ 0
//   | Header                   |  magic, version, geometry, writer pid,
//   |                          |  published (u64), publishedWord (futex) and
//   |                          |  its sleepers, consumedWord (futex) and its
//   |                          |  sleepers, attached, shutdown
//   +--------------------------+ kHeaderBytes
//   | ReaderSlot[numReaders]   |  one cache line each: consumed (u64), pid
//   +--------------------------+
//   | ChunkHeader[numChunks]   |  {bytes, flags, messageBytes}
//   +--------------------------+
//   | payload[numChunks]       |  chunkBytes each, back to back: a message
//   |                          |  that does not wrap is one contiguous range
//   +--------------------------+
//
// Sequence numbers never reset (no flag is ever cleared, so a stale flag
// cannot be mistaken for a fresh one): chunk s lives in slot s % numChunks.
//
//   state of chunk s          | condition                       | who may act
//   --------------------------+---------------------------------+--------------
//   free for the writer       | s - min(consumed[r]) < numChunks| writer fills it
//   published                 | published > s                   | readers read
//   consumed by reader r      | consumed[r] > s                 | -
//
// The writer fills a chunk, then stores published = s + 1 (release); a reader
// loads published (acquire), reads, then stores consumed[r] = s + 1
// (release); the writer loads every consumed[r] (acquire) before reusing a
// slot. A reader may read a message in place (readInPlace): it consumes the
// message's chunks only after it is done with them. Waiters poll for a
// while (TPCOMM_MQ_SPIN_US), then sleep on a futex word that the other side
// bumps after each publish/consume, waking only when someone sleeps; every
// wait has a deadline, notices shutdown(), and checks that the peer process
// is still alive (a zombie counts as dead).
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

// How long a wait polls before it sleeps: TPCOMM_MQ_SPIN_US.
std::chrono::microseconds defaultSpin();

// How long a reader's next wait polls, learnt from how its waits ended.
// Polling pays when the message comes within the spin (no wake-up on the
// round trip); when it comes a model step later it only takes the core from
// whatever else runs there, and the wait sleeps anyway. So: of the last
// kWindow waits that found no message at once, if fewer than half were met
// while polling, waits poll briefly (kBrief) and sleep; every kProbeEvery-th
// wait then polls the whole spin, and one that is met polling restores
// polling. Waits that find their message at once say nothing either way.
// TPCOMM_MQ_SPIN_ADAPT=0 (or a spin of 0) turns it off.
class SpinLearner {
 public:
  static constexpr uint32_t kWindow = 16;
  static constexpr uint32_t kProbeEvery = 8;
  static constexpr std::chrono::microseconds kBrief{1};

  explicit SpinLearner(bool enabled) : enabled_(enabled) {}
  // The spin for the next wait, given the configured one.
  std::chrono::microseconds next(std::chrono::microseconds spin);
  // How the wait that next() was asked for ended.
  void record(bool atOnce, bool polled);
  bool brief() const { return brief_; }

 private:
  bool enabled_;
  bool active_ = false;  // the last next() may shorten waits (enabled, spin > 0)
  bool brief_ = false;
  bool probing_ = false;  // the current wait polls fully while brief_
  uint32_t waits_ = 0;    // waits in the window that found no message at once
  uint32_t polled_ = 0;   // of those, met while polling
  uint32_t sinceProbe_ = 0;
};

// Creates the segment. Readers attach by name; once all have attached the
// writer closes the descriptor they attach through (waitForReaders).
class Writer {
 public:
  explicit Writer(const Geometry& geometry);
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  const std::string& name() const;
  // Waits until every reader attached, then closes the descriptor they
  // attach through. Throws Timeout naming the readers that did not attach.
  void waitForReaders(std::chrono::milliseconds timeout);
  // How long this end's waits poll before sleeping. 0 reproduces the queue
  // before polling was tunable: a fixed 4,000 polls, and a wake-up system
  // call after every publish whether or not anyone sleeps.
  void setSpin(std::chrono::microseconds spin) { spin_ = spin; }
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
  // Whether every reader that attached is still alive (one that has not
  // attached yet counts as alive).
  bool readersAlive() const;
  uint32_t numReaders() const;

 private:
  std::unique_ptr<Segment> segment_;
  uint64_t next_ = 0;  // sequence number of the next chunk
  std::chrono::microseconds spin_;
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
  // Reads the next message and hands it to `use` in place, in the ring, when
  // it does not wrap and fits the ring (one copy fewer); otherwise copied.
  // The chunks are consumed (the writer may reuse them) once `use` returns
  // or throws; `use` must not keep the pointer.
  // `allocate` (optional) provides the memory a wrapped message is copied
  // into, as for read().
  void readInPlace(std::chrono::milliseconds timeout,
                   const std::function<void(const char* data, uint64_t bytes)>& use,
                   const std::function<char*(uint64_t bytes)>& allocate = {});
  // How long this end's waits poll at most (SpinLearner shortens them).
  void setSpin(std::chrono::microseconds spin) { spin_ = spin; }
  // Whether the waits now poll briefly (SpinLearner).
  bool pollsBriefly() const { return learner_.brief(); }
  void shutdown();

 private:
  // Copies the message that starts at this reader's next chunk.
  uint64_t copyMessage(std::chrono::steady_clock::time_point deadline,
                       const std::function<char*(uint64_t bytes)>& allocate);
  // Waits until chunk `seq` is published.
  void awaitPublished(uint64_t seq, std::chrono::steady_clock::time_point deadline);
  // The header of chunk `seq`, copied and checked against the geometry.
  struct Checked {
    uint32_t bytes;
    uint32_t flags;
    uint64_t messageBytes;
  };
  Checked checkedHeader(uint64_t seq);
  void consumeUpTo(uint64_t next);

  std::unique_ptr<Segment> segment_;
  uint32_t index_;
  std::chrono::microseconds spin_;
  SpinLearner learner_;
};

}  // namespace tpcomm::mq
