#pragma once
// tpcomm's calls in torch's own flight recorder (c10d::FlightRecorder over
// c10::Event, the one ProcessGroupGloo and ProcessGroupNCCL record into and
// torch._C._distributed_c10d._dump_fr_trace dumps), so that a hang or a
// mismatch is debugged the way PyTorch documents it, with `torchfrtrace`.
//
// torch keeps that recorder's singleton out of its exported symbols. It is
// found once per process by name in libtorch_cpu's symbol table (the wheels
// on PyPI carry one), checked against what its constructor set, and then
// written through torch's own header (same layout, same mutex). Where it
// cannot be found (a stripped build), recording is off and status() says
// why; nothing else changes.
//
// Cost: one entry per call under the recorder's mutex, without a Python
// stack unless TPCOMM_FR_STACKS=1 (torch's own entries gather one); nothing
// when TORCH_FR_BUFFER_SIZE=0. Once the ring is full an entry is written
// over the one it replaces, into the strings and vectors that one had
// (allocating only where it needs more room than that one had).

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/ATen.h>

namespace tpcomm::backend {

struct FlightId {
  std::optional<size_t> id;
  std::optional<size_t> epoch;
};

// torch's name of a tpcomm call in its recorder ("allreduce" -> "all_reduce"):
// the names torchfrtrace knows.
const char* flightOpName(const char* op);

// A profiling name to write into an entry, without building a string first:
// `name`, and " tpcomm/<route>" after it where a route is set. Empty when
// `name` is.
struct FlightName {
  std::string_view name;
  const char* route = nullptr;  // a static string (coord::statsRouteName)
  bool empty() const { return name.empty(); }
  void writeTo(std::string& out) const;
};

// One call's entry, as the backend's run() keeps it. torchfrtrace (torch
// 2.11) reads only entries named "nccl:<op>" or "xccl:<op>": tpcomm's take
// the first form, the group's description says tpcomm, and the route follows
// the op ("nccl:all_reduce tpcomm/cpu_shm"; torchfrtrace ignores what
// follows a collective's name).
struct FlightCall {
  FlightId id;
  std::string name;  // "nccl:<op>", or "nccl:send 0->1" for point to point
  bool p2p = false;
  // The name with the route this thread's last call took, once the
  // coordinator chose it; empty for point to point or when none is known.
  // It refers to `name`: used while this FlightCall lives.
  FlightName routed() const;
};

// Empty when `instance` (a c10d::FlightRecorder<c10::Event>) holds what its
// constructor set (enabled by its size, its epoch's start index, no more
// entries than its size), else why not: the check that the instance found
// by name is the object torch's header describes.
std::string recorderLayoutProblem(void* instance);

class FlightRecord {
 public:
  // The process's recorder (found on first use).
  static FlightRecord& get();

  bool enabled() const { return recorder_ != nullptr; }
  // "on (...)", or "off: <why>".
  std::string status() const;

  // A group's identity in the dump: torch's (group name, description) and
  // its global ranks, recorded once per group.
  void recordGroup(const std::string& name, const std::string& desc,
                   const std::vector<uint64_t>& ranks);
  // One call started (scheduled and started at once: tpcomm runs or issues
  // it in the caller's thread).
  FlightId record(size_t pgId, const std::string& name, const std::string& desc,
                  size_t collectiveSeq, size_t p2pSeq, std::string_view profilingName,
                  c10::ArrayRef<at::Tensor> inputs, c10::ArrayRef<at::Tensor> outputs,
                  std::chrono::milliseconds timeout, bool isP2P);
  // The call's route became known: its profiling name becomes `name` (an
  // empty one changes nothing).
  void rename(const FlightId& id, const FlightName& profilingName);
  // The call completed. A call that failed is left started.
  // A non-empty `profilingName` (the route now known) replaces its name.
  void retire(const FlightId& id, const FlightName& profilingName = {});

  // This process's global rank (names its dump file: flight_dump.hpp).
  void setRank(int rank);
  // After a communication failure (timeout, lost peer, mismatch, abort):
  // writes torch's dump of the whole recorder through torch's writer (the
  // merging one: TORCH_FR_DUMP_TEMP_FILE + rank, with the entries of the
  // dumps written there before), when the user asked for dumps (that
  // variable or TORCH_NCCL_DEBUG_INFO_TEMP_FILE set, or
  // TORCH_FR_DUMP_ON_TIMEOUT=1). Returns " (flight recorder dumped to F)" or
  // "". Never throws.
  std::string dumpAfterFailure();
  // Renames the entries tpcomm's own Gloo groups recorded ("gloo:<op>",
  // which torchfrtrace cannot read) "nccl:<op> tpcomm/internal"; run before
  // every dump (tpcomm wraps torch's _dump_fr_trace functions with it).
  void renameInternal();

 private:
  FlightRecord();
  void* recorder_ = nullptr;  // c10d::FlightRecorder<c10::Event>*
  bool stacks_ = false;
  bool dumps_ = false;
  int rank_ = 0;
  std::string status_;
};

}  // namespace tpcomm::backend
