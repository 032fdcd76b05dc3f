#pragma once
// CustomPath: one group's custom allreduce on one rank. Made (collectively,
// see custom_setup.hpp) at the group's first CUDA allreduce or eager
// connect; afterwards it enqueues the kernel for the calls the routing table
// sends it and keeps the zero-copy registration of graph_capture().
//
// Zero-copy (graph_capture()): while registration is on, every call captured
// into a CUDA graph gets a slot of a device table the kernel reads peers'
// input addresses from, instead of a staging copy. The table is filled when
// the context exits (finishGraphRegistration, collective): the ranks
// exchange, per captured call, the IPC handle and offset of their input, and
// every rank maps its peers'. A rank stages its own input instead (its table
// entry then points at its staging region) when that input is also the
// output of a one-shot call overlaps it (peers would read it while it is
// written), when its memory cannot be exported (the expandable-segments
// allocator), or when the table is full (kTableCapacity captured calls). Replaying such a graph
// before the context exited makes the kernel stop with an error, not read unmapped memory.

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "coordinator/cuda/custom_setup.hpp"
#include "coordinator/routing.hpp"
#include "custom_allreduce/custom_allreduce.hpp"

namespace tpcomm::coord {

// The kernel's dtype for a tensor dtype; InvalidUsage for any other.
car::DType carDType(at::ScalarType type);

struct ZeroCopyStats {
  int64_t registered = 0;  // captured calls whose input peers read in place
  int64_t staged = 0;      // captured calls that still copy (see lastStagedReason)
  std::string lastStagedReason;
  int64_t tableSlots = 0;     // slots taken (one per captured call, never reused)
  int64_t tableCapacity = 0;  // the most there can be
  bool tableFull = false;     // later captured calls stage
};

// Zero-copy table slots: allocated a chunk at a time (a captured kernel keeps
// its slot's address, so the table grows by chunks, never by moving), up to
// kTableCapacity: a server capturing 67 batch sizes x 64 allreduces takes 4,288.
inline constexpr int64_t kTableChunk = 4096;
inline constexpr int64_t kTableCapacity = 16 * kTableChunk;

class CustomPath {
 public:
  // Collective. `device` is this rank's GPU; `groupName` names the group in
  // errors.
  CustomPath(c10d::Backend& cpu, int rank, int size, at::Device device,
             std::unique_ptr<CustomDevice> gpu, size_t maxBytes, std::chrono::milliseconds timeout,
             std::string groupName, const LaunchSettings& launch = {},
             const std::string& skip = "");
  // A path that is off for every rank alike (`reason`), set up without any
  // exchange.
  explicit CustomPath(std::string reason);
  // Waits for this rank's kernels to end (a kernel in flight would touch
  // the peers' mappings and the table), then frees them.
  ~CustomPath();

  bool available() const { return available_; }
  const std::string& reason() const { return reason_; }
  at::Device device() const { return device_; }
  size_t maxBytes() const { return maxBytes_; }
  // Whether every rank is on a GPU of its own (NCCL needs that).
  bool distinctGpus() const;

  // Enqueues output = scale x (sum over ranks of input) on `stream` with the
  // algorithm of `route` (one-shot or two-shot); output may be input. Both
  // are contiguous CUDA tensors of the group's device, float32/float16/
  // bfloat16, at most maxBytes(). Inputs that are not 16-byte aligned go
  // through an aligned copy. `registering`: graph_capture() is open.
  void allreduce(const at::Tensor& input, const at::Tensor& output, DeviceRoute route, float scale,
                 c10::cuda::CUDAStream stream, bool registering);

  // Enqueues the fused allreduce + residual add + RMSNorm on `stream`
  // (car::CustomAllreduce::allreduceAddRmsNorm): residualOut = sum of
  // `input` + residual, normed = RMSNorm(residualOut) x weight over rows of
  // `hidden` (weight's numel) elements. Contiguous tensors of the group's
  // device and one dtype; residualOut may be residual. Tensors the kernel
  // cannot take as they are (not 16-byte aligned, an output overlapping
  // another tensor) go through aligned copies, so the route never changes.
  void allreduceAddRmsNorm(const at::Tensor& input, const at::Tensor& residual,
                           const at::Tensor& weight, double eps, const at::Tensor& normed,
                           const at::Tensor& residualOut, DeviceRoute route,
                           c10::cuda::CUDAStream stream);

  // Raises Timeout naming the peer when a kernel of this group gave up.
  void checkError() const;
  // Collective (every rank of the group, no call of the group in flight on
  // another thread): makes the group usable after a failure
  // (car::CustomAllreduce::reset: synchronise, barrier, zero, barrier).
  void reset(c10d::Backend& cpu);
  // How long the kernel waits for a peer (calls enqueued afterwards).
  void setTimeout(std::chrono::milliseconds timeout);
  // The group broke: stops this rank's kernels and every peer's at once
  // (car::CustomAllreduce::abort). Any thread, never throws; only reset()
  // makes the path usable again.
  void abort();
  // Whether this rank's last kernel (eager or replayed) has not ended: a
  // call that may be waiting for a peer. Any thread; never blocks.
  bool launchesPending() const;

  // While graph_capture() is open and a call is being captured: the table
  // slot the call's kernel reads its sources from (null when the table is
  // full: the call then stages), and in `stage` whether this rank still
  // copies its own input. Called by allreduce(); public for tests.
  const car::RegisteredInputs* registerCapturedCall(const void* input, const void* output,
                                                    size_t bytes, car::Algorithm algorithm,
                                                    bool* stage);

  // Collective: fills the zero-copy table of every call captured since the
  // last one (see above). Raises InvalidUsage on every rank when ranks
  // captured different numbers of calls; those graphs then refuse to replay.
  void finishGraphRegistration(c10d::Backend& cpu);
  ZeroCopyStats zeroCopyStats() const;

 private:
  struct Captured {
    int64_t slot;
    bool staged;
    std::string handle;  // IPC handle of the input's allocation (not staged)
    uint64_t offset;     // input - allocation start
    const void* own;     // this rank's table entry
  };
  [[noreturn]] void raiseEarlierFailure(const std::string& what) const;

  int rank_ = 0;
  // The kernel a call of `route` takes: two-shot, or on the one-shot route
  // a push while `pushBytes` (whole packs) fits car::pushLimit, else the
  // barrier one-shot.
  car::Algorithm algorithmFor(DeviceRoute route, size_t pushBytes) const;

  int size_ = 0;
  at::Device device_{at::kCPU};
  size_t maxBytes_ = 0;
  std::string groupName_;
  std::unique_ptr<CustomDevice> gpu_;
  bool available_ = false;
  std::string reason_;
  std::unique_ptr<car::CustomAllreduce> car_;
  std::vector<int> devices_;  // per rank, from the set-up

  mutable std::mutex mutex_;
  std::vector<car::RegisteredInputs*> tables_;  // device memory, kTableChunk entries each
  int64_t slotsUsed_ = 0;
  std::vector<Captured> captured_;
  ZeroCopyStats zeroCopy_;
};

}  // namespace tpcomm::coord
