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
#include <optional>
#include <set>

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
  // A group made in torch's reconfigure regime (init_process_group(...,
  // enable_reconfigure=True)): nothing but what forming it takes, no
  // member yet. Every call raises, naming the regime, until reconfigure()
  // formed it. `options`: its nominal rank and size, timeout, name.
  struct Unformed {
    c10::intrusive_ptr<c10d::Store> store;  // where its members will meet
    coord::GroupOptions options;
    coord::BackendFactory cpuFactory;  // its Gloo groups
    coord::BackendFactory deviceFactory;
  };
  explicit ProcessGroupTpcomm(Unformed unformed);

  // Raises (tpcomm::Error, kInvalidUsage) on a group not formed yet.
  coord::GroupCoordinator& coordinator() const { return co(); }
  // Whether the group has members (false: the reconfigure regime, before
  // its first reconfigure).
  bool formed() const { return static_cast<bool>(coordinator_); }

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
#if defined(TPCOMM_RECONFIGURE)
  // Re-forming the group with a new set of members (backend/reconfigure.cpp,
  // docs/torch_capabilities.md): the handle names this backend and the
  // store its members meet on; reconfigure makes the group of the handles'
  // members as a split makes one, on that store, and retires the old
  // one (shut down, or aborted when broken). No call of the group may be
  // in flight on any thread meanwhile, as for Gloo's.
  bool supportsReconfigure() const override { return true; }
  c10d::ReconfigureHandle get_reconfigure_handle() const override;
  c10::intrusive_ptr<c10d::Work> reconfigure(const c10d::ReconfigureOptions& opts) override;
#endif
#if defined(TPCOMM_WINDOW)
  // One-sided windows on CPU tensors among the ranks of one host
  // (backend/window/tpcomm_window.hpp): collective, made in the same order
  // on every rank.
  bool supportsWindow() const override { return true; }
  c10::intrusive_ptr<c10d::Window> new_window(
      const std::optional<at::Tensor>& tensor = std::nullopt) override;
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
  // The coordinator; raises naming the regime on a group not formed yet.
  coord::GroupCoordinator& co() const;
  const std::string& groupName() const;
  // The flight recorder's group table, once per membership.
  void recordGroupOnce(const std::string& uid);
  static size_t nextFlightPgId();
  // The coordinator as it is now, under swapMutex_ (abort and shutdown may
  // come from another thread while a reconfigure replaces it).
  std::shared_ptr<coord::GroupCoordinator> snapshot() const;
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
  // Null until a group made in the reconfigure regime was formed; replaced
  // by each reconfigure.
  std::shared_ptr<coord::GroupCoordinator> coordinator_;
  std::optional<Unformed> unformed_;  // set while coordinator_ is null
  // This backend's identity in its reconfigure handles, and the uuids its
  // reconfigures used (each once).
  mutable std::once_flag tokenDrawn_;
  mutable std::string token_;
  std::set<int64_t> uuids_;
  // The store the group was first made on, once a reconfigure re-formed
  // it (each forming runs under a prefix of its own there).
  c10::intrusive_ptr<c10d::Store> reconfigureBase_;
  mutable std::mutex swapMutex_;  // coordinator_'s replacement against snapshot()
  std::atomic<uint64_t> aborts_{0};  // abort() calls: one during a reconfigure ends it
  bool reconfigured_ = false;        // the flight recorder's rank is not ours to set then
  // Shared with the works in flight, which may outlive the group.
  std::shared_ptr<BackendHooks> hooks_ = std::make_shared<BackendHooks>();
  Coalescing coalescing_;
  std::vector<uint64_t> globalRanks_;
  size_t flightPgId_;
  std::atomic<bool> flightGroupRecorded_{false};
  std::mutex flightGroupMutex_;
  // Calls issued on this group: every collective (refused ones too) and
  // every point-to-point call, numbered alike on every rank.
  std::atomic<uint64_t> collectiveSeq_{0};
  std::atomic<uint64_t> p2pSeq_{0};
  std::mutex splitMutex_;
  std::map<std::string, c10::intrusive_ptr<ProcessGroupTpcomm>> splits_;
};

}  // namespace tpcomm::backend
