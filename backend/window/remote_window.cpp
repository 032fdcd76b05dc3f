#include "backend/window/remote_window.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "common/error.hpp"

namespace tpcomm::backend {

namespace {

// A receive waits until a message comes or the window stops it (Gloo's
// own default would end it after the group's timeout with nothing wrong).
constexpr std::chrono::milliseconds kForever = std::chrono::hours(24 * 365);
// How long the window's end waits for its peers' closings.
constexpr std::chrono::milliseconds kCloseBound = std::chrono::seconds(10);

}  // namespace

int remoteTag(int window, int registration) {
  return kRemoteTagBit | (window & 0x3fff) << 6 | (registration & 0x3f);
}

RemoteWindow::RemoteWindow(c10::intrusive_ptr<c10d::Backend> gloo, int tag, size_t receiveBytes,
                           std::vector<int> remote,
                           std::function<void(int, const Message&, const uint8_t*)> apply,
                           std::string what)
    : gloo_(std::move(gloo)),
      tag_(tag),
      apply_(std::move(apply)),
      what_(std::move(what)),
      remote_(std::move(remote)) {
  staging_ = at::empty(
      {static_cast<int64_t>(sizeof(Message) + std::min(std::max<size_t>(receiveBytes, 1),
                                                       kRemotePart))},
      at::kByte);
  thread_ = std::thread([this] {
    receive();
    std::lock_guard<std::mutex> lock(workMutex_);
    finished_ = true;
    ended_.notify_all();
  });
}

RemoteWindow::~RemoteWindow() { close(kCloseBound); }

void RemoteWindow::close(std::chrono::milliseconds bound) {
  if (closed_.exchange(true)) return;
  if (bound.count() > 0) {
    for (int peer : remote_) {
      try {
        send(peer, Message{kMagic, kClose, 0, 0, 0}, nullptr, 0, bound);
      } catch (const std::exception&) {
        // A peer gone or a broken group: its closing cannot come either.
      }
    }
  }
  std::unique_lock<std::mutex> lock(workMutex_);
  if (!ended_.wait_for(lock, bound, [&] { return finished_; })) {
    // Not every closing came: the receive is aborted (a message that still
    // comes for it finds no buffer: the group's connection to that peer
    // may stall, which its timeout then ends).
    if (bound.count() > 0) {
      std::fprintf(stderr, "tpcomm: %s: not every peer on another host closed within %lld ms; "
                   "its receive is aborted\n", what_.c_str(),
                   static_cast<long long>(bound.count()));
    }
    stopping_ = true;
    if (pending_) {
      try {
        pending_->abort();
      } catch (const std::exception&) {
      }
    }
  }
  lock.unlock();
  if (thread_.joinable()) thread_.join();
}

std::string RemoteWindow::stopped() const {
  std::lock_guard<std::mutex> lock(workMutex_);
  return stopped_;
}

void RemoteWindow::send(int dst, const Message& header, const void* data, size_t bytes,
                        std::chrono::milliseconds timeout) {
  at::Tensor message = at::empty({static_cast<int64_t>(sizeof(Message) + bytes)}, at::kByte);
  std::memcpy(message.data_ptr(), &header, sizeof(Message));
  if (bytes > 0) std::memcpy(message.data_ptr<uint8_t>() + sizeof(Message), data, bytes);
  std::vector<at::Tensor> tensors{message};
  auto work = gloo_->send(tensors, dst, tag_);
  if (timeout.count() > 0) {
    work->wait(timeout);
  } else {
    work->wait();
  }
}

void RemoteWindow::put(int dst, uint64_t offset, const void* data, size_t bytes,
                       std::chrono::milliseconds timeout) {
  const auto* from = static_cast<const uint8_t*>(data);
  size_t done = 0;
  do {
    const size_t part = std::min(bytes - done, kRemotePart);
    send(dst, Message{kMagic, kPut, offset + done, part, 0}, from + done, part, timeout);
    done += part;
  } while (done < bytes);
}

void RemoteWindow::signal(int dst, std::chrono::milliseconds timeout) {
  send(dst, Message{kMagic, kSignal, 0, 0, 0}, nullptr, 0, timeout);
}

void RemoteWindow::receive() {
  size_t closings = 0;
  while (closings < remote_.size()) {
    c10::intrusive_ptr<c10d::Work> work;
    {
      std::lock_guard<std::mutex> lock(workMutex_);
      if (stopping_) return;
      try {
        std::vector<at::Tensor> tensors{staging_};
        work = gloo_->recvAnysource(tensors, tag_);
        pending_ = work;
      } catch (const std::exception& e) {
        stopped_ = e.what();
        return;
      }
    }
    try {
      const bool done = work->wait(kForever);
      {
        std::lock_guard<std::mutex> lock(workMutex_);
        pending_.reset();
        if (stopping_) return;
        if (!done) {
          stopped_ = "its receive was aborted";
          return;
        }
      }
      Message header;
      std::memcpy(&header, staging_.data_ptr(), sizeof(Message));
      const int source = work->sourceRank();
      TPCOMM_CHECK(header.magic == kMagic &&
                       (header.kind == kPut || header.kind == kSignal || header.kind == kClose) &&
                       header.bytes <= static_cast<uint64_t>(staging_.numel()) - sizeof(Message) &&
                       std::find(remote_.begin(), remote_.end(), source) != remote_.end(),
                   kInvalidUsage, what_, ": rank ", source,
                   " sent a message that is not a window's");
      if (header.kind == kClose) {
        ++closings;
      } else {
        apply_(source, header, staging_.data_ptr<uint8_t>() + sizeof(Message));
      }
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(workMutex_);
      pending_.reset();
      if (!stopping_) stopped_ = e.what();
      return;
    }
  }
}

}  // namespace tpcomm::backend
