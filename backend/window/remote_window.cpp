#include "backend/window/remote_window.hpp"

#include <cstring>

#include "common/error.hpp"

namespace tpcomm::backend {

namespace {

// A receive waits until a message comes or the window stops it (Gloo's
// own default would end it after the group's timeout with nothing wrong).
constexpr std::chrono::milliseconds kForever = std::chrono::hours(24 * 365);

}  // namespace

int remoteTag(int window, int registration) {
  return kRemoteTagBit | (window & 0x3fff) << 6 | (registration & 0x3f);
}

RemoteWindow::RemoteWindow(c10::intrusive_ptr<c10d::Backend> gloo, int tag, size_t receiveBytes,
                           std::function<void(int, const Message&, const uint8_t*)> apply,
                           std::string what)
    : gloo_(std::move(gloo)), tag_(tag), apply_(std::move(apply)), what_(std::move(what)) {
  if (receiveBytes == 0) return;
  staging_ = at::empty({static_cast<int64_t>(sizeof(Message) + std::min(receiveBytes, kRemotePart))},
                       at::kByte);
  thread_ = std::thread([this] { receive(); });
}

RemoteWindow::~RemoteWindow() {
  {
    std::lock_guard<std::mutex> lock(workMutex_);
    stopping_ = true;
    if (pending_) {
      try {
        pending_->abort();
      } catch (const std::exception&) {
      }
    }
  }
  if (thread_.joinable()) thread_.join();
}

std::string RemoteWindow::stopped() const {
  std::lock_guard<std::mutex> lock(workMutex_);
  return stopped_;
}

void RemoteWindow::send(int dst, const Message& header, const void* data, size_t bytes) {
  at::Tensor message = at::empty({static_cast<int64_t>(sizeof(Message) + bytes)}, at::kByte);
  std::memcpy(message.data_ptr(), &header, sizeof(Message));
  if (bytes > 0) std::memcpy(message.data_ptr<uint8_t>() + sizeof(Message), data, bytes);
  std::vector<at::Tensor> tensors{message};
  gloo_->send(tensors, dst, tag_)->wait();
}

void RemoteWindow::put(int dst, uint64_t offset, const void* data, size_t bytes) {
  const auto* from = static_cast<const uint8_t*>(data);
  size_t done = 0;
  do {
    const size_t part = std::min(bytes - done, kRemotePart);
    send(dst, Message{kMagic, kPut, offset + done, part, 0}, from + done, part);
    done += part;
  } while (done < bytes);
}

void RemoteWindow::signal(int dst) { send(dst, Message{kMagic, kSignal, 0, 0, 0}, nullptr, 0); }

void RemoteWindow::receive() {
  for (;;) {
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
      std::lock_guard<std::mutex> lock(workMutex_);
      pending_.reset();
      if (stopping_) return;
      if (!done) {
        stopped_ = "its receive was aborted";
        return;
      }
      Message header;
      std::memcpy(&header, staging_.data_ptr(), sizeof(Message));
      TPCOMM_CHECK(header.magic == kMagic && (header.kind == kPut || header.kind == kSignal) &&
                       header.bytes <= static_cast<uint64_t>(staging_.numel()) - sizeof(Message),
                   kInvalidUsage, what_, ": rank ", work->sourceRank(),
                   " sent a message that is not a window's");
      apply_(work->sourceRank(), header, staging_.data_ptr<uint8_t>() + sizeof(Message));
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(workMutex_);
      pending_.reset();
      if (!stopping_) stopped_ = e.what();
      return;
    }
  }
}

}  // namespace tpcomm::backend
