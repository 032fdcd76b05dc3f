// CPU send/recv's framing: the staging buffers, the rest tags, the send
// and recv works (framed_p2p.hpp). The works' completion and the progress
// thread: framed_work.cpp.
#include "coordinator/cpu/framed_p2p.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>

#include "common/error.hpp"
#include "coordinator/debug/debug_check.hpp"

namespace tpcomm::coord {

namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

constexpr int64_t kMagic = 0x7470636f6d6d3032;  // "tpcomm02": the 40-byte header
constexpr int64_t kHeaderBytes = 5 * sizeof(int64_t);

// Staging buffers of kHeaderBytes + kFirstPart bytes, reused (a fresh
// 256 KiB allocation is an mmap and its page faults on every call).
class StagingPool {
 public:
  static StagingPool& get() {
    static auto* pool = new StagingPool();  // never destroyed: works may outlive statics
    return *pool;
  }
  at::Tensor acquire() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        at::Tensor t = std::move(free_.back());
        free_.pop_back();
        return t;
      }
    }
    return at::empty({kHeaderBytes + kFramedFirstPart}, at::TensorOptions().dtype(at::kByte));
  }
  void release(at::Tensor t) {
    if (!t.defined()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.size() < kKept) free_.push_back(std::move(t));
  }

 private:
  static constexpr size_t kKept = 32;
  std::mutex mutex_;
  std::vector<at::Tensor> free_;  // by mutex_
};

std::string describe(int64_t dtype, int64_t numel, int64_t bytes) {
  const auto type = static_cast<c10::ScalarType>(dtype);
  const bool known = dtype >= 0 && dtype < static_cast<int64_t>(c10::ScalarType::NumOptions);
  return detail::concat(numel, " elements of ", known ? dtypeName(type) : "an unknown dtype", " (",
                        bytes, " B)");
}

uint8_t* bytesOf(const at::Tensor& t) { return static_cast<uint8_t*>(t.data_ptr()); }

// The bytes of `t` from `offset` on, as a flat byte tensor (Gloo sends and
// receives it as it is).
at::Tensor tailOf(const at::Tensor& t, int64_t offset) {
  const int64_t n = static_cast<int64_t>(t.numel() * t.element_size());
  return at::from_blob(bytesOf(t) + offset, {n - offset}, at::TensorOptions().dtype(at::kByte));
}

// The first `n` bytes of `t` (a flat byte tensor), sharing its storage, so
// that the bytes live while Gloo holds the view. Made without the
// dispatcher: narrow() cost a small send about 1.5 us.
at::Tensor prefixOf(const at::Tensor& t, int64_t n) {
  auto impl =
      c10::make_intrusive<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(), t.dtype());
  impl->set_sizes_contiguous({n});
  return at::Tensor(std::move(impl));
}

// What is left of `timeout` since `start` (kNoTimeout stays itself).
std::chrono::milliseconds remaining(std::chrono::milliseconds timeout,
                                    std::chrono::steady_clock::time_point start) {
  if (timeout == ::kNoTimeout) return timeout;
  const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - start);
  return std::max(timeout - spent, std::chrono::milliseconds(1));
}

// The tags a call may take: below kFramedRestTagBit (the rest tags lie
// above), and below kFramedLargeTagLimit past the first part (the rest's
// tag carries the tag).
void checkTag(int tag, int64_t bytes) {
  const int limit = bytes > kFramedFirstPart ? kFramedLargeTagLimit : kFramedWindowTagBit;
  TPCOMM_CHECK(tag >= 0 && tag < limit, kInvalidUsage, "send/recv: tag ", tag,
               " is out of range: tpcomm's CPU send/recv takes tags from 0 to ", limit - 1,
               bytes > kFramedFirstPart ? " for a message past " : " (",
               bytes > kFramedFirstPart ? std::to_string(kFramedFirstPart) + " B" : "",
               bytes > kFramedFirstPart
                   ? ""
                   : "larger tags are tpcomm's own: windows' messages, the rests of large ones)");
}

// The tag the rest of the `seq`-th message past the first part from one
// rank to another on `tag` travels on.
int restTag(int tag, uint64_t seq) {
  return kFramedRestTagBit | static_cast<int>((seq % kFramedRestWindow) << 20) | tag;
}

}  // namespace

// A group's numbering of its messages past the first part, per peer and
// tag, and the rest tags its recvs wait on.
class FramedRests {
 public:
  uint64_t nextSend(int dst, int tag) {
    std::lock_guard<std::mutex> lock(mutex_);
    return sends_[{dst, tag}]++;
  }
  // The rest tag of message `seq` from `src` on `tag`, once every message
  // that shares it before this one (seq - kFramedRestWindow and earlier)
  // has its rest in: else none (kFramedRestWindow such messages from one
  // rank on one tag in flight whose rests have not come).
  std::optional<int> reserve(int src, int tag, uint64_t seq) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (seq >= recvs_[{src, tag}].next + kFramedRestWindow) return std::nullopt;
    return restTag(tag, seq);
  }
  // Message `seq`'s rest came.
  void arrived(int src, int tag, uint64_t seq) {
    std::lock_guard<std::mutex> lock(mutex_);
    Lane& lane = recvs_[{src, tag}];
    if (seq != lane.next) {
      lane.later.insert(seq);
      return;
    }
    ++lane.next;
    while (!lane.later.empty() && *lane.later.begin() == lane.next) {
      lane.later.erase(lane.later.begin());
      ++lane.next;
    }
  }

 private:
  struct Lane {
    uint64_t next = 0;         // every message before it has its rest in
    std::set<uint64_t> later;  // rests in past `next`
  };
  std::mutex mutex_;
  std::map<std::pair<int, int>, uint64_t> sends_;  // by mutex_: (dst, tag) -> next number
  std::map<std::pair<int, int>, Lane> recvs_;      // by mutex_: (src, tag)
};

std::shared_ptr<FramedRests> makeFramedRests() { return std::make_shared<FramedRests>(); }

namespace {

class FramedSendWork : public FramedWork {
 public:
  FramedSendWork(WorkPtr first, WorkPtr rest, at::Tensor staging, at::Tensor tensor,
                 std::chrono::milliseconds timeout)
      : FramedWork(-1, c10d::OpType::SEND, timeout),
        first_(std::move(first)),
        rest_(std::move(rest)),
        staging_(std::move(staging)),
        tensor_(std::move(tensor)) {}
  ~FramedSendWork() override {
    // Back to the pool only once Gloo is done with it: sent, and Gloo's
    // works (which hold it) gone.
    const bool sent = isSuccess();
    first_.reset();
    rest_.reset();
    if (sent && staging_.use_count() == 1) StagingPool::get().release(std::move(staging_));
  }
  void abort() override {
    first_->abort();
    if (rest_) rest_->abort();
  }

 protected:
  bool run(std::chrono::milliseconds timeout) override {
    const auto start = std::chrono::steady_clock::now();
    if (!first_->wait(timeout)) return false;
    return !rest_ || rest_->wait(remaining(timeout, start));
  }

 private:
  WorkPtr first_, rest_;
  at::Tensor staging_;
  at::Tensor tensor_;  // the rest's bytes: alive until sent
};

class FramedRecvWork : public FramedWork {
 public:
  FramedRecvWork(c10::intrusive_ptr<c10d::Backend> cpu, const at::Tensor& tensor, int srcRank,
                 int tag, int rank, std::function<void(const std::string&)> breakGroup,
                 std::shared_ptr<FramedRests> rests, std::chrono::milliseconds timeout)
      : FramedWork(rank, srcRank < 0 ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV, timeout),
        cpu_(std::move(cpu)),
        tensor_(tensor),
        staging_(StagingPool::get().acquire()),
        expectedBytes_(static_cast<int64_t>(tensor.numel() * tensor.element_size())),
        expectedDtype_(static_cast<int64_t>(tensor.scalar_type())),
        expectedNumel_(tensor.numel()),
        srcRank_(srcRank),
        tag_(tag),
        rank_(rank),
        breakGroup_(std::move(breakGroup)),
        rests_(std::move(rests)) {
    // Room for the largest first part any send has: a larger send cannot
    // overrun it, a smaller one fills part of it.
    std::vector<at::Tensor> first{staging_};
    firstWork_ = srcRank < 0 ? cpu_->recvAnysource(first, tag) : cpu_->recv(first, srcRank, tag);
  }
  ~FramedRecvWork() override {
    // As a send's: back to the pool only once Gloo is done with it.
    const bool received = isSuccess();
    firstWork_.reset();
    if (received && staging_.use_count() == 1) StagingPool::get().release(std::move(staging_));
  }

  void abort() override {
    firstWork_->abort();
    std::lock_guard<std::mutex> lock(mutex_);
    if (restWork_) restWork_->abort();
  }
  int sourceRank() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return source_ >= 0 ? source_ : srcRank_;
  }

 protected:
  bool run(std::chrono::milliseconds timeout) override {
    const auto start = std::chrono::steady_clock::now();
    const int src = takeFirst(timeout);
    if (src < 0) return false;  // aborted
    WorkPtr rest;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      rest = restWork_;
    }
    if (!rest) return true;
    // Its rest tag is free for a later message only once the rest came: a
    // rest recv that failed or was aborted may still be posted.
    if (!rest->wait(remaining(timeout, start))) return false;
    rests_->arrived(src, tag_, seq_);
    return true;
  }

 private:
  // Waits for the first part (up to `timeout`, Gloo's own when none),
  // checks its header, copies its bytes and posts the rest's recv, or
  // breaks the group and raises. The rank it came from; -1 when aborted.
  int takeFirst(std::chrono::milliseconds timeout);

  const c10::intrusive_ptr<c10d::Backend> cpu_;
  const at::Tensor tensor_;
  at::Tensor staging_;
  const int64_t expectedBytes_, expectedDtype_, expectedNumel_;
  const int srcRank_, tag_, rank_;
  const std::function<void(const std::string&)> breakGroup_;
  const std::shared_ptr<FramedRests> rests_;
  WorkPtr firstWork_;
  uint64_t seq_ = 0;          // set by takeFirst: the message's number
  mutable std::mutex mutex_;  // for abort() and sourceRank() from other threads
  WorkPtr restWork_;          // by mutex_
  int source_ = -1;           // by mutex_
};

int FramedRecvWork::takeFirst(std::chrono::milliseconds timeout) {
  if (!firstWork_->wait(timeout)) return -1;  // aborted (Gloo's error raises)
  const int src = srcRank_ < 0 ? firstWork_->sourceRank() : srcRank_;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    source_ = src;
  }
  int64_t h[5];
  std::memcpy(h, bytesOf(staging_), kHeaderBytes);
  std::string error;
  if (h[0] != kMagic) {
    error = detail::concat("rank ", rank_, "'s recv from rank ", src, " (tag ", tag_,
                           ") got no tpcomm message header: is rank ", src,
                           " built from the same tpcomm?");
  } else if (h[1] != expectedBytes_ || h[2] != expectedDtype_) {
    error = detail::concat("rank ", rank_, "'s recv from rank ", src, " (tag ", tag_, ") expected ",
                           describe(expectedDtype_, expectedNumel_, expectedBytes_), "; rank ", src,
                           " sent ", describe(h[2], h[3], h[1]),
                           ": a send and its recv must match in size and dtype");
  }
  if (!error.empty()) {
    // The rest (if any) stays unread: the group breaks, which ends the
    // sender's send and every later call of both ranks.
    if (breakGroup_) breakGroup_(error);
    TPCOMM_THROW(kInvalidUsage, error);
  }
  std::memcpy(bytesOf(tensor_), bytesOf(staging_) + kHeaderBytes,
              std::min(expectedBytes_, kFramedFirstPart));
  if (expectedBytes_ > kFramedFirstPart) {
    seq_ = static_cast<uint64_t>(h[4]);
    const std::optional<int> restTag = rests_->reserve(src, tag_, seq_);
    if (!restTag) {
      const std::string why = detail::concat(
          "rank ", rank_, "'s recv from rank ", src, " (tag ", tag_, "): more than ",
          kFramedRestWindow, " messages past ", kFramedFirstPart, " B from rank ", src, " on tag ",
          tag_, " were in flight at once (their rests not yet received)");
      if (breakGroup_) breakGroup_(why);
      TPCOMM_THROW(kInvalidUsage, why);
    }
    std::vector<at::Tensor> buffers{tailOf(tensor_, kFramedFirstPart)};
    WorkPtr rest = cpu_->recv(buffers, src, *restTag);
    std::lock_guard<std::mutex> lock(mutex_);
    restWork_ = std::move(rest);
  }
  return src;
}

}  // namespace

WorkPtr framedSend(const c10::intrusive_ptr<c10d::Backend>& cpu, const at::Tensor& tensor,
                   int dstRank, int tag, const std::shared_ptr<FramedRests>& rests,
                   std::chrono::milliseconds timeout) {
  TPCOMM_CHECK(tensor.is_contiguous(), kInvalidUsage, "send: the tensor must be contiguous");
  const int64_t bytes = static_cast<int64_t>(tensor.numel() * tensor.element_size());
  checkTag(tag, bytes);
  const int64_t first = std::min(bytes, kFramedFirstPart);
  // Only messages with a rest are numbered.
  const uint64_t seq = bytes > kFramedFirstPart ? rests->nextSend(dstRank, tag) : 0;
  at::Tensor staging = StagingPool::get().acquire();
  const int64_t h[5] = {kMagic, bytes, static_cast<int64_t>(tensor.scalar_type()), tensor.numel(),
                        static_cast<int64_t>(seq)};
  std::memcpy(bytesOf(staging), h, kHeaderBytes);
  if (first > 0) std::memcpy(bytesOf(staging) + kHeaderBytes, bytesOf(tensor), first);
  std::vector<at::Tensor> firstPart{prefixOf(staging, kHeaderBytes + first)};
  WorkPtr firstWork = cpu->send(firstPart, dstRank, tag);
  WorkPtr restWork;
  if (bytes > kFramedFirstPart) {
    std::vector<at::Tensor> rest{tailOf(tensor, kFramedFirstPart)};
    restWork = cpu->send(rest, dstRank, restTag(tag, seq));
  }
  auto work = c10::make_intrusive<FramedSendWork>(std::move(firstWork), std::move(restWork),
                                                  std::move(staging), tensor, timeout);
  trackFramedWork(work, cpu.get(), true, dstRank, tag);
  return work;
}

WorkPtr framedRecv(const c10::intrusive_ptr<c10d::Backend>& cpu, const at::Tensor& tensor,
                   int srcRank, int tag, int rank,
                   std::function<void(const std::string&)> breakGroup,
                   const std::shared_ptr<FramedRests>& rests, std::chrono::milliseconds timeout) {
  TPCOMM_CHECK(tensor.is_contiguous(), kInvalidUsage, "recv: the tensor must be contiguous");
  checkTag(tag, static_cast<int64_t>(tensor.numel() * tensor.element_size()));
  auto work = c10::make_intrusive<FramedRecvWork>(cpu, tensor, srcRank, tag, rank,
                                                  std::move(breakGroup), rests, timeout);
  trackFramedWork(work, cpu.get(), false, srcRank, tag);
  return work;
}

}  // namespace tpcomm::coord
