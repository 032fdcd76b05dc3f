#include "message_queue/arena/arena.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <new>
#include <thread>

#include "common/error.hpp"
#include "message_queue/region/shared_region.hpp"

namespace tpcomm::mq {

namespace {

constexpr uint64_t kArenaMagic = 0x7470636f6d6d6172ULL;  // "tpcommar"
constexpr uint32_t kArenaVersion = 1;
constexpr size_t kLine = 64;
constexpr size_t kSlotsOffset = 256;
constexpr size_t kDataOffset = kSlotsOffset + Arena::kSlots * kLine;  // 64 KiB + 256: page-rounded
constexpr size_t kDataStart = (kDataOffset + 4095) / 4096 * 4096;
constexpr uint64_t kMaxCapacity = 64ull << 30;

struct ArenaHeader {
  uint64_t magic;
  uint32_t version;
  int32_t writerPid;
  uint64_t capacity;
  uint64_t token;  // the region nonce's first word
};
static_assert(sizeof(ArenaHeader) <= kSlotsOffset, "header must fit its reserved bytes");

uint64_t roundUp(uint64_t n) { return (n + kLine - 1) / kLine * kLine; }

}  // namespace

Arena::Arena(std::string name, std::unique_ptr<SharedRegion> region, uint64_t capacity)
    : name_(std::move(name)),
      region_(std::move(region)),
      capacity_(capacity),
      data_(region_->base() + kDataStart) {}

Arena::~Arena() = default;

std::atomic<uint32_t>& Arena::holds(uint32_t slot) const {
  return *reinterpret_cast<std::atomic<uint32_t>*>(region_->base() + kSlotsOffset + slot * kLine);
}

std::shared_ptr<Arena> Arena::create(uint64_t capacity) {
  TPCOMM_CHECK(capacity > 0 && capacity <= kMaxCapacity, kInvalidUsage,
               "message queue arena: capacity must be in [1, 64 GiB], got ", capacity, " bytes");
  capacity = roundUp(capacity);
  std::unique_ptr<SharedRegion> region = SharedRegion::create(kDataStart + capacity);
  const std::string name = region->name();
  auto* h = new (region->base()) ArenaHeader();
  h->magic = kArenaMagic;
  h->version = kArenaVersion;
  h->writerPid = ::getpid();
  h->capacity = capacity;
  h->token = region->nonce().words[0];
  for (uint32_t s = 0; s < kSlots; ++s) {
    new (region->base() + kSlotsOffset + s * kLine) std::atomic<uint32_t>(0);
  }
  std::shared_ptr<Arena> arena(new Arena(name, std::move(region), capacity));
  arena->freeSlots_.reserve(kSlots);
  for (uint32_t s = kSlots; s-- > 0;) arena->freeSlots_.push_back(s);
  return arena;
}

std::shared_ptr<Arena> Arena::attach(const std::string& name) {
  RegionName where;
  TPCOMM_CHECK(RegionName::parse(name, &where) && where.bytes > kDataStart, kInvalidUsage, "'",
               name, "' is not the name of a message queue arena");
  std::unique_ptr<SharedRegion> region;
  try {
    region =
        SharedRegion::attach(where.pid, where.fd, static_cast<size_t>(where.bytes), where.nonce);
  } catch (const Error& e) {
    TPCOMM_THROW(kSystem, "message queue arena ", name, ": ", e.what());
  }
  const auto& h = *reinterpret_cast<const ArenaHeader*>(region->base());
  TPCOMM_CHECK(h.magic == kArenaMagic && h.version == kArenaVersion && h.writerPid == where.pid &&
                   h.token == where.nonce.words[0] && h.capacity + kDataStart == where.bytes,
               kSystem, "message queue arena ", name, " is not a tpcomm arena (version ",
               kArenaVersion, ")");
  const uint64_t capacity = h.capacity;
  return std::shared_ptr<Arena>(new Arena(name, std::move(region), capacity));
}

void Arena::closeDescriptor() { region_->closeDescriptor(); }

void Arena::reclaim() {
  live_.erase(std::remove_if(live_.begin(), live_.end(),
                             [&](const Live& b) {
                               if (b.owned || holds(b.slot).load(std::memory_order_acquire) != 0) {
                                 return false;
                               }
                               freeSlots_.push_back(b.slot);
                               return true;
                             }),
              live_.end());
}

bool Arena::place(uint64_t bytes, Block* out) {
  if (freeSlots_.empty()) return false;
  uint64_t start = 0;
  size_t at = 0;
  for (; at <= live_.size(); ++at) {
    const uint64_t end = at < live_.size() ? live_[at].offset : capacity_;
    if (end - start >= bytes) break;
    if (at < live_.size()) start = live_[at].offset + live_[at].bytes;
  }
  if (at > live_.size()) return false;
  const uint32_t slot = freeSlots_.back();
  freeSlots_.pop_back();
  live_.insert(live_.begin() + static_cast<std::ptrdiff_t>(at), Live{start, bytes, slot, true});
  *out = Block{start, bytes, slot};
  return true;
}

Arena::Block Arena::allocate(uint64_t bytes, std::chrono::milliseconds timeout,
                             const std::function<bool()>& readersAlive) {
  TPCOMM_CHECK(bytes > 0 && bytes <= capacity_, kInvalidUsage, "message queue arena: a tensor of ",
               bytes, " bytes does not fit an arena of ", capacity_, " bytes");
  bytes = roundUp(bytes);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(20);
  while (true) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      reclaim();
      Block block;
      if (place(bytes, &block)) return block;
    }
    TPCOMM_CHECK(!readersAlive || readersAlive(), kPeerLost, "message queue arena: a reader ",
                 "exited while the arena is full (", describeUse(), ")");
    TPCOMM_CHECK(std::chrono::steady_clock::now() < deadline, kTimeout,
                 "message queue arena: no room for ", bytes, " bytes within ", timeout.count(),
                 " ms: ", describeUse(),
                 ". Readers' tensors of earlier messages keep their blocks until they die; "
                 "drop them, or create the queue with a larger arena_bytes");
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
}

void Arena::releaseOwner(uint32_t slot) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (Live& b : live_) {
    if (b.slot == slot) {
      b.owned = false;
      return;
    }
  }
}

bool Arena::find(const void* p, uint64_t bytes, Block* out) const {
  const char* c = static_cast<const char*>(p);
  if (c < data_ || c + bytes > data_ + capacity_) return false;
  const uint64_t offset = static_cast<uint64_t>(c - data_);
  std::lock_guard<std::mutex> lock(mutex_);
  for (const Live& b : live_) {
    if (offset >= b.offset && offset + bytes <= b.offset + b.bytes) {
      *out = Block{offset, bytes, b.slot};
      return true;
    }
  }
  return false;
}

void Arena::hold(uint32_t slot, uint32_t count) {
  holds(slot).fetch_add(count, std::memory_order_relaxed);
}

void Arena::unhold(uint32_t slot, uint32_t count) {
  std::atomic<uint32_t>& h = holds(slot);
  uint32_t v = h.load(std::memory_order_relaxed);
  // Never below zero: a count that wrapped would hold the block forever.
  while (v != 0 && !h.compare_exchange_weak(v, v - std::min(v, count), std::memory_order_release,
                                            std::memory_order_relaxed)) {
  }
}

void Arena::release(uint32_t slot) { unhold(slot, 1); }

bool Arena::validRange(uint32_t slot, uint64_t offset, uint64_t bytes) const {
  return slot < kSlots && offset <= capacity_ && bytes <= capacity_ - offset;
}

std::string Arena::describeUse() const {
  std::lock_guard<std::mutex> lock(mutex_);
  uint64_t used = 0, owned = 0, held = 0;
  for (const Live& b : live_) {
    used += b.bytes;
    if (b.owned) owned += b.bytes;
    if (holds(b.slot).load(std::memory_order_acquire) != 0) held += b.bytes;
  }
  return detail::concat(used, " of ", capacity_, " bytes in ", live_.size(), " blocks (", owned,
                        " bytes owned by the writer's tensors, ", held,
                        " bytes held by readers' views)");
}

}  // namespace tpcomm::mq
