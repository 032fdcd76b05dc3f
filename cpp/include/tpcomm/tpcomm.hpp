#pragma once
// tpcomm from C++: the public header of the installed package.
//
//   find_package(tpcomm REQUIRED)            # with torch's and tpcomm's prefixes
//   target_link_libraries(app PRIVATE tpcomm::tpcomm)
//
//   auto store = c10::make_intrusive<c10d::TCPStore>(host, storeOptions);
//   auto pg = tpcomm::makeProcessGroup(store, rank, size);
//   pg->allreduce(tensors)->wait();          // CPU: shared memory on one host
//   auto mq = tpcomm::MessageQueue::create(pg);
//   auto inputs = mq->broadcastTensorDict(rank == 0 ? step : TensorDict{});
//
// The same backend as `init_process_group("tpcomm")` in Python, made without
// Python: CPU tensors go through shared memory among ranks of one host
// (hierarchically across hosts) and torch's Gloo otherwise; CUDA tensors
// through tpcomm's peer-to-peer kernel for small allreduces and torch's NCCL
// otherwise (made on the first CUDA call). docs/cpp.md has the whole story.
//
// Errors, as in Python: a bad argument throws c10::Error naming it, before
// anything is sent; a communication failure (a timeout, a lost peer, a call
// another rank refused, an abort) throws c10d::DistBackendError with the
// message Python shows, on every rank of the group. Every wait is bounded by
// the group's timeout. Calls are recorded in torch's flight recorder
// (TORCH_FR_BUFFER_SIZE), and a failing call writes its dump
// (TORCH_FR_DUMP_TEMP_FILE) as in Python.
//
// Only torch's public headers are needed (no Gloo, NCCL or Python headers).
// The library must be used with the torch it was built against
// (tpcomm::builtWithTorch(); the CMake package refuses another one).

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace tpcomm {

// tpcomm's version ("0.2.0") and the torch version it was built against.
std::string version();
std::string builtWithTorch();

struct Options {
  // Bounds every wait of every call of the group (torch's default: 30 min).
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  // Names the group in errors and in the flight recorder ("": "0"), and
  // scopes its keys in the store: groups made on one store need distinct
  // names (as torch names its groups "0", "1", ...).
  std::string groupName;
  // The group's ranks in the whole job, for the flight recorder's group
  // table (empty: 0 .. size-1).
  std::vector<uint64_t> globalRanks;
};

// Makes a tpcomm backend over `store` for group rank `rank` of `size`.
// Collective: every rank of the group calls it with its own rank and the
// same store, size and options; it returns once the group's CPU (Gloo)
// connections are up. The store may be shared with other groups of other
// names (every key of a group sits under its name, then under a prefix of
// its own life, so a group remade under the same name starts afresh). Throws c10::Error for
// a bad argument and c10d::DistBackendError when a rank does not take part
// within the timeout. Thread safety: as any c10d::Backend (one thread per
// group at a time, as torch's own backends).
c10::intrusive_ptr<c10d::Backend> makeBackend(const c10::intrusive_ptr<c10d::Store>& store,
                                              int rank, int size,
                                              const Options& options = {});

// makeBackend registered on a c10d::ProcessGroup for CPU and CUDA tensors
// (the process group torch's Python front door would make for
// init_process_group("tpcomm")). Same contract as makeBackend.
c10::intrusive_ptr<c10d::ProcessGroup> makeProcessGroup(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    const Options& options = {});

// allreduce of `tensor` in place over `pg`, by the direct route: straight to
// the group's backend for the tensor's device, without torch's dispatcher
// (Python's dist.all_reduce takes the same route). Synchronous as
// pg->allreduce({tensor})->wait(): a CPU call has finished when it returns; a
// CUDA call is ordered on the current stream. About 0.8 us less per call
// than pg->allreduce (docs/cpp.md). Errors as pg->allreduce.
void allReduce(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, at::Tensor& tensor,
               c10d::ReduceOp op = c10d::ReduceOp::SUM);

// Whether `backend` is a tpcomm backend.
bool isTpcomm(const c10::intrusive_ptr<c10d::Backend>& backend);

// Calls and bytes per route on this rank (routes: cpu_shm, cpu_hier, gloo,
// custom_oneshot, custom_twoshot, nccl, ...), as `tpcomm.stats()`. Throws
// c10::Error when `pg` has no tpcomm backend for CPU tensors.
struct RouteStats {
  std::string route;
  uint64_t calls = 0;
  uint64_t bytes = 0;
};
std::vector<RouteStats> stats(const c10::intrusive_ptr<c10d::ProcessGroup>& pg);

// Why the group broke (an abort, a failed call, a call another rank
// refused), "" while it works. Same throw as stats().
std::string fault(const c10::intrusive_ptr<c10d::ProcessGroup>& pg);

// Tensors by name, as Python's broadcast_tensor_dict (ordered by name).
using TensorDict = std::map<std::string, at::Tensor>;

struct MessageQueueOptions {
  int writerRank = 0;                  // group rank that writes
  uint64_t maxChunkBytes = 1u << 20;   // ring chunk; larger messages stream
  uint64_t maxChunks = 8;              // chunks in the ring
  // Bounds each wait on the ring for the other end (a full ring, a message
  // not yet written). Readers on other hosts wait in the group's
  // send/recv, bounded by the group's timeout instead.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
};

// One writer, every other rank of the group a reader: the writer's messages
// go through a shared-memory ring to the readers on its host and through the
// group's CPU backend (point to point) to readers on other hosts. CPU tensor
// bytes are copied raw into the ring; CUDA tensors in a tensor dict are
// broadcast over the group's CUDA backend after the message.
//
// Ordering: messages arrive in the order written; each broadcast call is
// matched by one call on every rank. Thread safety: one thread per queue.
// Errors: Timeout and lost peers throw c10d::DistBackendError naming the
// peer; calling a writer's method on a reader (or the reverse) throws
// c10::Error. A message read from shared memory is bounds-checked.
class MessageQueue {
 public:
  // Collective over `pg` (its CPU backend): every rank calls it with the same
  // options. The writer waits here until every reader on its host attached.
  // A rank that cannot create or attach its end makes every rank throw,
  // naming it.
  static std::unique_ptr<MessageQueue> create(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                              const MessageQueueOptions& options = {});
  ~MessageQueue();
  MessageQueue(const MessageQueue&) = delete;
  MessageQueue& operator=(const MessageQueue&) = delete;

  bool isWriter() const;
  int writerRank() const;

  // Writer: sends `bytes` and returns them. Reader: `bytes` must be empty;
  // returns the writer's bytes.
  std::string broadcastBytes(const std::string& bytes = {});

  // Writer: sends `tensors` (CPU tensors raw, CUDA tensors over the group's
  // CUDA backend; any dtype but quantized and sparse, any shape, made
  // contiguous) and returns them. Reader: `tensors` must be empty; returns
  // new tensors equal to the writer's (CUDA ones on the current device).
  TensorDict broadcastTensorDict(const TensorDict& tensors = {});

  // Shuts the host's ring down: every waiter on it, on any rank of this
  // host, wakes and throws, and later calls throw (the ring is shared by the
  // host's ranks, so one rank's shutdown ends it for all of them). May be
  // called from another thread; idempotent. A wait in the group's send/recv
  // (readers on other hosts) or CUDA broadcast is not woken: it ends with
  // the group's timeout, or at once when the group is aborted.
  void shutdown();

 private:
  struct Impl;
  explicit MessageQueue(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tpcomm
