#pragma once
// A window's traffic between hosts (backend/window/tpcomm_window.hpp): the
// group's Gloo point-to-point on a tag of the window's own. A put of up to
// kRemotePart bytes is one Gloo message (a 32-byte header, then the bytes);
// a larger one is one message per kRemotePart; a signal is a header alone.
// Each rank with peers on other hosts runs one receiving thread per
// registration: it posts a receive from any rank on the tag into a staging
// buffer (the largest message it can be sent), applies what comes in
// arrival order (a sender's put before its signal), and posts the next.
// Messages never come from the rank's own host (those puts go through
// shared memory).
//
// Tags: kRemoteTagBit | window << 6 | registration, below Gloo's and the
// framed point-to-point's (coordinator/cpu/framed_p2p.hpp) and outside the
// tags torch's callers use (small numbers).

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace tpcomm::backend {

constexpr int kRemoteTagBit = 1 << 29;
constexpr size_t kRemotePart = size_t{4} << 20;

// The tag of registration `registration` of window `window` of a group.
int remoteTag(int window, int registration);

class RemoteWindow {
 public:
  // What a message asks of its receiver.
  struct Message {
    uint32_t magic;
    uint32_t kind;    // kPut or kSignal
    uint64_t offset;  // bytes into the receiver's data (a put)
    uint64_t bytes;   // the put's bytes after the header
    uint64_t reserved;
  };
  static constexpr uint32_t kMagic = 0x74707277;  // "tprw"
  static constexpr uint32_t kPut = 1;
  static constexpr uint32_t kSignal = 2;

  // `apply(source, message, bytes)`: runs on the receiving thread for each
  // message that came (bytes: the put's, after the header). `receiveBytes`:
  // the largest put part this rank can be sent (0: no receiving thread,
  // no peer on another host). `what`: names the window in errors.
  RemoteWindow(c10::intrusive_ptr<c10d::Backend> gloo, int tag, size_t receiveBytes,
               std::function<void(int, const Message&, const uint8_t*)> apply, std::string what);
  // Stops the receiving thread (its pending receive aborted).
  ~RemoteWindow();
  RemoteWindow(const RemoteWindow&) = delete;
  RemoteWindow& operator=(const RemoteWindow&) = delete;

  // A put of `bytes` at byte `offset` of rank `dst`'s data, in messages of
  // at most kRemotePart; done when the last one was sent. Throws what Gloo
  // throws (a broken group).
  void put(int dst, uint64_t offset, const void* data, size_t bytes);
  void signal(int dst);
  // Why the receiving thread stopped before it was told to ("" while it
  // runs): a broken group's connections, a message that was not a window's.
  std::string stopped() const;

 private:
  void send(int dst, const Message& header, const void* data, size_t bytes);
  void receive();

  c10::intrusive_ptr<c10d::Backend> gloo_;
  int tag_;
  std::function<void(int, const Message&, const uint8_t*)> apply_;
  std::string what_;
  at::Tensor staging_;  // the receiving thread's
  std::atomic<bool> stopping_{false};
  mutable std::mutex workMutex_;
  c10::intrusive_ptr<c10d::Work> pending_;  // the receive posted, by workMutex_
  std::string stopped_;                     // by workMutex_
  std::thread thread_;
};

}  // namespace tpcomm::backend
