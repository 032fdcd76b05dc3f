#pragma once
// tpcomm::mq::Arena — shared memory beside a ring where the writer places
// large tensors itself, so that a message refers to them instead of copying
// them (zero copy). Plain C++ (no torch). Public header of message_queue/.
//
// Layout (one anonymous memfd region, see shared_region.hpp):
//
//   +----------------------------+ 0
//   | ArenaHeader                |  magic, version, capacity, writer pid
//   +----------------------------+ 256
//   | ArenaSlot[kSlots]          |  one cache line each: holds (u32)
//   +----------------------------+ kDataOffset (page-aligned)
//   | data: capacity bytes       |  blocks, 64-byte aligned
//   +----------------------------+
//
// Only the writer allocates; its block list is private to it. A block lives
// in a slot; the slot's `holds` counts the readers' views of it that have not
// died yet.
//
//   block state           | condition                          | who acts
//   ----------------------+------------------------------------+-----------
//   owned by the writer   | the writer's tensor is alive       | writer fills
//   held                  | holds > 0                          | readers read
//   free                  | owner released and holds == 0      | allocate()
//
// The writer adds the number of this host's readers to `holds` (relaxed:
// the ring's publish, a release store, orders it before any reader sees the
// message) before a message that refers to the block is published; each
// reader's view subtracts one when it dies (release); allocate() reuses a
// block only after loading holds == 0 (acquire) and seeing its owner
// released. So a view stays valid for as long as it lives: nothing is ever
// written into a block a reader still sees. A reader that keeps views makes
// allocate() wait, and at its deadline raise a Timeout saying how much of
// the arena the writer's tensors and the readers' views hold.
//
// Thread safety: allocate, find and hold are the writer's, from one thread
// at a time; releaseOwner and release may run on any thread.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace tpcomm::mq {

class SharedRegion;

class Arena {
 public:
  static constexpr uint32_t kSlots = 1024;

  struct Block {
    uint64_t offset = 0;  // from data()
    uint64_t bytes = 0;
    uint32_t slot = 0;
  };

  // Writer: an arena of `capacity` bytes (> 0, at most 64 GiB). Throws
  // InvalidUsage or System.
  static std::shared_ptr<Arena> create(uint64_t capacity);
  // Reader: maps the arena named `name` (its writer still holds the
  // descriptor open). Throws InvalidUsage for a malformed name, System when
  // it cannot map it.
  static std::shared_ptr<Arena> attach(const std::string& name);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  const std::string& name() const { return name_; }
  uint64_t capacity() const { return capacity_; }
  char* data() const { return data_; }
  // Writer: closes the descriptor readers attach through (once they have).
  void closeDescriptor();

  // Writer: a block of at least `bytes` (> 0; rounded up to 64), owned
  // by the writer until releaseOwner(slot). Waits while the arena is full,
  // checking `readersAlive` as it does. Throws InvalidUsage when `bytes`
  // exceeds the capacity, PeerLost when a reader died, Timeout at the
  // deadline (naming what holds the arena).
  Block allocate(uint64_t bytes, std::chrono::milliseconds timeout,
                 const std::function<bool()>& readersAlive);
  // Writer: its tensor over `slot` died (any thread).
  void releaseOwner(uint32_t slot);
  // Writer: the live block that holds [p, p + bytes), if any.
  bool find(const void* p, uint64_t bytes, Block* out) const;
  // Writer: `count` more views of `slot` are on their way to readers; or,
  // for a message that was never published, are not.
  void hold(uint32_t slot, uint32_t count);
  void unhold(uint32_t slot, uint32_t count);

  // Reader: one view of `slot` died.
  void release(uint32_t slot);
  // Reader: whether [offset, offset + bytes) of slot `slot` is a range a
  // frame may refer to.
  bool validRange(uint32_t slot, uint64_t offset, uint64_t bytes) const;

  // Writer: "<used> of <capacity> bytes in <n> blocks (<a> owned by the
  // writer, <b> held by readers' views)".
  std::string describeUse() const;

 private:
  struct Live {
    uint64_t offset;
    uint64_t bytes;
    uint32_t slot;
    bool owned;  // the writer's tensor is alive
  };
  Arena(std::string name, std::unique_ptr<SharedRegion> region, uint64_t capacity);
  std::atomic<uint32_t>& holds(uint32_t slot) const;
  // Frees released blocks nobody holds; under mutex_.
  void reclaim();
  // A block of `bytes` in the first gap that fits, or false; under mutex_.
  bool place(uint64_t bytes, Block* out);

  std::string name_;
  std::unique_ptr<SharedRegion> region_;
  uint64_t capacity_;
  char* data_;
  mutable std::mutex mutex_;
  std::vector<Live> live_;           // the writer's blocks, by offset
  std::vector<uint32_t> freeSlots_;  // the writer's unused slots
};

}  // namespace tpcomm::mq
