#include "message_queue/segment.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <thread>

#include "coordinator/common/error.hpp"
#include "message_queue/futex.hpp"

namespace tpcomm::mq {

namespace {

constexpr int kSpins = 4000;
constexpr auto kSleepSlice = std::chrono::milliseconds(50);

size_t alignUp(size_t n) { return (n + kCacheLine - 1) / kCacheLine * kCacheLine; }

size_t chunkStride(uint64_t chunkBytes) { return alignUp(sizeof(ChunkHeader) + chunkBytes); }

size_t slotsOffset() { return kHeaderBytes; }

size_t chunksOffset(uint32_t numReaders) {
  return alignUp(slotsOffset() + numReaders * sizeof(ReaderSlot));
}

std::string randomName() {
  unsigned char bytes[16];
  int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  TPCOMM_CHECK(fd >= 0, kSystem, "open /dev/urandom: ", std::strerror(errno));
  ssize_t got = ::read(fd, bytes, sizeof(bytes));
  ::close(fd);
  TPCOMM_CHECK(got == static_cast<ssize_t>(sizeof(bytes)), kSystem, "read /dev/urandom failed");
  static const char* hex = "0123456789abcdef";
  std::string name = "/tpcomm-mq-";
  for (unsigned char b : bytes) {
    name += hex[b >> 4];
    name += hex[b & 15];
  }
  return name;
}

}  // namespace

uint64_t segmentBytes(const Geometry& g) {
  TPCOMM_CHECK(g.numReaders >= 1 && g.numReaders <= kMaxReaders, kInvalidUsage,
               "message queue: numReaders must be in [1, ", kMaxReaders, "], got ", g.numReaders);
  TPCOMM_CHECK(g.numChunks >= 1 && g.numChunks <= (1u << 20), kInvalidUsage,
               "message queue: numChunks must be in [1, 2^20], got ", g.numChunks);
  TPCOMM_CHECK(g.chunkBytes >= 64 && g.chunkBytes <= (1ull << 32) - 64, kInvalidUsage,
               "message queue: chunkBytes must be in [64, 2^32 - 64], got ", g.chunkBytes);
  const uint64_t total = chunksOffset(g.numReaders) + g.numChunks * chunkStride(g.chunkBytes);
  TPCOMM_CHECK(total <= (64ull << 30), kInvalidUsage, "message queue: segment of ", total,
               " bytes exceeds 64 GiB");
  return total;
}

Segment::Segment(std::string name, void* base, size_t bytes, bool owner, Geometry geometry)
    : name_(std::move(name)), geometry_(geometry), base_(base), bytes_(bytes), owner_(owner) {}

Segment::~Segment() {
  if (owner_) unlink();
  ::munmap(base_, bytes_);
}

void Segment::unlink() {
  if (unlinked_) return;
  unlinked_ = true;
  ::shm_unlink(name_.c_str());  // ENOENT is fine: already gone
}

std::unique_ptr<Segment> Segment::create(const Geometry& g) {
  const uint64_t bytes = segmentBytes(g);
  std::string name = randomName();
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  TPCOMM_CHECK(fd >= 0, kSystem, "shm_open(", name, "): ", std::strerror(errno));
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    ::close(fd);
    ::shm_unlink(name.c_str());
    TPCOMM_THROW(kSystem, "ftruncate(", name, ", ", bytes, "): ", std::strerror(err));
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    TPCOMM_THROW(kSystem, "mmap(", name, "): ", std::strerror(err));
  }
  auto segment = std::unique_ptr<Segment>(new Segment(name, base, bytes, /*owner=*/true, g));
  Header* h = new (base) Header();
  h->magic = kMagic;
  h->version = kVersion;
  h->numReaders = g.numReaders;
  h->numChunks = g.numChunks;
  h->chunkBytes = g.chunkBytes;
  h->totalBytes = bytes;
  h->writerPid = ::getpid();
  for (uint32_t r = 0; r < g.numReaders; ++r) new (&segment->slot(r)) ReaderSlot();
  return segment;
}

std::unique_ptr<Segment> Segment::attach(const std::string& name) {
  int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  TPCOMM_CHECK(fd >= 0, kSystem, "shm_open(", name, "): ", std::strerror(errno),
               " (a segment is unlinked once every reader attached)");
  struct stat st;
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < kHeaderBytes) {
    ::close(fd);
    TPCOMM_THROW(kSystem, "message queue segment ", name, " is too small to hold a header");
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  TPCOMM_CHECK(base != MAP_FAILED, kSystem, "mmap(", name, "): ", std::strerror(err));
  const Header& h = *static_cast<const Header*>(base);
  if (h.magic != kMagic || h.version != kVersion) {
    ::munmap(base, bytes);
    TPCOMM_THROW(kSystem, "segment ", name, " is not a tpcomm message queue (version ", kVersion,
                 ")");
  }
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
  if (expected != bytes || h.totalBytes != bytes) {
    ::munmap(base, bytes);
    TPCOMM_THROW(kSystem, "segment ", name, " geometry does not match its size (", bytes,
                 " bytes)");
  }
  return std::unique_ptr<Segment>(new Segment(name, base, bytes, /*owner=*/false, g));
}

ReaderSlot& Segment::slot(uint32_t r) {
  return *reinterpret_cast<ReaderSlot*>(static_cast<char*>(base_) + slotsOffset() +
                                        r * sizeof(ReaderSlot));
}

ChunkHeader& Segment::chunkHeader(uint64_t seq) {
  const Geometry& g = geometry_;
  const size_t offset =
      chunksOffset(g.numReaders) + (seq % g.numChunks) * chunkStride(g.chunkBytes);
  return *reinterpret_cast<ChunkHeader*>(static_cast<char*>(base_) + offset);
}

char* Segment::chunkData(uint64_t seq) {
  return reinterpret_cast<char*>(&chunkHeader(seq)) + sizeof(ChunkHeader);
}

void Segment::notify(std::atomic<uint32_t>& word) {
  word.fetch_add(1, std::memory_order_release);
  futexWakeAll(word);
}

void Segment::wait(std::atomic<uint32_t>& word, const std::function<bool()>& ready,
                   const std::function<bool()>& peerAlive, std::chrono::milliseconds timeout,
                   const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (int i = 0; i < kSpins; ++i) {
    if (ready()) return;
    if ((i & 255) == 255) std::this_thread::yield();
  }
  Header& h = header();
  while (true) {
    const uint32_t seen = word.load(std::memory_order_acquire);
    if (ready()) return;
    TPCOMM_CHECK(h.shutdown.load(std::memory_order_acquire) == 0, kPeerLost, "message queue ",
                 name_, " was shut down while ", what);
    TPCOMM_CHECK(peerAlive(), kPeerLost, "message queue ", name_, ": a peer process died while ",
                 what);
    const auto now = std::chrono::steady_clock::now();
    TPCOMM_CHECK(now < deadline, kTimeout, "message queue ", name_, ": timed out after ",
                 timeout.count(), " ms ", what);
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
    futexWait(
        word, seen,
        std::chrono::microseconds(std::min(left + std::chrono::milliseconds(1), kSleepSlice)));
  }
}

}  // namespace tpcomm::mq
