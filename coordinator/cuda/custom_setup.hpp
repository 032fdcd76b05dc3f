#pragma once
// Setting up the custom allreduce for one group: every rank allocates its
// buffer, the ranks exchange what they are (host, GPU, IPC handle) through
// the group's CPU backend, open each other's buffers, prove with one real
// write per pair that the mapping works, and agree on whether the group can
// use the kernel and, if not, why. Collective: every rank of the group calls
// setUpCustomAllreduce at the same point of its call sequence.
//
// Rounds (each an allgather of fixed-size records over the CPU backend, so
// every rank decides from the same data and reaches the same verdict):
//   0. the settings that shape a launch (compared; refused on a mismatch)
//   1. host id, GPU UUID, IPC handle of the new buffer, or why the
//      allocation failed
//   2. this rank's row of the P2P access and NVLink matrices (checked
//      against one host first)
//   3. whether opening every peer's handle and the probe writes worked
//      (the allgather is also the barrier between the writes and the reads)
//   4. which peers' probe writes this rank saw
// A rank that fails a step still takes part in every later round, so no
// rank is left waiting; the verdict then names it.
//
// The GPU side is behind CustomDevice, so that the protocol runs in unit
// tests with a fake device (tests/cpp) and with CUDA in the product
// (cuda_device.cpp).

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "custom_allreduce/custom_allreduce.hpp"

namespace tpcomm::coord {

class CustomDevice {
 public:
  virtual ~CustomDevice() = default;
  // This GPU's UUID, the same string in every process that uses it.
  virtual std::string gpuUuid() = 0;
  // Allocates this rank's buffer (laid out for maxBytes); returns its IPC
  // handle bytes. Throws on failure.
  virtual std::string allocate(size_t maxBytes) = 0;
  // The buffer allocate() made.
  virtual void* ownBase() = 0;
  // Whether this GPU can reach the GPU with `uuid`: 'y' (itself included),
  // 'x' no P2P, '?' no GPU visible to this process has that UUID (the write
  // probe decides).
  virtual char peerAccess(const std::string& uuid) = 0;
  // What links this GPU to the GPU with `uuid`: 'n' NVLink, 'p' no NVLink,
  // '?' unknown (the driver's management library is missing).
  virtual char linkTo(const std::string& uuid) = 0;
  // Maps a peer's buffer from its handle. Throws on failure.
  virtual void* open(const std::string& handle) = 0;
  // Writes `value` into probe slot `fromRank` of a peer's buffer, through
  // the peer pointer, and waits until the write is done.
  virtual void writeProbe(void* peer, int fromRank, uint32_t value) = 0;
  // This rank's own probe slots 0..worldSize-1.
  virtual std::vector<uint32_t> readProbes(int worldSize) = 0;
  // The word the kernels write a failure code into: host-mapped memory, as
  // the host reads it and as the device writes it (valid after allocate()).
  virtual uint32_t* errorHost() = 0;
  virtual uint32_t* errorDevice() = 0;
  // The order this rank's launches of the group go through (the product's:
  // car::makeEventLaunchOrder()); its synchronize() is what teardown and the
  // reset wait on.
  virtual std::unique_ptr<car::LaunchOrder> makeLaunchOrder() = 0;
  // Zeroes the signal area of this rank's buffer (flags, poison, epochs);
  // done when it returns.
  virtual void zeroSignals() = 0;

  // Zero-copy (graph_capture()), see custom_path.hpp:
  // A zeroed device table of `slots` entries (ready == 0 everywhere).
  virtual car::RegisteredInputs* allocateTable(size_t slots) = 0;
  virtual void freeTable(car::RegisteredInputs* table) = 0;
  // The IPC handle of the allocation holding `ptr` and ptr's offset in it;
  // throws when the memory cannot be exported.
  virtual car::ExportedPointer exportPointer(const void* ptr) = 0;
  // Maps a peer's captured allocation; stays mapped for the process's life
  // (graphs may replay until then).
  virtual void* openRegistered(const std::string& handle) = 0;
  // Writes entries[i] into table[slots[i]] and waits until it is done.
  virtual void fillTable(car::RegisteredInputs* table, const std::vector<int64_t>& slots,
                         const std::vector<car::RegisteredInputs>& entries) = 0;
};

struct CustomSetupResult {
  bool available = false;
  std::string reason;        // why not, when unavailable
  std::vector<void*> bases;  // every rank's buffer as this process reaches it
  std::vector<int> devices;  // per rank: index of its GPU among the group's GPUs
};

// Every setting that shapes a launch, as (name, value): ranks that disagree
// would launch different kernels (blocks without partners, a result region at
// another offset), so the set-up compares them and refuses the group on every
// rank, naming the setting and the ranks. The maximum size and the kernel's
// protocol are always compared; callers add theirs (blocks, routing).
using LaunchSettings = std::vector<std::pair<std::string, std::string>>;

// `hostId`: this process's host identity (settings' hostIdentity()).
// `skip` non-empty: this rank's settings turn the kernel off (TPCOMM_ROUTE=
// nccl); once the settings are known to agree, the group is refused with it
// before anything is allocated.
CustomSetupResult setUpCustomAllreduce(c10d::Backend& cpu, int rank, int size, CustomDevice& device,
                                       const std::string& hostId, size_t maxBytes,
                                       const LaunchSettings& launch = {},
                                       const std::string& skip = "");

// `value` cut or padded with NULs to `width` bytes (the exchanges' fields),
// and a field back without its padding.
std::string fixedWidth(const std::string& value, size_t width);
std::string trimmed(const std::string& field);

// A set-up step's failure message (never empty), and the first rank's
// non-empty message of an exchange as "rank r: msg" ("" when none): shared
// by the set-up exchanges (this one and the CPU shared-memory path's).
std::string failureOf(const std::exception& e);
std::string firstFailure(const std::vector<std::string>& messages);

// Allgathers `mine` (the same length on every rank) over `cpu` and returns
// every rank's bytes in rank order. Bounded by the backend's timeout.
std::vector<std::string> allgatherBytes(c10d::Backend& cpu, int size, const std::string& mine);

// The CUDA implementation for the current device (cuda_device.cpp).
std::unique_ptr<CustomDevice> makeCudaDevice(int deviceIndex);

}  // namespace tpcomm::coord
