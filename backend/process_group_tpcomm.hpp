#pragma once
// ProcessGroupTpcomm: the c10d::Backend that `init_process_group(backend=
// "tpcomm")` creates, for CPU and CUDA tensors alike. It validates each call's
// arguments, hands the call to its GroupCoordinator, and wraps what comes back
// in a TpcommWork. Nothing else: routing lives in coordinator/.
//
// Errors: a bad argument raises c10::Error (RuntimeError in Python) naming the
// call and the argument, before anything is sent; a communication failure
// raises c10d::DistBackendError (torch.distributed.DistBackendError).

#include <atomic>
#include <map>
#include <memory>
#include <mutex>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "backend/coalescing.hpp"
#include "backend/flight_record.hpp"
#include "backend/hooks.hpp"
#include "backend/torch_features.hpp"
#include "coordinator/group_coordinator.hpp"

namespace tpcomm::backend {

// The backend's options (timeout, group name). Copyable, because torch's
// split_group deep-copies the parent backend's options.
struct TpcommOptions : c10d::Backend::Options {
  explicit TpcommOptions(std::chrono::milliseconds timeout = kBackendDefaultTimeout)
      : c10d::Backend::Options("tpcomm", timeout) {}
};

class ProcessGroupTpcomm : public c10d::Backend {
 public:
  explicit ProcessGroupTpcomm(std::shared_ptr<coord::GroupCoordinator> coordinator);

  coord::GroupCoordinator& coordinator() { return *coordinator_; }

  const std::string getBackendName() const override { return "tpcomm"; }
  bool supportsSplitting() const override { return true; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  void eagerConnectSingleDevice(at::Device device) override;
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;
  // Runs the abort hooks, then aborts the group.
  void abort() override;
  void shutdown() override;
#if defined(TPCOMM_ABORT_HOOKS)
  // Hooks as backend/hooks.hpp runs them: abort hooks before this group
  // raises a communication failure or aborts; completion hooks once per
  // Work that succeeded.
  bool supportsAbortHooks() const override { return true; }
  void registerAbortHook(int64_t hookId, c10d::AbortHook hook) override;
  void unregisterAbortHook(int64_t hookId) override;
#endif
#if defined(TPCOMM_COMPLETION_HOOKS)
  bool supportsCompletionHooks() const override { return true; }
  void registerCompletionHook(int64_t hookId, c10d::CompletionHook hook) override;
  void unregisterCompletionHook(int64_t hookId) override;
#endif
#if defined(TPCOMM_SHRINK)
  // The group of the ranks that stay (dist.shrink_group): made as a split is
  // (GroupCoordinator::shrink), called by those ranks only; SHRINK_ABORT (1)
  // first aborts this group (its calls in flight raise, its abort hooks
  // run). Raises naming a flag, an excluded rank or a caller that is wrong.
  bool supportsShrinking() const override { return true; }
  c10::intrusive_ptr<Backend> shrink(const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
                                     const c10::intrusive_ptr<Options>& opts) override;
#endif
  // The calls between these two are one batch, one Work
  // (backend/coalescing.hpp): dist.batch_isend_irecv, _coalescing_manager.
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  // Calling split twice with the same group name (once per device type, as
  // ProcessGroup::splitGroup does) returns the same backend.
  c10::intrusive_ptr<Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                    const std::vector<int>& ranks,
                                    const c10::intrusive_ptr<Options>& opts) override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  // output = sum (or AVG) of every rank's input, out of place: the custom
  // kernel then reads the input where it lies (zero-copy in graph_capture()).
  // Not a c10d entry point: the GroupCoordinator's out-of-place op calls it.
  c10::intrusive_ptr<c10d::Work> allreduceInto(at::Tensor& input, at::Tensor& output,
                                               const c10d::AllreduceOptions& opts);
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  // The allreduce fused with a residual add and RMSNorm
  // (GroupCoordinator::allreduceAddRmsNorm), after checkAddRmsNorm. CPU:
  // done when it returns; CUDA: ordered on the current stream. Returns the
  // path taken (custom_oneshot, custom_twoshot, cpu_shm, local, composed).
  // Not a c10d entry point: the GroupCoordinator's op calls it.
  std::string allreduceAddRmsNorm(const at::Tensor& input, const at::Tensor& residual,
                                  const at::Tensor& weight, double eps, at::Tensor& normed,
                                  at::Tensor& residualOut);
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplits,
                                               std::vector<int64_t>& inputSplits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) override;

 private:
  // Runs `call` (validation + coordinator), translating tpcomm::Error at this
  // boundary, and wraps the result in a TpcommWork. The call goes into
  // torch's flight recorder (FlightRecord) with the tensors `tensors()`
  // gives (inputs, outputs), evaluated only when the recorder is on.
  // `peer`: a point-to-point call's peer (group rank), else -1.
  template <typename Tensors, typename Call>
  c10::intrusive_ptr<c10d::Work> run(c10d::OpType type, const char* op, Tensors&& tensors,
                                     Call&& call, int peer = -1);
  std::string describeCall(const char* op) const;
  // A Work that completed in the caller's thread: its completion hooks run
  // now; returns it.
  c10::intrusive_ptr<c10d::Work> completed(c10::intrusive_ptr<c10d::Work> work) const;
  // The call's entry in the flight recorder, counted in the group's p2p or
  // collective sequence (backend/process_group_tpcomm_flight.cpp).
  FlightCall recordCall(bool p2p, bool send, const char* op, c10::ArrayRef<at::Tensor> inputs,
                        c10::ArrayRef<at::Tensor> outputs, int peer, uint64_t seq);
  // Whether the call this thread just routed went to a device route
  // (NCCL, the custom kernel), whose failures keep their own recovery.
  static bool onDeviceRoute();

 public:
  // Calls this thread has made on any tpcomm group (refused ones too): the
  // front door's wrapper tells a refusal of torch's from one of tpcomm's.
  static uint64_t& callsOnThisThread();

 private:

 public:
  // torch.distributed's Python front door refused a collective on this
  // group before it reached the backend (`op`: the function, `why`: its
  // error): the call takes its number in the sequence and the peers learn
  // it, as for a refusal here (coord::GroupFault::refused).
  void refuseFromPython(const std::string& op, const std::string& why);
  // The group's global ranks, for the flight recorder's group table.
  void setGlobalRanks(std::vector<uint64_t> ranks) { globalRanks_ = std::move(ranks); }
  const std::vector<uint64_t>& globalRanks() const { return globalRanks_; }

 private:
  std::shared_ptr<coord::GroupCoordinator> coordinator_;
  // Shared with the works in flight, which may outlive the group.
  std::shared_ptr<BackendHooks> hooks_ = std::make_shared<BackendHooks>();
  Coalescing coalescing_;
  std::vector<uint64_t> globalRanks_;
  size_t flightPgId_;
  std::once_flag flightGroupRecorded_;
  // Calls issued on this group: every collective (refused ones too) and
  // every point-to-point call, numbered alike on every rank.
  std::atomic<uint64_t> collectiveSeq_{0};
  std::atomic<uint64_t> p2pSeq_{0};
  std::mutex splitMutex_;
  std::map<std::string, c10::intrusive_ptr<ProcessGroupTpcomm>> splits_;
};

}  // namespace tpcomm::backend
