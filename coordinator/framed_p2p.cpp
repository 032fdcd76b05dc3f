#include "coordinator/framed_p2p.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "coordinator/common/error.hpp"
#include "coordinator/debug_check.hpp"

namespace tpcomm::coord {

namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

constexpr int64_t kMagic = 0x7470636f6d6d3031;  // "tpcomm01"
constexpr int64_t kHeaderBytes = 4 * sizeof(int64_t);

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

class FramedSendWork : public c10d::Work {
 public:
  FramedSendWork(WorkPtr first, WorkPtr rest, at::Tensor staging, at::Tensor tensor)
      : c10d::Work(-1, c10d::OpType::SEND),
        first_(std::move(first)),
        rest_(std::move(rest)),
        staging_(std::move(staging)),
        tensor_(std::move(tensor)) {}
  ~FramedSendWork() override {
    // Back to the pool only once Gloo is done with it.
    if (done_) StagingPool::get().release(std::move(staging_));
  }
  bool isCompleted() override { return done_; }
  bool isSuccess() const override { return done_; }
  bool wait(std::chrono::milliseconds timeout) override {
    const bool a = first_->wait(timeout);
    const bool b = !rest_ || rest_->wait(timeout);
    done_ = a && b;
    return done_;
  }
  void abort() override {
    first_->abort();
    if (rest_) rest_->abort();
  }

 private:
  WorkPtr first_, rest_;
  at::Tensor staging_;
  at::Tensor tensor_;              // the rest's bytes: alive until sent
  std::atomic<bool> done_{false};  // set by wait(), read by any thread
};

class FramedRecvWork : public c10d::Work {
 public:
  FramedRecvWork(c10::intrusive_ptr<c10d::Backend> cpu, const at::Tensor& tensor, int srcRank,
                 int tag, int rank, std::function<void(const std::string&)> breakGroup)
      : c10d::Work(rank, srcRank < 0 ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV),
        cpu_(std::move(cpu)),
        tensor_(tensor),
        staging_(StagingPool::get().acquire()),
        expectedBytes_(static_cast<int64_t>(tensor.numel() * tensor.element_size())),
        expectedDtype_(static_cast<int64_t>(tensor.scalar_type())),
        expectedNumel_(tensor.numel()),
        srcRank_(srcRank),
        tag_(tag),
        rank_(rank),
        breakGroup_(std::move(breakGroup)) {
    // Room for the largest first part any send has: a larger send cannot
    // overrun it, a smaller one fills part of it.
    std::vector<at::Tensor> first{staging_};
    firstWork_ = srcRank < 0 ? cpu_->recvAnysource(first, tag) : cpu_->recv(first, srcRank, tag);
  }
  ~FramedRecvWork() override {
    if (settled_) StagingPool::get().release(std::move(staging_));
  }

  bool hasRest() const { return expectedBytes_ > kFramedFirstPart; }

  // Whether this caller is the one to take the first part (takeFirst()).
  bool claim() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (claimed_) return false;
    claimed_ = true;
    return true;
  }

  // Waits for the first part (Gloo's own timeout bounds it; an abort ends
  // it), checks its header, copies its bytes and posts the rest's recv, or
  // breaks the group. Once, by the claimer.
  void takeFirst() {
    std::exception_ptr failure;
    bool arrived = false;
    try {
      arrived = firstWork_->wait();
    } catch (...) {
      failure = std::current_exception();
    }
    std::string error;
    WorkPtr rest;
    int src = srcRank_;
    if (arrived && !failure) {
      if (src < 0) src = firstWork_->sourceRank();
      int64_t h[4];
      std::memcpy(h, bytesOf(staging_), kHeaderBytes);
      if (h[0] != kMagic) {
        error = detail::concat("rank ", rank_, "'s recv from rank ", src, " (tag ", tag_,
                               ") got no tpcomm message header: is rank ", src,
                               " built from the same tpcomm?");
      } else if (h[1] != expectedBytes_ || h[2] != expectedDtype_) {
        error = detail::concat(
            "rank ", rank_, "'s recv from rank ", src, " (tag ", tag_, ") expected ",
            describe(expectedDtype_, expectedNumel_, expectedBytes_), "; rank ", src, " sent ",
            describe(h[2], h[3], h[1]), ": a send and its recv must match in size and dtype");
      }
      if (!error.empty()) {
        // The rest (if any) stays unread: the group breaks, which ends the
        // sender's send and every later call of both ranks.
        if (breakGroup_) breakGroup_(error);
      } else {
        std::memcpy(bytesOf(tensor_), bytesOf(staging_) + kHeaderBytes,
                    std::min(expectedBytes_, kFramedFirstPart));
        if (hasRest()) {
          try {
            std::vector<at::Tensor> buffers{tailOf(tensor_, kFramedFirstPart)};
            rest = cpu_->recv(buffers, src, tag_);
          } catch (...) {
            failure = std::current_exception();
          }
        }
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      failure_ = failure;
      error_ = error;
      arrived_ = arrived;
      restWork_ = rest;
      source_ = src;
      settled_ = true;
    }
    settledCv_.notify_all();
  }

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  bool isSuccess() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_ && !failure_ && error_.empty();
  }
  bool wait(std::chrono::milliseconds timeout) override {
    const auto start = std::chrono::steady_clock::now();
    if (claim()) {
      takeFirst();
    } else {
      std::unique_lock<std::mutex> lock(mutex_);
      auto ready = [&] { return settled_; };
      if (timeout == ::kNoTimeout) {
        settledCv_.wait(lock, ready);
      } else if (!settledCv_.wait_for(lock, timeout, ready)) {
        return false;
      }
    }
    WorkPtr rest;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failure_) std::rethrow_exception(failure_);
      if (!error_.empty()) TPCOMM_THROW(kInvalidUsage, error_);
      if (!arrived_) return false;  // aborted
      rest = restWork_;
    }
    bool ok = true;
    if (rest) {
      if (timeout == ::kNoTimeout) {
        ok = rest->wait(timeout);
      } else {
        const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(
            std::chrono::steady_clock::now() - start);
        ok = rest->wait(std::max(timeout - spent, std::chrono::milliseconds(1)));
      }
    }
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = ok;
    return ok;
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

 private:
  const c10::intrusive_ptr<c10d::Backend> cpu_;
  const at::Tensor tensor_;
  at::Tensor staging_;
  const int64_t expectedBytes_, expectedDtype_, expectedNumel_;
  const int srcRank_, tag_, rank_;
  const std::function<void(const std::string&)> breakGroup_;
  WorkPtr firstWork_;
  mutable std::mutex mutex_;
  std::condition_variable settledCv_;
  bool claimed_ = false;        // by mutex_: a thread takes the first part
  bool settled_ = false;        // by mutex_: it did
  bool arrived_ = false;        // by mutex_: the first part came (not aborted)
  bool done_ = false;           // by mutex_: a wait() saw every byte in
  WorkPtr restWork_;            // by mutex_
  std::string error_;           // by mutex_: a mismatch
  std::exception_ptr failure_;  // by mutex_: Gloo's error
  int source_ = -1;             // by mutex_
};

// Takes the first part of recvs of more than kFramedFirstPart bytes that
// nobody waits on: their rest's recv is posted only once the header says
// how much comes, and Gloo's recv works complete only inside wait()
// (isCompleted() never turns true by itself). One scheduler thread looks
// at each such recv 200 us after it was made; a recv waited on by then
// (dist.recv: at once) did it itself and costs nothing more, any other gets
// a thread of its own that waits for the first part, posts the rest and
// ends.
class Progress {
 public:
  static Progress& get() {
    static auto* progress = new Progress();  // never destroyed: a detached thread
    return *progress;
  }
  void add(const c10::intrusive_ptr<FramedRecvWork>& work);

 private:
  static constexpr auto kDelay = std::chrono::microseconds(200);
  struct Item {
    c10::weak_intrusive_ptr<FramedRecvWork> work;
    std::chrono::steady_clock::time_point due;
  };
  Progress() {
    std::thread([this] { schedule(); }).detach();
  }
  void schedule();
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Item> queue_;  // by mutex_
};

void Progress::add(const c10::intrusive_ptr<FramedRecvWork>& work) {
  std::lock_guard<std::mutex> lock(mutex_);
  queue_.push_back(Item{c10::weak_intrusive_ptr<FramedRecvWork>(work),
                        std::chrono::steady_clock::now() + kDelay});
  if (queue_.size() == 1) wake_.notify_one();
}

void Progress::schedule() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return !queue_.empty(); });
    const auto due = queue_.front().due;
    lock.unlock();
    std::this_thread::sleep_until(due);
    lock.lock();
    // Every item due by now (they are in order of making).
    const auto now = std::chrono::steady_clock::now();
    while (!queue_.empty() && queue_.front().due <= now) {
      auto work = queue_.front().work.lock();
      queue_.pop_front();
      if (work && work->claim()) {
        std::thread([work = std::move(work)] { work->takeFirst(); }).detach();
      }
    }
  }
}

}  // namespace

WorkPtr framedSend(const c10::intrusive_ptr<c10d::Backend>& cpu, const at::Tensor& tensor,
                   int dstRank, int tag) {
  TPCOMM_CHECK(tensor.is_contiguous(), kInvalidUsage, "send: the tensor must be contiguous");
  const int64_t bytes = static_cast<int64_t>(tensor.numel() * tensor.element_size());
  const int64_t first = std::min(bytes, kFramedFirstPart);
  at::Tensor staging = StagingPool::get().acquire();
  const int64_t h[4] = {kMagic, bytes, static_cast<int64_t>(tensor.scalar_type()), tensor.numel()};
  std::memcpy(bytesOf(staging), h, kHeaderBytes);
  if (first > 0) std::memcpy(bytesOf(staging) + kHeaderBytes, bytesOf(tensor), first);
  std::vector<at::Tensor> firstPart{staging.narrow(0, 0, kHeaderBytes + first)};
  WorkPtr firstWork = cpu->send(firstPart, dstRank, tag);
  WorkPtr restWork;
  if (bytes > kFramedFirstPart) {
    std::vector<at::Tensor> rest{tailOf(tensor, kFramedFirstPart)};
    restWork = cpu->send(rest, dstRank, tag);
  }
  return c10::make_intrusive<FramedSendWork>(std::move(firstWork), std::move(restWork),
                                             std::move(staging), tensor);
}

WorkPtr framedRecv(const c10::intrusive_ptr<c10d::Backend>& cpu, const at::Tensor& tensor,
                   int srcRank, int tag, int rank,
                   std::function<void(const std::string&)> breakGroup) {
  TPCOMM_CHECK(tensor.is_contiguous(), kInvalidUsage, "recv: the tensor must be contiguous");
  auto work =
      c10::make_intrusive<FramedRecvWork>(cpu, tensor, srcRank, tag, rank, std::move(breakGroup));
  // Only a recv with a rest needs its first part taken to make progress.
  if (work->hasRest()) Progress::get().add(work);
  return work;
}

}  // namespace tpcomm::coord
