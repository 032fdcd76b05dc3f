// GroupCoordinator: send and recv, through TPCOMM_DEBUG's check of both
// sides (debug_p2p.hpp) on the CPU route when it is on, framed
// (framed_p2p.hpp) on the CPU route otherwise.
#include "coordinator/cpu/framed_p2p.hpp"
#include "coordinator/group_coordinator.hpp"
#include "coordinator/routed_call.hpp"

namespace tpcomm::coord {

namespace {

// A checked send or recv: the check's Work has no future.
Pending checked(c10::intrusive_ptr<c10d::Work> work, std::vector<at::Tensor> outputs) {
  Pending pending = passThrough(std::move(work), std::move(outputs));
  pending.hasFuture = false;
  return pending;
}

}  // namespace

std::function<void(const std::string&)> GroupCoordinator::mismatchBreaker() const {
  return [fault = std::weak_ptr<GroupFault>(fault_)](const std::string& why) {
    if (auto f = fault.lock()) f->breakGroup(why);
  };
}

Pending GroupCoordinator::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  const Route route = routeFor(tensors[0]);
  auto moved = carried(route, tensors);
  if (p2p_ && route == Route::kCpu) {
    stats_.record(StatsRoute::kGloo, bytesOf(tensors));
    return checked(p2p_->send(tensors[0], dstRank, tag,
                              [cpu = cpu_, moved, tag](int peer) mutable {
                                return cpu->send(moved, peer, tag);
                              }),
                   {});
  }
  if (route == Route::kCpu) {
    stats_.record(StatsRoute::kGloo, bytesOf(tensors));
    return withoutFutureOnCpu(
        route, passThrough(
                   framedSend(cpu_, tensors[0], dstRank, tag, framedRests_, options_.timeout), {}));
  }
  return withoutFutureOnCpu(
      route, passThrough(backendFor(route, bytesOf(tensors)).send(moved, dstRank, tag), {}));
}

Pending GroupCoordinator::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  const Route route = routeFor(tensors[0]);
  auto moved = carried(route, tensors);
  if (p2p_ && route == Route::kCpu) {
    stats_.record(StatsRoute::kGloo, bytesOf(tensors));
    return checked(p2p_->recv(tensors[0], srcRank, tag,
                              [cpu = cpu_, moved, tag](int peer) mutable {
                                return cpu->recv(moved, peer, tag);
                              }),
                   tensors);
  }
  if (route == Route::kCpu) {
    stats_.record(StatsRoute::kGloo, bytesOf(tensors));
    return withoutFutureOnCpu(
        route, passThrough(framedRecv(cpu_, tensors[0], srcRank, tag, rank(), mismatchBreaker(),
                                      framedRests_, options_.timeout),
                           tensors));
  }
  return withoutFutureOnCpu(
      route, passThrough(backendFor(route, bytesOf(tensors)).recv(moved, srcRank, tag), tensors));
}

Pending GroupCoordinator::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  const Route route = routeFor(tensors[0]);
  auto moved = carried(route, tensors);
  if (p2p_ && route == Route::kCpu) {
    // Taken as a recv from the first rank whose send to this one is there.
    stats_.record(StatsRoute::kGloo, bytesOf(tensors));
    return checked(p2p_->recvAnysource(tensors[0], tag,
                                       [cpu = cpu_, moved, tag](int peer) mutable {
                                         return cpu->recv(moved, peer, tag);
                                       }),
                   tensors);
  }
  if (route == Route::kCpu) {
    stats_.record(StatsRoute::kGloo, bytesOf(tensors));
    return withoutFutureOnCpu(
        route, passThrough(framedRecv(cpu_, tensors[0], -1, tag, rank(), mismatchBreaker(),
                                      framedRests_, options_.timeout),
                           tensors));
  }
  return withoutFutureOnCpu(
      route, passThrough(backendFor(route, bytesOf(tensors)).recvAnysource(moved, tag), tensors));
}

}  // namespace tpcomm::coord
