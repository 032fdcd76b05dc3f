// TPCOMM_AUTOTUNE: the GroupCoordinator's measurement of the CUDA allreduce
// crossovers (see autotune.hpp for the policy and the cache).
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>

#include "coordinator/cuda/autotune.hpp"
#include "common/error.hpp"
#include "common/settings.hpp"
#include "coordinator/cuda/cuda_util.hpp"
#include "coordinator/group_coordinator.hpp"
#include "custom_allreduce/cuda_check.hpp"

namespace tpcomm::coord {

namespace {

constexpr int kWarmUp = 3;
constexpr int kIters = 10;

// Microseconds per call of `call`, on `stream` (every call is a collective:
// every rank runs the same sequence).
template <typename Call>
double timeUs(c10::cuda::CUDAStream stream, Call&& call) {
  for (int i = 0; i < kWarmUp; ++i) call();
  at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
  start.record(stream);
  for (int i = 0; i < kIters; ++i) call();
  stop.record(stream);
  stop.synchronize();
  return static_cast<double>(start.elapsed_time(stop)) * 1000.0 / kIters;
}

std::string packDoubles(const std::vector<double>& values) {
  std::string out(values.size() * sizeof(double), '\0');
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

std::vector<double> unpackDoubles(const std::string& bytes) {
  std::vector<double> out(bytes.size() / sizeof(double));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(double));
  return out;
}

}  // namespace

void GroupCoordinator::tuneRouting(CustomPath& custom) {
  const int64_t maxBytes = routing_.config().customMaxBytes;
  const at::Device device = custom.device();
  cudaDeviceProp prop;
  TPCOMM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device.index()));
  const std::string path =
      autotunePath(autotuneKey(hostName(), prop.name, options_.size, maxBytes));

  // Rank 0's cache decides for every rank, so the table is the same on all.
  std::string mine(32, '\0');
  if (options_.rank == 0) {
    if (auto cached = readTuned(path, maxBytes)) {
      std::memcpy(mine.data(), &cached->oneShotMaxBytes, sizeof(int64_t));
      std::memcpy(mine.data() + 8, &cached->customMaxBytes, sizeof(int64_t));
      mine[16] = 1;
    }
  }
  const std::string fromRank0 = allgatherBytes(*cpu_, options_.size, mine)[0];
  if (fromRank0[16] == 1) {
    TunedRoutes cached;
    std::memcpy(&cached.oneShotMaxBytes, fromRank0.data(), sizeof(int64_t));
    std::memcpy(&cached.customMaxBytes, fromRank0.data() + 8, sizeof(int64_t));
    routing_.applyTuned(cached.oneShotMaxBytes, cached.customMaxBytes, "cache " + path);
    return;
  }

  c10::cuda::CUDAGuard guard(device);
  const auto stream = c10::cuda::getCurrentCUDAStream(device.index());
  if (isCapturing(stream.stream())) {
    // Kernels launched now would be captured, not run: keep the defaults.
    routing_.applyTuned(routing_.oneShotMaxBytes(), maxBytes,
                        "skipped: the group's first CUDA allreduce was inside a graph capture");
    return;
  }
  RouteTimings t;
  for (int64_t size = 4096; size <= maxBytes; size *= 2) t.sizes.push_back(size);
  at::Tensor buffer =
      at::zeros({maxBytes / 2}, at::TensorOptions().dtype(at::kHalf).device(device));
  const bool withNccl = custom.distinctGpus();
  for (int64_t size : t.sizes) {
    at::Tensor x = buffer.narrow(0, 0, size / 2);
    for (DeviceRoute route : {DeviceRoute::kCustomOneShot, DeviceRoute::kCustomTwoShot}) {
      const double us = timeUs(
          stream, [&] { custom.allreduce(x, x, route, 1.f, stream, /*registering=*/false); });
      (route == DeviceRoute::kCustomOneShot ? t.oneShotUs : t.twoShotUs).push_back(us);
    }
    if (withNccl) {
      t.ncclUs.push_back(timeUs(stream, [&] {
        std::vector<at::Tensor> tensors{x};
        deviceBackend().allreduce(tensors)->wait();
      }));
    }
  }
  custom.checkError();
  // The slowest rank's time counts.
  std::vector<double> all = t.oneShotUs;
  all.insert(all.end(), t.twoShotUs.begin(), t.twoShotUs.end());
  all.insert(all.end(), t.ncclUs.begin(), t.ncclUs.end());
  for (const std::string& other : allgatherBytes(*cpu_, options_.size, packDoubles(all))) {
    const std::vector<double> theirs = unpackDoubles(other);
    for (size_t i = 0; i < all.size(); ++i) all[i] = std::max(all[i], theirs.at(i));
  }
  const size_t k = t.sizes.size();
  t.oneShotUs.assign(all.begin(), all.begin() + k);
  t.twoShotUs.assign(all.begin() + k, all.begin() + 2 * k);
  if (withNccl) t.ncclUs.assign(all.begin() + 2 * k, all.end());
  const TunedRoutes tuned = chooseCrossovers(t, maxBytes);
  std::string source = "measured";
  if (options_.rank == 0) {
    const std::string error = writeTuned(path, formatTuned(tuned, t));
    source += error.empty() ? ", cached at " + path : " (not cached: " + error + ")";
  }
  if (!withNccl) source += "; NCCL not measured (ranks share a GPU)";
  routing_.applyTuned(tuned.oneShotMaxBytes, tuned.customMaxBytes, source);
}

}  // namespace tpcomm::coord
