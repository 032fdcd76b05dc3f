#include "message_queue/window/shm_window.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "common/error.hpp"
#include "message_queue/region/futex.hpp"
#include "message_queue/region/shared_region.hpp"

namespace tpcomm::mq {

namespace {

constexpr uint64_t kMagic = 0x74706377696e6431ull;  // "tpcwind1"
constexpr size_t kLine = 64;
constexpr size_t kSignalsOffset = 256;
constexpr size_t kPage = 4096;

size_t dataOffset(int size) {
  const size_t end = kSignalsOffset + static_cast<size_t>(size) * kLine;
  return (end + kPage - 1) / kPage * kPage;
}

std::atomic<uint64_t>& signalWord(char* base, int peer) {
  return *reinterpret_cast<std::atomic<uint64_t>*>(base + kSignalsOffset + peer * kLine);
}

}  // namespace

struct ShmWindow::Header {
  uint64_t magic;
  int32_t size;
  int32_t pid;
  uint64_t dataBytes;
  std::atomic<uint32_t> word;      // bumped by every signal to this rank
  std::atomic<uint32_t> sleepers;  // this rank's waits asleep on `word`
};

ShmWindow::ShmWindow(int rank, int size, size_t dataBytes)
    : rank_(rank),
      size_(size),
      regions_(size),
      peers_(size),
      consumed_(size, 0),
      waiting_(new std::mutex[size]) {
  static_assert(std::atomic<uint64_t>::is_always_lock_free &&
                    std::atomic<uint32_t>::is_always_lock_free,
                "the counters other processes read need lock-free atomics");
  static_assert(sizeof(Header) <= kSignalsOffset, "window header too large");
  TPCOMM_CHECK(size >= 1 && rank >= 0 && rank < size, kInvalidUsage, "window: rank ", rank,
               " of ", size);
  regions_[rank] = SharedRegion::create(dataOffset(size) + std::max<size_t>(dataBytes, 1));
  auto* h = new (regions_[rank]->base()) Header{};
  h->magic = kMagic;
  h->size = size;
  h->pid = static_cast<int32_t>(getpid());
  h->dataBytes = dataBytes;
}

ShmWindow::~ShmWindow() = default;

std::string ShmWindow::name() const { return regions_[rank_]->name(); }

ShmWindow::Header* ShmWindow::header(int r) const {
  return reinterpret_cast<Header*>(regions_[r]->base());
}

void ShmWindow::checkRank(int r, const char* what) const {
  TPCOMM_CHECK(r >= 0 && r < size_, kInvalidUsage, what, ": rank ", r, " is not one of the ",
               size_, " ranks of the window");
  TPCOMM_CHECK(regions_[r], kInvalidUsage, what, ": rank ", r,
               "'s window is not mapped in this process (it is on another host)");
}

void ShmWindow::attach(const std::vector<std::string>& names) {
  TPCOMM_CHECK(static_cast<int>(names.size()) == size_, kInvalidUsage, "window: ", names.size(),
               " region names for ", size_, " ranks");
  for (int r = 0; r < size_; ++r) {
    if (r == rank_ || names[r].empty()) continue;
    RegionName name;
    TPCOMM_CHECK(RegionName::parse(names[r], &name), kInvalidUsage, "window: rank ", r,
                 "'s region name '", names[r], "' is not one");
    regions_[r] = SharedRegion::attach(name.pid, name.fd, name.bytes, name.nonce);
    const Header* h = header(r);
    TPCOMM_CHECK(h->magic == kMagic && h->size == size_ &&
                     dataOffset(size_) + h->dataBytes <= regions_[r]->bytes(),
                 kInvalidUsage, "window: rank ", r, "'s region is not a window of ", size_,
                 " ranks");
    peers_[r] = std::make_unique<PeerProcess>(h->pid);
  }
}

void ShmWindow::closeDescriptor() { regions_[rank_]->closeDescriptor(); }

char* ShmWindow::data(int r) const {
  checkRank(r, "window data");
  return regions_[r]->base() + dataOffset(size_);
}

size_t ShmWindow::dataBytes(int r) const {
  checkRank(r, "window data");
  return header(r)->dataBytes;
}

std::shared_ptr<void> ShmWindow::keep(int r) const {
  checkRank(r, "window data");
  return regions_[r];
}

void ShmWindow::put(int dst, size_t offset, const void* src, size_t bytes) {
  checkRank(dst, "put");
  const size_t have = dataBytes(dst);
  TPCOMM_CHECK(offset <= have && bytes <= have - offset, kInvalidUsage, "put of ", bytes,
               " bytes at byte ", offset, " of rank ", dst, "'s window runs past its ", have,
               " bytes");
  if (bytes > 0) std::memmove(data(dst) + offset, src, bytes);
}

void ShmWindow::signal(int dst) {
  checkRank(dst, "signal");
  char* base = regions_[dst]->base();
  signalWord(base, rank_).fetch_add(1, std::memory_order_release);
  Header* h = header(dst);
  wakeSleepers(h->word, h->sleepers);
}

void ShmWindow::deliverSignal(int src) {
  TPCOMM_CHECK(src >= 0 && src < size_, kInvalidUsage, "signal from rank ", src,
               ", not one of the ", size_, " ranks of the window");
  signalWord(regions_[rank_]->base(), src).fetch_add(1, std::memory_order_release);
  Header* h = header(rank_);
  wakeSleepers(h->word, h->sleepers);
}

uint64_t ShmWindow::signalsFrom(int src) const {
  TPCOMM_CHECK(src >= 0 && src < size_, kInvalidUsage, "signals: rank ", src,
               " is not one of the ", size_, " ranks of the window");
  return signalWord(regions_[rank_]->base(), src).load(std::memory_order_acquire);
}

void ShmWindow::waitSignal(int src, std::chrono::milliseconds timeout,
                           const std::function<void()>& check) {
  TPCOMM_CHECK(src >= 0 && src < size_, kInvalidUsage, "wait_signal: rank ", src,
               " is not one of the ", size_, " ranks of the window");
  std::lock_guard<std::mutex> turn(waiting_[src]);
  const uint64_t want = consumed_[src] + 1;
  auto& word = signalWord(regions_[rank_]->base(), src);
  auto arrived = [&] { return word.load(std::memory_order_acquire) >= want; };
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout;
  // A short poll first (a peer a few microseconds away), then sleeps of at
  // most a millisecond, between which the peer's life, the group and the
  // deadline are checked.
  bool got = pollUntil(arrived, start + std::chrono::microseconds(50), 16, {}, true);
  Header* h = header(rank_);
  while (!got) {
    if (check) check();
    if (src != rank_ && peers_[src] && !peers_[src]->alive()) {
      if (arrived()) break;  // its last signal came before it exited
      TPCOMM_THROW(kPeerLost, "wait_signal: rank ", src, " (pid ", peers_[src]->pid(),
                   ") exited before it signalled (signals from it: ", word.load(), ", waited for: ",
                   consumed_[src], ")");
    }
    TPCOMM_CHECK(std::chrono::steady_clock::now() < deadline, kTimeout, "wait_signal: rank ", src,
                 " sent no signal within ", timeout.count(), " ms (signals from it: ", word.load(),
                 ", waited for: ", consumed_[src], ")");
    got = sleepOn(h->word, h->sleepers, arrived, std::chrono::microseconds(1000));
  }
  consumed_[src] = want;
}

}  // namespace tpcomm::mq
