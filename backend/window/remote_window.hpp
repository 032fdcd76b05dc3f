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
// shared memory). A put or signal returns once Gloo sent its message: what
// it wrote is seen by the target after the signal that follows it, through
// the target's wait_signal, as inside a host.
//
// Closing (tensor_deregister, the window's end): every rank sends each of
// its peers on other hosts a closing header, and its thread ends once it
// received one from each of them, its last receive completed: no receive
// of a window's is ever left posted in Gloo (a message arriving for one
// whose buffer is gone would stall the connection). Only where the peers'
// closings do not come within the bound (a peer gone, the group broken)
// is the receive aborted.
//
// Tags: kRemoteTagBit | window % 2^14 << 6 | registration % 64, in the
// range the framed point-to-point refuses to callers
// (coord::kFramedWindowTagBit, coordinator/cpu/framed_p2p.hpp) and below
// the rests of its large messages. A tag comes back after 2^14 windows or
// 64 registrations of one window, once the receive that had it completed.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "coordinator/cpu/framed_p2p.hpp"

namespace tpcomm::backend {

constexpr int kRemoteTagBit = coord::kFramedWindowTagBit;
constexpr size_t kRemotePart = size_t{4} << 20;

// The tag of registration `registration` of window `window` of a group.
int remoteTag(int window, int registration);

class RemoteWindow {
 public:
  // What a message asks of its receiver.
  struct Message {
    uint32_t magic;
    uint32_t kind;    // kPut, kSignal or kClose
    uint64_t offset;  // bytes into the receiver's data (a put)
    uint64_t bytes;   // the put's bytes after the header
    uint64_t reserved;
  };
  static constexpr uint32_t kMagic = 0x74707277;  // "tprw"
  static constexpr uint32_t kPut = 1;
  static constexpr uint32_t kSignal = 2;
  static constexpr uint32_t kClose = 3;

  // `apply(source, message, bytes)`: runs on the receiving thread for each
  // put or signal that came (bytes: the put's, after the header).
  // `receiveBytes`: the largest put part this rank can be sent. `remote`:
  // the ranks of other hosts (each sends and expects a closing). `what`:
  // names the window in errors.
  RemoteWindow(c10::intrusive_ptr<c10d::Backend> gloo, int tag, size_t receiveBytes,
               std::vector<int> remote,
               std::function<void(int, const Message&, const uint8_t*)> apply, std::string what);
  // Closes (close()) with a bound of 10 s.
  ~RemoteWindow();
  RemoteWindow(const RemoteWindow&) = delete;
  RemoteWindow& operator=(const RemoteWindow&) = delete;

  // A put of `bytes` at byte `offset` of rank `dst`'s data, in messages of
  // at most kRemotePart; done when the last one was sent, each send waited
  // for at most `timeout` (Gloo's own, the group's, where it is 0). Throws
  // what Gloo throws (a broken group, a send past its timeout).
  void put(int dst, uint64_t offset, const void* data, size_t bytes,
           std::chrono::milliseconds timeout);
  void signal(int dst, std::chrono::milliseconds timeout);
  // Sends the closings and waits at most `bound` for the peers' (0: none,
  // at once), then ends the receiving thread. Once; never throws.
  void close(std::chrono::milliseconds bound);
  // Why the receiving thread stopped before it was told to ("" while it
  // runs): a broken group's connections, a message that was not a window's.
  std::string stopped() const;

 private:
  void send(int dst, const Message& header, const void* data, size_t bytes,
            std::chrono::milliseconds timeout);
  void receive();

  c10::intrusive_ptr<c10d::Backend> gloo_;
  int tag_;
  std::function<void(int, const Message&, const uint8_t*)> apply_;
  std::string what_;
  std::vector<int> remote_;
  at::Tensor staging_;  // the receiving thread's
  std::atomic<bool> stopping_{false};
  std::atomic<bool> closed_{false};
  mutable std::mutex workMutex_;
  std::condition_variable ended_;           // the thread returned
  bool finished_ = false;                   // by workMutex_
  c10::intrusive_ptr<c10d::Work> pending_;  // the receive posted, by workMutex_
  std::string stopped_;                     // by workMutex_
  std::thread thread_;
};

}  // namespace tpcomm::backend
