#pragma once
// GroupCoordinator: one per process group. Owns the CPU backend (torch's
// ProcessGroupGloo) and, created on first use, the device backend (torch's
// ProcessGroupNCCL), and routes every call to one of them:
//
//   CPU allreduce, all-gather, reduce-scatter,
//   broadcast, barrier of a one-host group   -> shared memory (CpuShm)
//   other CPU calls, monitored barrier       -> CPU backend
//   CUDA allreduces the routing table sends  -> custom kernel (CustomPath)
//   to the custom kernel
//   other CUDA tensors                       -> device backend
//
// A rank's CUDA calls on one group must all use one GPU: the first CUDA call
// binds it, and a tensor on another GPU is refused naming both. The custom
// kernel is set up (collectively, over the CPU backend) at the group's first
// CUDA allreduce or eager connect; it never needs the device backend, so a
// group whose ranks share one GPU (which NCCL refuses) can use it.
//
// CPU allreduce, all-gather, reduce-scatter, broadcast and barrier of a
// group whose ranks share a host go through shared memory (cpu_shm_path.hpp)
// once the group's first such call set it up (collectively, over the CPU
// backend); they run to completion in the calling thread and return a
// completed Work. Those of a group whose ranks sit on several hosts go
// through shared memory inside each host and Gloo sub-groups between them
// (cpu_hier_path.hpp), set up at the same point, where a CPU backend
// factory was given (setCpuBackendFactory). Everything else on CPU goes to
// Gloo.
//
// Where the routed backend lacks an operation the coordinator composes it
// (AVG and PREMUL_SUM on Gloo, list all-to-all through alltoall_base).
//
// Contract: arguments were validated by the caller (backend/); every method
// returns without waiting for the communication, except monitoredBarrier and
// the TPCOMM_DEBUG cross-rank check, which are synchronous. Calls on one
// group must be issued in the same order on every rank (as for any c10d
// backend); the coordinator is safe to call from several threads, but the
// order of concurrent calls is then the caller's business. Errors: throws
// tpcomm::Error (InvalidUsage for a mismatch found by TPCOMM_DEBUG) or
// whatever the routed backend throws.

#include <array>
#include <atomic>
#include <thread>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "coordinator/cpu/cpu_hier_path.hpp"
#include "coordinator/cpu/cpu_shm_path.hpp"
#include "coordinator/cpu/framed_p2p.hpp"
#include "coordinator/cuda/custom_path.hpp"
#include "coordinator/debug/debug_p2p.hpp"
#include "coordinator/faults/group_fault.hpp"
#include "coordinator/group_life.hpp"
#include "coordinator/pending.hpp"
#include "coordinator/route_stats.hpp"
#include "coordinator/routing.hpp"

namespace tpcomm::coord {

// Makes this rank's CustomDevice for a CUDA device index (makeCudaDevice in
// the product; a fake in tests).
using CustomDeviceFactory = std::function<std::unique_ptr<CustomDevice>(int deviceIndex)>;

// BackendFactory (cpu_hier_path.hpp): the device backend is made through
// one so that a CPU-only job never touches CUDA/NCCL; a group across hosts
// makes its Gloo sub-groups through another.

struct GroupOptions {
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  std::string groupName;
  bool debugChecks = false;  // TPCOMM_DEBUG
  // Whether the group may set up the CPU shared-memory path at all (false:
  // every CPU call goes to the CPU backend without a set-up exchange; unit
  // tests over in-process fake backends).
  bool cpuShm = true;
  // The life of the group this coordinator serves (group_life.hpp), where
  // its maker knew it: a reconfigure's handle names it, so that the ranks of
  // this group that are not in the new one count as having left it.
  std::string life;
};

enum class Route { kCpu, kDevice };
const char* routeName(Route route);

class GroupCoordinator {
 public:
  GroupCoordinator(GroupOptions options, c10::intrusive_ptr<c10d::Store> store,
                   c10::intrusive_ptr<c10d::Backend> cpuBackend, BackendFactory deviceFactory,
                   CustomDeviceFactory customDeviceFactory = makeCudaDevice);
  // Destroys the shared-memory path, the custom kernel and both backends
  // without the Python interpreter lock (interpreter_lock.hpp): their
  // teardown joins threads that may need it.
  ~GroupCoordinator();
  GroupCoordinator(const GroupCoordinator&) = delete;
  GroupCoordinator& operator=(const GroupCoordinator&) = delete;

  int rank() const { return options_.rank; }
  int size() const { return options_.size; }
  const GroupOptions& options() const { return options_; }
  c10::intrusive_ptr<c10d::Backend> cpuBackend() const { return cpu_; }
  // Null until a CUDA call (or eagerConnect) created it.
  c10::intrusive_ptr<c10d::Backend> deviceBackendIfCreated() const;
  // Where a tensor's call goes; binds the group's GPU on the first CUDA
  // tensor and refuses a tensor on another GPU.
  Route routeFor(const at::Tensor& tensor);
  // The GPU this rank's CUDA calls use, once bound.
  std::optional<at::Device> cudaDevice() const;

  Pending broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts);
  Pending allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts);
  // output = reduction of every rank's input; output may be input. The custom
  // kernel reads the input in place where it can (graph_capture()).
  Pending allreduceInto(at::Tensor& input, at::Tensor& output, const c10d::AllreduceOptions& opts);
  // The allreduce fused with a transformer layer's residual add and RMSNorm
  // (group_coordinator_fused.cpp): residualOut = sum over ranks of input +
  // residual, normed = residualOut / sqrt(mean(residualOut^2) + eps) x
  // weight, row by row over the last dimension, float32 statistics (float64
  // for float64). The path is chosen as an allreduce SUM of the input's size
  // would be: the custom kernel's fused epilogue, the CPU shared-memory path
  // (fused into its reduction pass), a group of one (no communication), else
  // composed (the routed allreduce, then ATen's add and rms_norm). Arguments
  // were checked (backend's checkAddRmsNorm). CPU: done when it returns;
  // CUDA: ordered on the current stream. Returns the path's name.
  std::string allreduceAddRmsNorm(const at::Tensor& input, const at::Tensor& residual,
                                  const at::Tensor& weight, double eps, at::Tensor& normed,
                                  at::Tensor& residualOut);
  Pending allreduceSparse(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts);
  Pending allreduceCoalesced(std::vector<at::Tensor>& tensors,
                             const c10d::AllreduceCoalescedOptions& opts);
  Pending reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts);
  Pending allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                    const c10d::AllgatherOptions& opts);
  Pending allgatherBase(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts);
  Pending allgatherCoalesced(std::vector<std::vector<at::Tensor>>& outputs,
                             std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts);
  Pending allgatherIntoTensorCoalesced(std::vector<at::Tensor>& outputs,
                                       std::vector<at::Tensor>& inputs,
                                       const c10d::AllgatherOptions& opts);
  Pending gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                 const c10d::GatherOptions& opts);
  Pending scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                  const c10d::ScatterOptions& opts);
  Pending reduceScatter(std::vector<at::Tensor>& outputs,
                        std::vector<std::vector<at::Tensor>>& inputs,
                        const c10d::ReduceScatterOptions& opts);
  Pending reduceScatterBase(at::Tensor& output, at::Tensor& input,
                            const c10d::ReduceScatterOptions& opts);
  Pending reduceScatterTensorCoalesced(std::vector<at::Tensor>& outputs,
                                       std::vector<at::Tensor>& inputs,
                                       const c10d::ReduceScatterOptions& opts);
  Pending alltoallBase(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& outputSplits,
                       std::vector<int64_t>& inputSplits, const c10d::AllToAllOptions& opts);
  Pending alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                   const c10d::AllToAllOptions& opts);
  Pending send(std::vector<at::Tensor>& tensors, int dstRank, int tag);
  Pending recv(std::vector<at::Tensor>& tensors, int srcRank, int tag);
  Pending recvAnysource(std::vector<at::Tensor>& tensors, int tag);
  Pending barrier(const c10d::BarrierOptions& opts);
  // Synchronous; raises naming the ranks that did not arrive in time.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks);

  // A coordinator for the sub-group `ranks` (group ranks of this group, which
  // must include this rank). The CPU backend is split from ours; the device
  // backend is again created on first use.
  std::shared_ptr<GroupCoordinator> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          std::chrono::milliseconds timeout,
                                          const std::string& groupName);

  // The group of `survivors` (this group's ranks that stay, in their new
  // order; this rank among them) after the others were lost: made as
  // split() makes one (shared memory per host, hierarchical across hosts),
  // through a prefix of its own on the store this group was made on, so
  // that it needs nothing of this group but the store. Collective over the
  // survivors. The excluded ranks then count as having left this group, so
  // that its keys go once the survivors destroyed it (group_life.hpp).
  std::shared_ptr<GroupCoordinator> shrink(const std::vector<int>& survivors,
                                           std::chrono::milliseconds timeout,
                                           const std::string& groupName);

  // Whether the group has a store (shrink needs it).
  bool hasStore() const { return static_cast<bool>(store_); }
  // The store the group was made on: its own store without its life's
  // prefix (that store itself where it has none).
  c10::intrusive_ptr<c10d::Store> baseStore() const;
  // The group of `options.size` ranks this rank is `options.rank` of, made
  // on `store` (where every key of the group goes, under a life of its own)
  // as split() makes one: a Gloo group through `cpuFactory`, the device
  // backend through `deviceFactory` on first use, shared memory per host
  // and the hierarchical route across hosts on the first CPU collective.
  // Collective over the new group's ranks; options.life is set.
  static std::shared_ptr<GroupCoordinator> form(const c10::intrusive_ptr<c10d::Store>& store,
                                                GroupOptions options, BackendFactory cpuFactory,
                                                BackendFactory deviceFactory);
  // Counts `ranks` (of this group) as having left its life, as a shrink or
  // a reconfigure that left them out does: the group's keys then go once
  // the others left it too (group_life.hpp). Never throws.
  void countAsLeft(const std::vector<int>& ranks) { endLife(store_, size(), ranks); }
  // The group's next one-sided window (windows are made in the same order
  // on every rank): its number n, and where its ranks meet:
  // "tpcomm-window-<n>/" of the group's life.
  std::pair<int, c10::intrusive_ptr<c10d::Store>> nextWindow() {
    const int n = windows_++;
    return {n, c10::make_intrusive<c10d::PrefixStore>("tpcomm-window-" + std::to_string(n),
                                                      store_)};
  }
  // The factories this group makes Gloo groups and its device backend with.
  const BackendFactory& cpuBackendFactory() const { return cpuFactory_; }
  const BackendFactory& deviceBackendFactory() const { return deviceFactory_; }

  // Creates the device backend now (init_process_group(device_id=...)).
  void eagerConnect(at::Device device);
  // The CUDA allreduce routing in force (describe()).
  const RoutingTable& routing() const { return routing_; }
  // Benchmarks and tests: this group's routing mode instead of TPCOMM_ROUTE.
  // Every rank must set the same mode between the same two calls.
  void setRouteMode(const std::string& mode) { routing_.setMode(mode); }
  // How long the custom kernel waits for a peer: TPCOMM_CAR_TIMEOUT_MS when
  // set, else the group's timeout.
  std::chrono::milliseconds customTimeout() const;
  // The custom kernel's state: null until the first CUDA allreduce.
  std::shared_ptr<CustomPath> customPath() const;
  // graph_capture(): zero-copy registration of captured custom allreduces.
  // begin is local; finish is collective (see CustomPath). They nest.
  void beginGraphRegistration();
  void finishGraphRegistration();
  // Collective: after a custom-allreduce failure (a peer that did not arrive
  // poisons the group's kernels until then), makes the kernel usable again on
  // every rank. Does nothing before the kernel is set up.
  void resetCustom();
  // The shared-memory path for CPU collectives: set up (collectively) on the
  // first call, then null when the group does not use it; `reason` says why.
  mq::ShmGroup* cpuShm();
  // The hierarchical path of a group across hosts: set up with cpuShm() (the
  // same first call), null where the group does not use it.
  HierGroup* cpuHier();
  // Makes the Gloo sub-groups of a group across hosts (before the group's
  // first CPU collective); without one such a group uses Gloo alone.
  void setCpuBackendFactory(BackendFactory factory) { cpuFactory_ = std::move(factory); }
  struct CpuShmState {
    bool setUp = false;
    bool available = false;
    std::string reason;
    std::string mode;          // auto, 0, 1
    std::string reduceIsa;     // the reductions' kernels (avx512, avx2, portable)
    std::string memfd;         // how the region's memfd was made (set up only)
    int64_t spinUs = -1;       // the waits' polling window (set up only)
    bool yields = true;        // whether they yield the core while polling
    int threads = 1;           // threads per rank for large calls (set up only)
    uint64_t bufferBytes = 0;  // the chunk in force (set up only)
    mq::ShmWaitStats waits;    // this rank's waits on its host's ranks (set up only)
    // Where each rank of the group runs and keeps its slots (set up on one
    // host only), and the NUMA nodes with memory this machine has.
    std::vector<RankShare> ranks;
    int numaNodes = 1;
    // A group across hosts (set up only): the hosts, and why the
    // hierarchical path is or is not used.
    bool hierarchical = false;
    std::string layout;
    std::string hierReason;
    uint64_t hierSliceBytes = 0;
    uint64_t hierGatherBytes = 0;
    uint64_t hierInlineBytes = 0;
  };
  CpuShmState cpuShmState() const;
  // Benchmarks and tests: this group's TPCOMM_CPU_SHM mode (auto, 0, 1)
  // instead of the process's; every rank must call it before the group's
  // first CPU collective. Throws InvalidUsage once the path is set up.
  void setCpuShmMode(const std::string& mode);
  // Benchmarks and tests: the widest reduction kernels of this group's
  // shared-memory path (auto, avx512, avx2, portable; as
  // TPCOMM_CPU_REDUCE_ISA), at any time; every rank sets the same level
  // between the same two calls (levels differ only in which NaN's sign a
  // SUM of two NaNs keeps; set-up agrees on the lowest level asked for).
  // Throws InvalidUsage for another name.
  void setCpuReduceIsa(const std::string& level);
  // Benchmarks and tests: this group's TPCOMM_CPU_SHM_SPIN_US (-1: the
  // policy's choice), at any time, on any rank.
  void setCpuShmSpinUs(int64_t spinUs);
  // Benchmarks and tests: this group's TPCOMM_CPU_SHM_THREADS (0: the
  // default), before the group's first CPU collective on this rank (results
  // do not depend on it, so ranks may differ). Throws InvalidUsage after.
  void setCpuShmThreads(int64_t threads);
  // TPCOMM_DEBUG: how many cross-rank checks this thread has run (on any
  // group), so that the backend can tell whether a refused call reached its
  // check.
  static uint64_t debugChecksOnThisThread();
  // TPCOMM_DEBUG: this rank refused a collective (`why`) before its check
  // ran. Runs the check with the refusal as this rank's signature, so that
  // every rank raises naming it instead of waiting for this one; returns
  // when every rank refused the same way (the caller then raises its own).
  void checkRefusedCall(const char* op, const std::string& why);
  // Calls and bytes per route since creation or the last resetStats().
  std::vector<RouteCount> stats() const { return stats_.snapshot(); }
  void resetStats() { stats_.reset(); }
  void setTimeout(std::chrono::milliseconds timeout);
  // Breaks the group on every rank (group_fault.hpp): this rank's waits end
  // at once, the peers' within TPCOMM_WATCHDOG_MS and a poll.
  void abort();
  void shutdown();
  // A batch (ProcessGroupTpcomm::startCoalescing): the calls this thread
  // routes to the device backend until endCoalescing go into that backend's
  // own batch (ProcessGroupNCCL's ncclGroupStart/End, which are per thread),
  // opened at the first of them; endCoalescing returns its Work (null: no
  // call went there).
  void startCoalescing();
  c10::intrusive_ptr<c10d::Work> endCoalescing();
  // What has gone wrong on the group, as every rank learns it.
  GroupFault& fault() { return *fault_; }
  const std::shared_ptr<GroupFault>& faultState() const { return fault_; }

 private:
  // Breaks the group when a framed recv finds its send mismatched
  // (framed_p2p.hpp); holds the fault weakly.
  std::function<void(const std::string&)> mismatchBreaker() const;
  // Hands the fault state what a break releases (the routes' paths, the
  // Gloo group kept alive) and the device probe (the custom kernel).
  void watchFaults();
  // The backend for `route`, counting the call and its bytes in stats_.
  c10d::Backend& backendFor(Route route, uint64_t bytes);
  c10d::Backend& deviceBackend();
  void bindDevice(at::Device device);
  // Sets up the custom kernel on the first call (collective), then returns it.
  std::shared_ptr<CustomPath> ensureCustom(at::Device device);
  // TPCOMM_AUTOTUNE: the crossovers from the cache or measured (collective).
  void tuneRouting(CustomPath& custom);
  // allreduce after its TPCOMM_DEBUG check (allreduceInto's fallback).
  Pending allreduceRouted(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts);
  Pending customAllreduce(std::shared_ptr<CustomPath> custom, at::Tensor& input, at::Tensor& output,
                          DeviceRoute route, const c10d::AllreduceOptions& opts);
  // TPCOMM_DEBUG: raises on every rank when ranks disagree on the call's
  // signature. `describe` builds it and runs only when the check is on, so
  // the default path formats nothing. The returned lock keeps the group's
  // other threads out until the call has been handed to its backend (the
  // caller holds it to the end of the call), so the check and its call are
  // one step even when several threads call the group at once.
  template <typename Describe>
  [[nodiscard]] std::unique_lock<std::recursive_timed_mutex> debugCheck(Describe&& describe) {
    if (!options_.debugChecks) return {};
    std::unique_lock<std::recursive_timed_mutex> turn = debugTurn();
    checkSignature(describe());
    return turn;
  }
  // The group's debug lock, noting when another thread holds it.
  std::unique_lock<std::recursive_timed_mutex> debugTurn();
  void checkSignature(const std::string& signature);
  // The shared-memory path's share of a CPU call (group_coordinator_shm.cpp):
  // each returns nullopt when the path does not take the call (Gloo does).
  // `part`: the tensor's place in a coalesced call (checked across ranks).
  std::optional<Pending> shmAllreduce(const at::Tensor& input, at::Tensor& output,
                                      const c10d::ReduceOp& op, bool asyncOp,
                                      const mq::ShmPart& part = {});
  std::optional<Pending> shmAllgather(const at::Tensor& input, const std::vector<void*>& outs,
                                      std::vector<at::Tensor> results, bool asyncOp,
                                      const mq::ShmPart& part = {});
  std::optional<Pending> shmReduceScatter(const std::vector<const void*>& ins, at::Tensor& output,
                                          const c10d::ReduceOp& op, bool asyncOp,
                                          const mq::ShmPart& part = {});
  std::optional<Pending> shmBroadcast(at::Tensor& tensor, int root, bool asyncOp);
  std::optional<Pending> shmBarrier(bool asyncOp);
  // The group's shared-memory path when it takes this call (`reduceOp`
  // null: a call that only moves bytes), else null; logs the decision
  // under TPCOMM_LOG=routes.
  struct CpuPath {
    mq::ShmGroup* shm = nullptr;
    HierGroup* hier = nullptr;
    explicit operator bool() const { return shm != nullptr || hier != nullptr; }
  };
  // With shmMutex_ held: the hierarchical set-up after setUpCpuShm found
  // the ranks on several hosts.
  void setUpHierLocked(const CpuShmSetup& setup, const CpuShmConfig& config);
  CpuPath shmFor(const char* op, const at::Tensor& tensor, const c10d::ReduceOp* reduceOp);
  // Whether the group has a shared-memory path (one host or hierarchical).
  bool cpuShmReady() { return cpuHier() != nullptr || cpuShm() != nullptr; }

  GroupOptions options_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::atomic<int> shrinks_{0};  // shrink(): each one a prefix of its own
  std::atomic<int> windows_{0};  // nextWindowStore(): each one a prefix of its own
  // shutdown() and abort(): this rank leaves the group's life (endLife) when
  // no call of its is in flight.
  void endLifeIfIdle();
  std::atomic<bool> lifeEnded_{false};  // endLifeIfIdle() ended this rank's life
  c10::intrusive_ptr<c10d::Backend> cpu_;
  BackendFactory deviceFactory_;
  mutable std::mutex deviceMutex_;
  c10::intrusive_ptr<c10d::Backend> device_;
  CustomDeviceFactory customDeviceFactory_;
  std::optional<at::Device> cudaDevice_;  // guarded by deviceMutex_
  std::shared_ptr<CustomPath> custom_;    // guarded by deviceMutex_
  // Whether a batch is open (startCoalescing), and the device backend's.
  std::atomic<bool> coalescing_{false};
  bool deviceCoalescing_ = false;     // guarded by deviceMutex_
  std::thread::id coalescingThread_;  // guarded by deviceMutex_
  // custom_.get() once set up and available: the fault releaser's and the
  // watchdog's (they never take deviceMutex_, which a set-up holds while it
  // waits for the peers).
  std::atomic<CustomPath*> customFast_{nullptr};
  std::optional<c10::cuda::CUDAStream> commStream_;  // async custom calls
  mutable std::mutex shmMutex_;
  bool shmTried_ = false;                        // guarded by shmMutex_
  std::atomic<mq::ShmGroup*> shmFast_{nullptr};  // shm_.get() once set up: the per-call read
  std::unique_ptr<mq::ShmGroup> shm_;            // guarded by shmMutex_
  std::atomic<HierGroup*> hierFast_{nullptr};    // hier_.get() once set up
  std::unique_ptr<HierGroup> hier_;              // guarded by shmMutex_
  std::string hierReason_;                       // guarded by shmMutex_
  std::string hierLayout_;                       // guarded by shmMutex_
  BackendFactory cpuFactory_;
  std::string shmReason_ = "not set up yet (at the group's first CPU collective)";
  std::string shmMode_;                // setCpuShmMode's override; guarded by shmMutex_
  std::string shmIsa_;                 // setCpuReduceIsa's override; guarded by shmMutex_
  std::optional<int64_t> shmSpinUs_;   // setCpuShmSpinUs's override; guarded by shmMutex_
  int shmCpus_ = 0;                    // CpuShmSetup::cpus; guarded by shmMutex_
  std::vector<RankShare> shmRanks_;    // CpuShmSetup::ranks; guarded by shmMutex_
  std::optional<int64_t> shmThreads_;  // setCpuShmThreads's override; guarded by shmMutex_
  std::string shmError_;               // a refused TPCOMM_CPU_SHM=1 set-up, raised by every call
  std::atomic<int> registrationDepth_{0};  // read on every custom call, without the lock
  uint64_t debugSequence_ = 0;             // guarded by debugMutex_
  std::recursive_timed_mutex debugMutex_;  // TPCOMM_DEBUG: one checked call at a time
  std::mutex debugNoteMutex_;
  std::string debugCurrent_;             // "thread T: <signature>" in progress; by debugNoteMutex_
  std::array<long, 16> debugThreads_{};  // threads of the last checks; by debugNoteMutex_
  size_t debugThreadNext_ = 0;           // by debugNoteMutex_
  std::unique_ptr<P2pChecker> p2p_;      // TPCOMM_DEBUG's send/recv check (CPU tensors)
  // The numbering of the CPU route's large messages (framed_p2p.hpp).
  const std::shared_ptr<FramedRests> framedRests_ = makeFramedRests();
  std::shared_ptr<GroupFault> fault_;
  RouteStats stats_;
  RoutingTable routing_;
  RouteLog routeLog_;
  const bool logRoutes_;  // TPCOMM_LOG=routes, read once
  // Logs (TPCOMM_LOG=routes) an allreduce's route the first time it is taken.
  void logAllreduceRoute(const c10d::ReduceOp& op, const at::Tensor& tensor,
                         const std::string& routeName, const std::string& reason);
};

}  // namespace tpcomm::coord
