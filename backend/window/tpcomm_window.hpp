#pragma once
// TpcommWindow: torch's one-sided window (c10d::Window, dist._new_window) on
// a tpcomm group, over mq::ShmWindow (message_queue/window/shm_window.hpp):
// each rank's registered tensor lives in a shared-memory region every rank
// of its host maps; puts and signals to a rank of another host travel as
// Gloo messages that a thread of that rank applies (remote_window.hpp).
//
//   tensor_register(t)  collective: t's storage moves into this rank's
//                       region in place, as Tensor.share_memory_() moves
//                       it (every view of it keeps working; a raw pointer
//                       taken before points to the old memory); the ranks
//                       exchange their regions' names through the group's
//                       store and map those of their host.
//   put(t, dst, off)    a copy of t into dst's tensor at element `off`; same
//                       dtype, inside its bounds; done when it returns (on
//                       another host: once sent; seen after the signal that
//                       follows it, as any put is).
//   map_remote_tensor   a view of rank r's registered tensor (its shape), for
//                       a rank of this host.
//   signal / wait_signal  counted signals: put, then signal(dst), then dst's
//                       wait_signal(src) sees the put. A wait is bounded (the
//                       options' timeout, else the group's) and names the
//                       silent peer, one that exited, or the group's break.
//
// Every call is done when it returns (asyncOp too: the Work returned is
// completed); the options' timeout bounds a wait_signal, and a put's or
// signal's send to another host. Calls may come from several threads; tensor_register and
// tensor_deregister must not run while another call of the window does. Errors: c10::Error (RuntimeError) naming what is wrong for bad
// arguments; DistBackendError for a peer lost or silent. Compiled where
// torch declares windows (C10D_BACKEND_HAS_WINDOW, torch 2.15).

#include <memory>
#include <optional>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#if defined(C10D_BACKEND_HAS_WINDOW)
#include <torch/csrc/distributed/c10d/Window.hpp>

#include "backend/window/remote_window.hpp"
#include "coordinator/group_coordinator.hpp"
#include "message_queue/window/shm_window.hpp"

namespace tpcomm::backend {

class TpcommWindow : public c10d::Window {
 public:
  // Collective over the group (made in the same order on every rank);
  // registers `tensor` when given.
  TpcommWindow(std::shared_ptr<coord::GroupCoordinator> group,
               const std::optional<at::Tensor>& tensor);

  void tensor_register(const at::Tensor& tensor, bool owning = true) override;
  void tensor_deregister() override;
  c10::intrusive_ptr<c10d::Work> put(const at::Tensor& tensor, int64_t dstRank,
                                     int64_t targetOffsetNelems, bool asyncOp,
                                     const c10d::PutOptions& opts = c10d::PutOptions()) override;
  at::Tensor map_remote_tensor(int64_t rank) override;
  c10::intrusive_ptr<c10d::Work> signal(
      int64_t peerRank, bool asyncOp,
      const c10d::SignalOptions& opts = c10d::SignalOptions()) override;
  c10::intrusive_ptr<c10d::Work> wait_signal(
      int64_t peerRank, bool asyncOp,
      const c10d::WaitSignalOptions& opts = c10d::WaitSignalOptions()) override;
  c10d::WindowAttr get_attr(int64_t peerRank) override;

 private:
  // What a rank registered, as the exchange told it.
  struct Registered {
    c10::ScalarType dtype = c10::ScalarType::Undefined;
    std::vector<int64_t> sizes;
    int64_t numel = 0;
    size_t offsetBytes = 0;  // of the tensor in the region's data
  };
  std::string what(const char* op) const;
  void checkPeer(const char* op, int64_t rank) const;
  void checkRegistered(const char* op) const;
  // A put's, signal's or wait's: registered, a rank of the group, no hints.
  void checkCall(const char* op, int64_t rank,
                 const std::unordered_map<std::string, std::string>& hints) const;
  std::chrono::milliseconds timeoutOf(std::chrono::milliseconds asked) const;

  std::shared_ptr<coord::GroupCoordinator> group_;
  int number_;                             // the group's n-th window
  c10::intrusive_ptr<c10d::Store> store_;  // this window's, in the group's store
  int registrations_ = 0;
  std::unique_ptr<mq::ShmWindow> shm_;  // the registration in force
  std::vector<Registered> registered_;  // [r]: rank r's
  std::vector<bool> local_;             // [r]: rank r is on this host
  // Puts and signals between hosts (none where every rank is on this host);
  // after shm_: it goes first (its thread applies into shm_).
  std::unique_ptr<RemoteWindow> remote_;
  std::optional<at::Tensor> owned_;     // the tensor, when the window owns it
};

}  // namespace tpcomm::backend

#endif
