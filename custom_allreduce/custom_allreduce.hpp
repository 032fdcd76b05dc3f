#pragma once
// Public host-side header of the custom peer-to-peer allreduce (tpcomm::car).
// Declares host functions only; kernels stay in this folder's .cu/.cuh files.
//
// Each rank owns one device buffer (layout below) that every peer can reach:
// through CUDA IPC across processes, or directly when one process drives N
// ranks on N streams of one GPU (how the kernels are tested and timed on a
// single GPU). The kernels only see the buffers' base pointers, one per rank.
//
// Buffer of one rank (BufferLayout::forMaxBytes, offsets 256-byte aligned):
//
//   +-------------------------------+ 0
//   | Signal: flag slots written by |  flags[block][phase][peer], one 128-byte
//   | peers, this rank's epochs     |  slot each; epoch[block]; pushed[k]
//   +-------------------------------+ pushOffset
//   | push buffers: push[k][source] |  kPushDepth x kMaxRanks slots of
//   | written by the peers (values  |  pushSlotBytes (push one-shot only;
//   | that carry their own arrival) |  zero = empty, reset with the Signal)
//   +-------------------------------+ signalBytes = stagingOffset
//   | staging of even calls: this   |  maxBytes (copied in by the kernel)
//   | rank's input                  |
//   +-------------------------------+ stagingOffset + stagingBytes
//   | staging of odd calls          |  maxBytes (signal.hpp, "Staging parity")
//   +-------------------------------+ resultOffset
//   | result: this rank's reduced   |  maxBytes (two-shot only)
//   | part                          |
//   +-------------------------------+ totalBytes
//
// Algorithms (sum, float32 accumulation, ranks added in order 0..N-1 so that
// every rank gets the same bits):
//   push      every rank writes its input straight into a slot of every
//             peer's push buffer, its values carrying their own arrival (no
//             flag, no barrier: push_kernels.cuh), then sums its own slots.
//             A zero of either sign is read as +0 (so an element that is -0 on
//             every rank sums to +0, where IEEE addition gives -0)
//   one-shot  every rank copies its input to its staging, then reads all N
//             stagings and writes the sum (reads N x bytes per rank)
//   two-shot  rank r sums part r of all stagings into its result region,
//             then every rank gathers the N parts (reads 2 x bytes per rank)

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

namespace tpcomm::car {

struct LaunchParams;

inline constexpr int kMaxRanks = 8;
inline constexpr int kMaxBlocks = 64;
inline constexpr int kThreads = 512;
inline constexpr size_t kPackBytes = 16;  // one vector load
// The largest call the push one-shot takes (a push slot's size; less when
// the group's maximum is smaller).
inline constexpr size_t kPushMaxBytes = 256 << 10;

// CUDA runtime version the kernels were compiled against (e.g. 13000).
int compiledCudaVersion();

// The SM architectures with machine code in this build (e.g. {800, 900}).
std::vector<int> compiledArchitectures();

// What every rank of a group must share for its kernels to meet: the signal
// layout and the launch shape (compared by the set-up).
std::string protocolId();

enum class DType { kFloat32, kFloat16, kBFloat16 };
const char* dtypeName(DType dtype);
size_t dtypeSize(DType dtype);

enum class Algorithm { kOneShot, kTwoShot, kPush };
const char* algorithmName(Algorithm algorithm);

struct BufferLayout {
  // The area a reset zeroes: the Signal, then the push buffers.
  size_t signalBytes = 0;
  size_t pushOffset = 0;     // push[k][source] at pushOffset + (k x kMaxRanks + source) x slot
  size_t pushSlotBytes = 0;  // min(maxBytes, kPushMaxBytes), aligned
  // Bytes a push call may carry (the slot, less its alignment padding).
  size_t pushMaxBytes() const { return pushSlotBytes; }
  size_t stagingOffset = 0;  // staging of even calls
  size_t stagingBytes = 0;   // odd calls' staging is at stagingOffset + stagingBytes
  size_t resultOffset = 0;
  size_t maxBytes = 0;
  size_t totalBytes = 0;
  // Throws InvalidUsage unless maxBytes is a positive multiple of 16.
  static BufferLayout forMaxBytes(size_t maxBytes);
};

// Largest one-shot size per world size before autotune has measured (1 MiB
// at 2 ranks, 512 KiB at 3-4, 256 KiB at 5-8: one-shot reads N x the bytes,
// so it stops paying off earlier at larger N); above it, two-shot up to the
// maximum.
size_t oneShotLimit(int worldSize, size_t maxBytes);
// Largest push one-shot (values carry their arrival, no barrier) by world
// size, at most the push slot of a group of this maximum; below it a
// one-shot call is a push (pushApplies), unless TPCOMM_CAR_PUSH_MAX_BYTES
// says otherwise (`setting` >= 0: that limit; 0: never).
size_t pushLimit(int worldSize, size_t maxBytes, int64_t setting = -1);
bool pushApplies(int worldSize, size_t bytes, size_t maxBytes, int64_t setting = -1);
// By size: push up to pushLimit, one-shot up to oneShotLimit, else two-shot.
Algorithm chooseAlgorithm(int worldSize, size_t bytes, size_t maxBytes, int64_t pushSetting = -1);
// Thread blocks for a call: `override` when positive (1..kMaxBlocks), else
// enough blocks of kThreads threads for the packs one block handles, at most
// `cap` (kMaxBlocks; kSharedGpuBlocks when ranks share a GPU).
int chooseBlocks(Algorithm algorithm, int worldSize, size_t bytes, int override,
                 int cap = kMaxBlocks);
// The most blocks chosen by size when ranks of a group share a GPU: all of
// their blocks must be resident at once. The launch caps every count (an
// explicit one too) further to what the GPU holds of the kernel it runs,
// divided among the ranks (and halved with PDL, when a rank's next kernel
// may hold its blocks too): kernels above 40 registers a thread hold two
// blocks of 512 threads per SM, 264 on an H100, less than 8 x 36.
inline constexpr int kSharedGpuBlocks = 36;

// Blocks per rank when all `worldSize` ranks of a group run on one GPU
// (LocalGroup, processes sharing a GPU): every rank's blocks wait for each
// other, so all worldSize x blocks must be resident at once, and the GPU holds
// at most `residentTotal` of the kernel. `requested` > 0 is refused
// (InvalidUsage, with the most it may be) when too many; else `chosen` is
// capped to fit.
int sharedGpuBlocks(int worldSize, int requested, int chosen, int residentTotal);
// How many blocks of the kernel for (dtype, algorithm, world size; `fused`:
// the add + RMSNorm kernel) the current GPU holds at once (SMs x blocks per
// SM by occupancy). GPU only.
int maxResidentBlocks(DType dtype, Algorithm algorithm, int worldSize, bool fused = false);

// Whether a group's kernels may use GPU-scope flags: `setting` (TPCOMM_CAR_
// FLAG_SCOPE) is "auto" and every rank's GPU (`devices`, one index per rank,
// as the set-up numbers them) is the same. Every rank decides from the same
// data, so all agree.
bool deviceScopeFor(const std::vector<int>& devices, const std::string& setting);
// Whether two ranks of `devices` (one GPU index per rank) share a GPU.
bool sharesAGpu(const std::vector<int>& devices);

// Whether [a, a + bytes) and [b, b + bytes) share a byte.
bool rangesOverlap(const void* a, const void* b, size_t bytes);

// Whether a group or a call can use the kernel, and if not, why.
struct Eligibility {
  bool eligible = false;
  std::string reason;  // empty when eligible
};

// What the ranks of a group reported about themselves.
struct Topology {
  std::vector<std::string> hostIds;  // one per rank
  std::vector<int> devices;          // index of each rank's GPU among the group's GPUs
  // access[i][j]: whether rank i's GPU can reach rank j's: 'y'
  // (cudaDeviceCanAccessPeer), 'x' (no P2P), '?' (rank j's GPU is not visible
  // to rank i's process, e.g. one CUDA_VISIBLE_DEVICES GPU per rank: the
  // write probe decides). Ranks sharing a GPU need nothing.
  std::vector<std::string> access;
  // links[i][j]: 'n' NVLink, 'p' no NVLink (P2P over PCIe), '?' unknown (no
  // NVML). Past 2 GPUs every pair must be NVLink.
  std::vector<std::string> links;
  bool probeSucceeded = true;  // every rank saw every peer's IPC write
  std::string probeDetail;     // what the probe saw when it failed
};

// Checked once per group: world size 2..8, one host, P2P between every pair
// of GPUs, NVLink between every pair past 2 GPUs (the kernel reads every
// peer's memory directly; over PCIe it loses to NCCL there), the write probe.
Eligibility groupEligibility(const Topology& topology);
// Checked per call: dtype is float32/float16/bfloat16 (`dtypeName` of any
// other type in `otherDtype`), both pointers 16-byte aligned, size within the
// maximum.
Eligibility callEligibility(const std::string& dtype, size_t bytes, uintptr_t input,
                            uintptr_t output, size_t maxBytes);

// Zero-copy: where every rank's input of one captured call lives, as this
// process reaches it (a peer's registered input, or its staging region when
// that peer copies). One per captured call, in device memory; the kernel
// refuses to run (error word) until `ready` is set.
struct alignas(16) RegisteredInputs {
  const void* input[kMaxRanks];
  uint32_t ready;
  uint32_t pad[3];
};

// How one call runs.
struct CallOptions {
  bool chooseAlgorithm = true;  // by size; else `algorithm`
  Algorithm algorithm = Algorithm::kOneShot;
  int blocks = 0;     // 0: TPCOMM_CAR_BLOCKS, else by size
  float scale = 1.f;  // out = scale x sum (AVG passes 1/N); applied in float32
  // Zero-copy (graph_capture()): the device table the kernel reads peers'
  // inputs from, and whether this rank still copies its own input into its
  // staging (its table entry then points there).
  const RegisteredInputs* registered = nullptr;
  bool stageInput = true;
};

// While alive, this thread may make calls that CUDA refuses during a graph
// capture in the default (global) mode, such as cudaMalloc or a stream
// synchronisation of a stream that is not being captured. The custom
// allreduce sets up, registers graph buffers and creates its launch order
// under it, so that all work when the first call on a group happens inside
// torch.cuda.graph.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode();
  ~RelaxedCaptureMode();
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_;
  bool restore_ = true;
};

// Serialises one rank's launches of a group, whatever stream each goes to:
// two kernels of one rank in flight at once would bump the same epochs and
// write the same staging buffer. Eager launches and graph replays alike.
class LaunchOrder {
 public:
  virtual ~LaunchOrder() = default;
  // Before a launch on `stream`: the stream waits for the previous launch.
  virtual void before(cudaStream_t stream) = 0;
  // After it: this launch becomes the previous one.
  virtual void after(cudaStream_t stream) = 0;
  // Returns when the last launch (eager, or in the last graph replay) has
  // ended; throws on a CUDA error. Touches no other stream, so it is safe
  // while another stream of the device is being captured; but once a launch
  // was captured without external event nodes (setCaptureEvents(false)), its
  // replays can be waited for only by synchronising the whole device.
  virtual void synchronize() = 0;
  // Whether the last launch has not ended yet (never blocks, never throws;
  // any thread; replays of graphs captured without external event nodes are
  // not seen). The emulation's launches end before they return.
  virtual bool pending() { return false; }
  // Whether captured launches also order themselves against launches
  // outside their graph (external event nodes; see makeEventLaunchOrder).
  virtual void setCaptureEvents(bool) {}
};

// The product's order: one CUDA event per rank of a group (as NCCL orders a
// communicator's operations). Eagerly, each launch's stream waits on the
// event and records it after the launch. Under graph capture, launches
// within one capture are chained by a second event inside the graph (an edge,
// whatever branch each is on). Against launches outside the graph (eager
// calls, other graphs) a replay is ordered by the stream it runs on, as
// NCCL's kernels with its graph mixing off and vLLM's are: external event
// nodes that would order it against launches on other streams cost more than
// the kernel (on an H200, 7 us per call at 2 ranks, 46 us at 8; tests/gpu/
// NOTES.md). With setCaptureEvents(true) (TPCOMM_CAR_GRAPH_ORDER=event) the
// wait and the record are captured as external event nodes too, so that
// every replay waits for whichever launch (eager or replayed) recorded the
// event last and then records it itself. Created on the device current at
// the first launch, and recorded once there, so that no wait ever meets an
// event never recorded.
std::unique_ptr<LaunchOrder> makeEventLaunchOrder();

// One rank's view of the group: what a kernel launch needs. Calls on one
// rank must be issued in the same order on every rank (as for any
// collective), and every rank of a group must use the same maxBytes. A launch
// and its ordering are made under a lock, so threads may share it.
class CustomAllreduce {
 public:
  // `buffers[r]`: rank r's buffer base as this process reaches it (IPC-opened
  // or local), each laid out by BufferLayout::forMaxBytes(maxBytes) and
  // zeroed before first use. `errorWord` must be device-visible host memory
  // (cudaHostAllocMapped) owned by the caller; the kernels write a failure
  // code there.
  // `order` null: makeEventLaunchOrder() (the CPU emulation passes its own).
  CustomAllreduce(int rank, int worldSize, std::vector<void*> buffers, size_t maxBytes,
                  std::chrono::milliseconds timeout, uint32_t* errorWordHost,
                  uint32_t* errorWordDevice, std::unique_ptr<LaunchOrder> order = nullptr);
  // Waits for this rank's launches (errors ignored): whoever owns the
  // buffers unmaps them after this.
  ~CustomAllreduce();
  CustomAllreduce(const CustomAllreduce&) = delete;
  CustomAllreduce& operator=(const CustomAllreduce&) = delete;

  // Returns when every launch of this rank has ended (the launch order's
  // synchronize); throws on a CUDA error.
  void waitForLaunches();

  int rank() const { return rank_; }
  int worldSize() const { return worldSize_; }
  size_t maxBytes() const { return layout_.maxBytes; }
  // How long a kernel waits for a peer; calls enqueued afterwards use a new
  // value (every rank of a group should use the same one).
  std::chrono::milliseconds timeout() const { return std::chrono::milliseconds(timeoutMs_.load()); }
  void setTimeout(std::chrono::milliseconds timeout);
  // Flags at GPU scope (true) or system scope (false, the default). GPU
  // scope is correct only when every rank of the group runs on this GPU
  // (ranks as streams of one process, processes sharing one GPU): decided by
  // the set-up, the same on every rank (deviceScopeFor). Calls
  // enqueued afterwards use the new value.
  void setDeviceScope(bool deviceScope) { deviceScope_.store(deviceScope); }
  // Whether two ranks of the group share a GPU (decided by the set-up): the
  // blocks chosen by size are then at most kSharedGpuBlocks.
  void setSharedGpu(bool shared) { sharedGpu_.store(shared); }
  // Programmatic dependent launch (TPCOMM_CAR_PDL, decided by configureFor;
  // used only for kernels compiled with the wait, on sm_90+): calls enqueued
  // afterwards use the new value. With ranks sharing a GPU, each rank then
  // gets at most half of its share of what the GPU holds of the kernel.
  void setPdl(bool pdl) { pdl_.store(pdl); }
  bool pdl() const { return pdl_.load(); }
  bool deviceScope() const { return deviceScope_.load(); }
  // Whether captured launches carry external event nodes (makeEventLaunchOrder;
  // TPCOMM_CAR_GRAPH_ORDER): true, a replay may run beside this rank's eager
  // calls or other replays on other streams; false (the default), a replay is
  // ordered against them by its stream only. Captures made afterwards use
  // the new value.
  void setCaptureEvents(bool events);
  bool captureEvents() const { return captureEvents_.load(); }
  // The set-up's choices from every rank's GPU (`devices`, one index per
  // rank, the same on every rank) and this process's settings: the flag
  // scope (TPCOMM_CAR_FLAG_SCOPE), the block cap for a shared GPU, the
  // graph order (TPCOMM_CAR_GRAPH_ORDER) and dependent launches
  // (TPCOMM_CAR_PDL).
  void configureFor(const std::vector<int>& devices);

  // Enqueues out = scale x sum over ranks of in (count elements) on
  // `stream`. `in` may equal `out`. Capturable in a CUDA graph: the copy into
  // the staging buffer happens inside the kernel and the flags advance on the
  // device, so each replay is a fresh allreduce. Throws InvalidUsage for an
  // ineligible call and PeerLost if an earlier call failed (see checkError).
  // Returns the algorithm used.
  Algorithm allreduce(const void* in, void* out, size_t count, DType dtype, cudaStream_t stream,
                      const CallOptions& options = {});
  // The fused residual add + RMSNorm of `rows` rows of `hidden` elements
  // (fused_kernels.cuh): residualOut = sum over ranks of in + residual,
  // normed = residualOut / sqrt(mean(residualOut^2) + eps) x weight, row by
  // row with float32 statistics; residual, residualOut, weight (hidden
  // elements) and normed are this rank's device memory of `dtype`. `in` may
  // be normed or residualOut and residualOut may be residual; any other
  // overlap is refused (InvalidUsage). The input is always staged (no
  // zero-copy); options.registered must be null. Otherwise as allreduce().
  struct AddRmsNorm {
    const void* residual = nullptr;
    void* residualOut = nullptr;
    const void* weight = nullptr;
    void* normed = nullptr;
    size_t rows = 0;
    size_t hidden = 0;
    float eps = 1e-6f;
  };
  Algorithm allreduceAddRmsNorm(const void* in, const AddRmsNorm& norm, DType dtype,
                                cudaStream_t stream, const CallOptions& options = {});
  // One call that moves no data: the start barrier alone (one flag round
  // trip per block between every pair of ranks), on `blocks` blocks. For the
  // benchmark's breakdown of a call's time; ordered and checked like a call.
  void barrierOnly(cudaStream_t stream, int blocks);
  // Rank r's staging region as this process reaches it (a zero-copy table
  // entry for a rank that copies; the kernel reads the region of the call's
  // parity).
  const void* stagingOf(int rank) const;

  // After the stream's work is done: throws Timeout naming the peer a kernel
  // waited for in vain, if one did.
  void checkError() const;
  // The failure code a kernel left (0: none).
  uint32_t errorCode() const;
  // Clears this rank's error word only (the flags and the poison stay): use
  // reset() to make the group usable again.
  void clearError();

  // Stops the group's kernels at once, this rank's and every peer's, running
  // and queued (signal.hpp, "Abort"): for a group that broke. Only the
  // collective reset makes the group usable again. Any thread, never throws,
  // never waits for the GPU. `writePoison(word, value)` stores one word of a
  // rank's signal area; by default a 4-byte copy on a private stream of the
  // current device (the group's), which the caller must have made current.
  using PoisonWriter = std::function<void(uint32_t* word, uint32_t value)>;
  void abort(const PoisonWriter& writePoison = {});
  // Whether this rank's last launch (eager or replayed) has not ended yet:
  // a kernel that may be waiting for a peer. Never blocks on the GPU; call it
  // with the group's device current. False before the first launch, without
  // any CUDA call (launchedOnce()).
  bool launchesPending();
  bool launchedOnce() const { return queryableOrder_.load(std::memory_order_acquire) != nullptr; }

  // The collective reset after a failure; every rank of the group calls it,
  // and the group is usable again when it returns:
  //   1. synchronize(): every kernel this rank launched has ended (each ends
  //      within its timeout, at once when the group is poisoned); it must
  //      throw rather than return early (waitForLaunches() does);
  //   2. barrier(): so no rank of the group has a kernel in flight, and no
  //      late flag write of a failed call can land after step 3;
  //   3. zeroSignals(own buffer): its signal area (BufferLayout::signalBytes:
  //      flags, poison, epochs, rounds and the push buffers), then the
  //      error word is cleared;
  //   4. barrier(): no rank launches (and writes flags into a peer) before
  //      every rank has zeroed.
  // Epochs restart at 1 on every rank alike. Two resets of one rank do not
  // interleave; calls on other threads meanwhile are the caller's bug.
  struct ResetOps {
    std::function<void()> synchronize;
    std::function<void()> barrier;  // a CPU barrier of the whole group, bounded in time
    std::function<void(void* buffer)> zeroSignals;  // done when it returns
  };
  void reset(const ResetOps& ops);

 private:
  int rank_;
  int worldSize_;
  std::vector<void*> buffers_;
  BufferLayout layout_;
  std::atomic<int64_t> timeoutMs_;
  std::atomic<bool> deviceScope_{false};
  std::atomic<bool> sharedGpu_{false};
  std::atomic<bool> captureEvents_{false};
  std::atomic<bool> pdl_{false};
  uint32_t* errorHost_;
  uint32_t* errorDevice_;
  std::mutex launchMutex_;
  std::unique_ptr<LaunchOrder> order_;                 // guarded by launchMutex_
  std::atomic<LaunchOrder*> queryableOrder_{nullptr};  // order_ once made (launchesPending)
  std::mutex resetMutex_;

  // The algorithm of a call: options.algorithm when given (a push must fit
  // the push buffer: `pushBytes`, whole packs), else by size (a push when
  // pushApplies, under TPCOMM_CAR_PUSH_MAX_BYTES).
  Algorithm pickAlgorithm(size_t pushBytes, size_t bytes, const CallOptions& options) const;
  // The checks every call makes (eligibility, an earlier failure).
  void checkCall(const void* in, const void* out, size_t bytes, DType dtype,
                 const CallOptions& options) const;
  // Fills the parameters every launch shares, then launches in order.
  void launch(LaunchParams& p, cudaStream_t stream, size_t bytes, const CallOptions& options);
};

// Zeroes the signal area of a buffer laid out by `layout` (flags, poison,
// epochs, rounds and the push buffers), ordered on `stream`; with a null
// stream, done when this returns.
void resetSignals(void* buffer, const BufferLayout& layout, cudaStream_t stream);

// Zeroes device memory and waits, on a stream of its own that no capture
// involves: safe while another stream of the device is being captured.
void zeroDeviceMemory(void* ptr, size_t bytes);

// Launches a kernel that does nothing (the benchmark's launch baseline).
void launchEmptyKernel(cudaStream_t stream);

// Describes a failure code: "rank 3 did not arrive (block 0, phase start)".
std::string describeError(uint32_t code);

// --- buffers ---------------------------------------------------------------

// One rank's device buffer (cudaMalloc on the current device, zeroed signal
// area) and its error word in mapped host memory.
class RankBuffer {
 public:
  explicit RankBuffer(size_t maxBytes);
  ~RankBuffer();
  RankBuffer(const RankBuffer&) = delete;
  RankBuffer& operator=(const RankBuffer&) = delete;

  void* base() const { return base_; }
  const BufferLayout& layout() const { return layout_; }
  uint32_t* errorHost() const { return errorHost_; }
  uint32_t* errorDevice() const { return errorDevice_; }
  // The IPC handle of the buffer (cudaIpcGetMemHandle), as bytes.
  std::string ipcHandle() const;
  int device() const { return device_; }

 private:
  void* base_ = nullptr;
  BufferLayout layout_;
  uint32_t* errorHost_ = nullptr;
  uint32_t* errorDevice_ = nullptr;
  int device_ = 0;
};

// Opens a peer's buffer from its IPC handle bytes; each handle is opened once
// per process and stays open until exit.
void* openIpcHandle(const std::string& handle);
// Unmaps a buffer openIpcHandle returned (its handle may then be opened
// again). Never throws; does nothing for any other pointer.
void closeIpcHandle(void* ptr);

// Writes `value` into the probe word of a peer buffer and reads back this
// rank's own probe words (the write probe of the eligibility check). Both
// are done when they return: on `stream` (then synchronised) or, when it is
// null, on the legacy stream with the device synchronised.
void writeProbe(void* peerBuffer, int fromRank, uint32_t value, cudaStream_t stream = nullptr);
std::vector<uint32_t> readProbes(void* ownBuffer, int worldSize, cudaStream_t stream = nullptr);

// Where the allocation holding `ptr` starts (cudaMalloc'd memory, through
// the driver's cuMemGetAddressRange) and its IPC handle as bytes. Throws
// Cuda, naming the call, for memory that cannot be exported (e.g. from the
// expandable-segments allocator).
struct ExportedPointer {
  std::string handle;
  size_t offset = 0;  // ptr - allocation start
};
ExportedPointer exportPointer(const void* ptr);

}  // namespace tpcomm::car
