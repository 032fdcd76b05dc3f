#include "coordinator/cuda/custom_path.hpp"

#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "common/error.hpp"
#include "common/settings.hpp"
#include "coordinator/cuda/cuda_util.hpp"
#include "custom_allreduce/cuda_check.hpp"
#include "custom_allreduce/signal.hpp"

namespace tpcomm::coord {

namespace {

bool aligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % car::kPackBytes == 0;
}

}  // namespace

car::DType carDType(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return car::DType::kFloat32;
    case at::kHalf:
      return car::DType::kFloat16;
    case at::kBFloat16:
      return car::DType::kBFloat16;
    default:
      TPCOMM_THROW(kInvalidUsage, "custom allreduce: dtype ", c10::toString(type),
                   " (the kernel sums float32, float16 and bfloat16)");
  }
}

CustomPath::CustomPath(c10d::Backend& cpu, int rank, int size, at::Device device,
                       std::unique_ptr<CustomDevice> gpu, size_t maxBytes,
                       std::chrono::milliseconds timeout, std::string groupName,
                       const LaunchSettings& launch, const std::string& skip)
    : rank_(rank),
      size_(size),
      device_(device),
      maxBytes_(maxBytes),
      groupName_(std::move(groupName)),
      gpu_(std::move(gpu)) {
  RelaxedCaptureMode relaxed;
  CustomSetupResult setup =
      setUpCustomAllreduce(cpu, rank, size, *gpu_, hostIdentity(), maxBytes, launch, skip);
  available_ = setup.available;
  reason_ = setup.reason;
  devices_ = setup.devices;
  if (available_) {
    car_ = std::make_unique<car::CustomAllreduce>(rank, size, setup.bases, maxBytes, timeout,
                                                  gpu_->errorHost(), gpu_->errorDevice(),
                                                  gpu_->makeLaunchOrder());
    car_->configureFor(devices_);
  }
}

CustomPath::CustomPath(std::string reason) : reason_(std::move(reason)) {}

CustomPath::~CustomPath() {
  // Never throws. Graphs that still point at the table are the caller's to
  // destroy first. A kernel still in flight would touch the peers' buffers
  // (unmapped when gpu_ goes) and the table: a sticky illegal-address error.
  if (!gpu_) return;
  // Waits for this rank's launches: eager and replayed (the whole device once
  // a call was captured without external event nodes, whose replays record
  // nothing to wait on).
  car_.reset();
  for (car::RegisteredInputs* table : tables_) gpu_->freeTable(table);
}

void CustomPath::reset(c10d::Backend& cpu) {
  if (!available_) return;  // the same on every rank: nothing to reset
  RelaxedCaptureMode relaxed;
  car::CustomAllreduce::ResetOps ops;
  ops.synchronize = [this] { car_->waitForLaunches(); };
  ops.barrier = [this, &cpu] { allgatherBytes(cpu, size_, "r"); };
  ops.zeroSignals = [this](void*) { gpu_->zeroSignals(); };
  car_->reset(ops);
}

void CustomPath::raiseEarlierFailure(const std::string& what) const {
  TPCOMM_THROW(kPeerLost, "custom allreduce on group '", groupName_, "' (rank ", rank_, " of ",
               size_, "): an earlier call failed: ", what,
               ". This group's CUDA allreduces refuse to run until every rank calls "
               "tpcomm.reset_custom_allreduce(group) (or the group is destroyed; the process "
               "and its other groups are unaffected).");
}

void CustomPath::checkError() const {
  if (!car_) return;
  const uint32_t code = car_->errorCode();
  if (code == 0) return;
  TPCOMM_CHECK(!car::isAbort(code), kPeerLost, "custom allreduce on group '", groupName_,
               "' (rank ", rank_, " of ", size_, "): ", car::describeError(code));
  TPCOMM_THROW(kTimeout, "custom allreduce on group '", groupName_, "' (rank ", rank_, " of ",
               size_, "): ", car::describeError(code), " within ", car_->timeout().count(),
               " ms (the group's timeout, or TPCOMM_CAR_TIMEOUT_MS when set)");
}

void CustomPath::abort() {
  if (!car_) return;
  try {
    const c10::cuda::CUDAGuard guard(device_);
    car_->abort();
  } catch (...) {
    // Best effort (no usable device): the error word is written first.
  }
}

bool CustomPath::launchesPending() const {
  if (!car_ || !car_->launchedOnce()) return false;
  try {
    // The watchdog's thread: on the group's device (not device 0, whose
    // context the query would otherwise create in every rank's process).
    const c10::cuda::CUDAGuard guard(device_);
    return car_->launchesPending();
  } catch (...) {
    return false;
  }
}

void CustomPath::setTimeout(std::chrono::milliseconds timeout) {
  if (car_) car_->setTimeout(timeout);
}

const car::RegisteredInputs* CustomPath::registerCapturedCall(const void* input, const void* output,
                                                              size_t bytes,
                                                              car::Algorithm algorithm,
                                                              bool* stage) {
  TPCOMM_CHECK(available_, kInvalidUsage, "custom allreduce on group '", groupName_,
               "' is not available: ", reason_);
  std::lock_guard<std::mutex> lock(mutex_);
  *stage = true;
  if (slotsUsed_ >= kTableCapacity) {
    ++zeroCopy_.staged;
    zeroCopy_.lastStagedReason =
        detail::concat("the zero-copy table is full (", kTableCapacity, " captured calls)");
    return nullptr;
  }
  if (slotsUsed_ == static_cast<int64_t>(tables_.size()) * kTableChunk) {
    tables_.push_back(gpu_->allocateTable(kTableChunk));
  }
  Captured c{slotsUsed_, true, "", 0, car_->stagingOf(rank_)};
  // Any shared byte counts, not only the same address: overlapping views
  // would let peers read while this rank writes.
  const bool overlappingOneShot =
      algorithm == car::Algorithm::kOneShot && car::rangesOverlap(input, output, bytes);
  if (overlappingOneShot) {
    zeroCopy_.lastStagedReason =
        "a one-shot call whose output overlaps its input (peers would read while it writes)";
  } else {
    try {
      const car::ExportedPointer exported = gpu_->exportPointer(input);
      c.staged = false;
      c.handle = exported.handle;
      c.offset = exported.offset;
      c.own = input;
    } catch (const std::exception& e) {
      zeroCopy_.lastStagedReason = e.what();
    }
  }
  if (c.staged) {
    ++zeroCopy_.staged;
  } else {
    ++zeroCopy_.registered;
  }
  *stage = c.staged;
  captured_.push_back(c);
  const int64_t slot = slotsUsed_++;
  return tables_[slot / kTableChunk] + slot % kTableChunk;
}

car::Algorithm CustomPath::algorithmFor(DeviceRoute route, size_t pushBytes) const {
  if (route == DeviceRoute::kCustomTwoShot) return car::Algorithm::kTwoShot;
  // The one-shot route: a push while it fits (car::pushLimit, under
  // TPCOMM_CAR_PUSH_MAX_BYTES), the same choice on every rank.
  if (car::pushApplies(size_, pushBytes, car_->maxBytes(), settings().carPushMaxBytes)) {
    return car::Algorithm::kPush;
  }
  return car::Algorithm::kOneShot;
}

void CustomPath::allreduce(const at::Tensor& input, const at::Tensor& output, DeviceRoute route,
                           float scale, c10::cuda::CUDAStream stream, bool registering) {
  TPCOMM_CHECK(available_, kInvalidUsage, "custom allreduce on group '", groupName_,
               "' is not available: ", reason_);
  c10::cuda::CUDAStreamGuard guard(stream);
  // The kernel moves 16-byte packs: a tensor that starts elsewhere (a view)
  // goes through an aligned copy; so does an output that overlaps the input
  // at another offset (the kernel's blocks do not wait for each other within
  // a rank). Both are a rank's own business, so this never changes the route.
  const size_t bytes = static_cast<size_t>(input.numel()) * input.element_size();
  const bool partialOverlap = input.data_ptr() != output.data_ptr() &&
                              car::rangesOverlap(input.data_ptr(), output.data_ptr(), bytes);
  if (!aligned(input) || !aligned(output) || partialOverlap) {
    at::Tensor tmp = input.clone(at::MemoryFormat::Contiguous);
    allreduce(tmp, tmp, route, scale, stream, registering);
    output.copy_(tmp);
    return;
  }
  const uint32_t failed = car_->errorCode();
  if (failed != 0) raiseEarlierFailure(car::describeError(failed));
  car::CallOptions options;
  options.chooseAlgorithm = false;
  options.algorithm = algorithmFor(route, (bytes + 15) / 16 * 16);
  options.scale = scale;
  // A push reads this rank's input where it lies and never reads the table,
  // but its captured calls are registered too: graph_capture()'s exit then
  // checks that every rank captured the same calls (a mismatch raises there
  // instead of pairing the wrong replays).
  if (registering && isCapturing(stream.stream())) {
    RelaxedCaptureMode relaxed;
    bool stage = true;
    options.registered =
        registerCapturedCall(input.data_ptr(), output.data_ptr(), bytes, options.algorithm, &stage);
    options.stageInput = stage;
  }
  car_->allreduce(input.data_ptr(), output.data_ptr(), static_cast<size_t>(input.numel()),
                  carDType(input.scalar_type()), stream.stream(), options);
}

void CustomPath::allreduceAddRmsNorm(const at::Tensor& input, const at::Tensor& residual,
                                     const at::Tensor& weight, double eps, const at::Tensor& normed,
                                     const at::Tensor& residualOut, DeviceRoute route,
                                     c10::cuda::CUDAStream stream) {
  TPCOMM_CHECK(available_, kInvalidUsage, "custom allreduce on group '", groupName_,
               "' is not available: ", reason_);
  const size_t bytes = static_cast<size_t>(input.numel()) * input.element_size();
  auto apart = [bytes](const at::Tensor& a, const at::Tensor& b) {
    return a.data_ptr() == b.data_ptr() || !car::rangesOverlap(a.data_ptr(), b.data_ptr(), bytes);
  };
  const bool takes = aligned(input) && aligned(normed) && aligned(residualOut) &&
                     apart(input, normed) && apart(input, residualOut) &&
                     apart(residual, residualOut) &&
                     !car::rangesOverlap(normed.data_ptr(), residual.data_ptr(), bytes) &&
                     !car::rangesOverlap(normed.data_ptr(), residualOut.data_ptr(), bytes);
  c10::cuda::CUDAStreamGuard guard(stream);
  if (!takes) {
    // A rank's own business, so it never changes the route (as allreduce).
    at::Tensor in = input.clone(at::MemoryFormat::Contiguous);
    at::Tensor res = residual.clone(at::MemoryFormat::Contiguous);
    at::Tensor out = at::empty_like(in);
    allreduceAddRmsNorm(in, res, weight, eps, out, res, route, stream);
    normed.copy_(out);
    residualOut.copy_(res);
    return;
  }
  const uint32_t failed = car_->errorCode();
  if (failed != 0) raiseEarlierFailure(car::describeError(failed));
  car::CallOptions options;
  options.chooseAlgorithm = false;
  // A push carries each row as whole packs.
  const size_t rowBytes = static_cast<size_t>(weight.numel()) * input.element_size();
  const size_t rows = rowBytes == 0 ? 0 : bytes / rowBytes;
  options.algorithm = algorithmFor(route, rows * ((rowBytes + 15) / 16 * 16));
  car::CustomAllreduce::AddRmsNorm norm;
  norm.residual = residual.data_ptr();
  norm.residualOut = residualOut.data_ptr();
  norm.weight = weight.data_ptr();
  norm.normed = normed.data_ptr();
  norm.hidden = static_cast<size_t>(weight.numel());
  norm.rows = norm.hidden == 0 ? 0 : static_cast<size_t>(input.numel()) / norm.hidden;
  norm.eps = static_cast<float>(eps);
  car_->allreduceAddRmsNorm(input.data_ptr(), norm, carDType(input.scalar_type()), stream.stream(),
                            options);
}

void CustomPath::finishGraphRegistration(c10d::Backend& cpu) {
  if (!available_) return;  // the same on every rank: nothing was registered
  RelaxedCaptureMode relaxed;
  std::vector<Captured> captured;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    captured.swap(captured_);
  }
  // Round 1: the same number of captured calls everywhere.
  std::vector<std::string> counts;
  for (const auto& c :
       allgatherBytes(cpu, size_, fixedWidth(std::to_string(captured.size()), 24))) {
    counts.push_back(trimmed(c));
  }
  for (int r = 1; r < size_; ++r) {
    if (counts[r] != counts[0]) {
      std::string all;
      for (int q = 0; q < size_; ++q)
        all += detail::concat(q ? ", " : "", "rank ", q, ": ", counts[q]);
      TPCOMM_THROW(kInvalidUsage, "graph_capture() on group '", groupName_,
                   "': ranks captured different numbers of custom allreduces (", all,
                   "); every rank must capture the same calls. The graphs captured in this "
                   "context refuse to replay.");
    }
  }
  if (captured.empty()) return;
  // Round 2: every call's handle and offset (or "staged").
  constexpr size_t kHandle = 64, kRecord = 1 + kHandle + 8;
  std::string mine;
  for (const auto& c : captured) {
    std::string record(kRecord, '\0');
    record[0] = c.staged ? 's' : 'r';
    std::memcpy(&record[1], c.handle.data(), std::min(c.handle.size(), kHandle));
    std::memcpy(&record[1 + kHandle], &c.offset, sizeof(c.offset));
    mine += record;
  }
  const std::vector<std::string> every = allgatherBytes(cpu, size_, mine);
  std::vector<car::RegisteredInputs> host(captured.size());
  std::string failure;
  try {
    for (size_t i = 0; i < captured.size(); ++i) {
      car::RegisteredInputs& entry = host[i];
      std::memset(&entry, 0, sizeof(entry));
      for (int r = 0; r < size_; ++r) {
        const std::string record = every[r].substr(i * kRecord, kRecord);
        if (r == rank_) {
          entry.input[r] = captured[i].own;
        } else if (record[0] == 's') {
          entry.input[r] = car_->stagingOf(r);
        } else {
          uint64_t offset = 0;
          std::memcpy(&offset, &record[1 + kHandle], sizeof(offset));
          entry.input[r] =
              static_cast<const char*>(gpu_->openRegistered(record.substr(1, kHandle))) + offset;
        }
      }
      entry.ready = 1;
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  // Round 3: every rank mapped every peer's inputs, or no table is filled.
  const std::vector<std::string> statuses = allgatherBytes(cpu, size_, fixedWidth(failure, 384));
  for (int r = 0; r < size_; ++r) {
    const std::string text = trimmed(statuses[r]);
    TPCOMM_CHECK(text.empty(), kCuda, "graph_capture() on group '", groupName_, "': rank ", r,
                 " could not map its peers' captured inputs (", text,
                 "); the graphs captured in this context refuse to replay");
  }
  // Each chunk of the table with its own entries (slot numbers within it).
  std::map<int64_t, std::pair<std::vector<int64_t>, std::vector<car::RegisteredInputs>>> chunks;
  for (size_t i = 0; i < captured.size(); ++i) {
    auto& chunk = chunks[captured[i].slot / kTableChunk];
    chunk.first.push_back(captured[i].slot % kTableChunk);
    chunk.second.push_back(host[i]);
  }
  for (const auto& [index, chunk] : chunks) {
    gpu_->fillTable(tables_.at(index), chunk.first, chunk.second);
  }
}

bool CustomPath::distinctGpus() const { return !devices_.empty() && !car::sharesAGpu(devices_); }

ZeroCopyStats CustomPath::zeroCopyStats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ZeroCopyStats out = zeroCopy_;
  out.tableSlots = slotsUsed_;
  out.tableCapacity = kTableCapacity;
  out.tableFull = slotsUsed_ >= kTableCapacity;
  return out;
}

}  // namespace tpcomm::coord
