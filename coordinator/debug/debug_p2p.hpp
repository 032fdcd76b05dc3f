#pragma once
// TPCOMM_DEBUG's check of point-to-point calls. Internal to coordinator/.
//
// A send and the recv it meets must agree on dtype and element count; Gloo
// aborts the receiving process when the sizes differ and silently
// reinterprets bytes when only the dtypes do. Under TPCOMM_DEBUG each side
// writes a header to the group's store when the call is issued (key: source,
// destination, tag and the call's number on that lane), and a helper thread
// per call polls (bounded by the group's timeout) for the peer's header,
// compares, and only then posts the call to the CPU backend. On a mismatch
// neither side posts anything: both Works fail, naming both ranks' calls.
// A side that times out marks its header abandoned, and a side takes the
// peer's header, each with one compareSet, so exactly one of the two
// happens: both post, or neither does. Either way the lane stays in step for
// the calls that follow.
//
// Posting order on a lane (peer, direction, tag) is the issue order, which is
// all Gloo's matching depends on; calls on other lanes never wait for each
// other, so any pattern that completes on the plain CPU backend completes
// here (headers are written at issue time, never after another call's
// completion). Two differences remain: the peer's call must come within the
// group's timeout of this call's issue (Gloo counts from wait()), and a recv
// from any source takes the first peer whose next send header on that tag
// is there and becomes a recv from that peer, so a recv naming that peer on
// the same tag issued after it but before it took one may take the earlier
// message (Gloo would give it to the recv from any source). Cost: a store
// write, a few polls and a thread per call; debugging only.

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace tpcomm::coord {

class P2pChecker {
 public:
  // Starts the real call on the CPU backend with the peer's rank.
  using Post = std::function<c10::intrusive_ptr<c10d::Work>(int peer)>;

  P2pChecker(c10::intrusive_ptr<c10d::Store> store, std::string groupName, int rank, int size,
             std::chrono::milliseconds timeout);
  P2pChecker(const P2pChecker&) = delete;
  P2pChecker& operator=(const P2pChecker&) = delete;

  // The Work of a checked call: it waits for the check, then for the posted
  // call; its error names both ranks' calls. `tensor` is this rank's buffer.
  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& tensor, int dst, int tag, Post post);
  c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& tensor, int src, int tag, Post post);
  c10::intrusive_ptr<c10d::Work> recvAnysource(const at::Tensor& tensor, int tag, Post post);

  void setTimeout(std::chrono::milliseconds timeout);

 private:
  struct Shared;
  std::shared_ptr<Shared> shared_;  // also held by the helper threads
};

}  // namespace tpcomm::coord
