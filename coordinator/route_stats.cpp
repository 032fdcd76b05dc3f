#include "coordinator/route_stats.hpp"

namespace tpcomm::coord {

const char* statsRouteName(StatsRoute route) {
  switch (route) {
    case StatsRoute::kGloo:
      return "gloo";
    case StatsRoute::kCpuShm:
      return "cpu_shm";
    case StatsRoute::kCpuHier:
      return "cpu_hier";
    case StatsRoute::kCustomOneShot:
      return "custom_oneshot";
    case StatsRoute::kCustomTwoShot:
      return "custom_twoshot";
    case StatsRoute::kNccl:
      return "nccl";
  }
  return "unknown";
}

std::vector<RouteCount> RouteStats::snapshot() const {
  std::vector<RouteCount> out;
  out.reserve(kNumStatsRoutes);
  for (int i = 0; i < kNumStatsRoutes; ++i) {
    RouteCount row;
    row.route = statsRouteName(static_cast<StatsRoute>(i));
    row.calls = counters_[i].calls.load(std::memory_order_relaxed);
    row.bytes = counters_[i].bytes.load(std::memory_order_relaxed);
    out.push_back(row);
  }
  return out;
}

void RouteStats::reset() {
  for (auto& c : counters_) {
    c.calls.store(0, std::memory_order_relaxed);
    c.bytes.store(0, std::memory_order_relaxed);
  }
}

uint64_t bytesOf(const at::Tensor& tensor) {
  return tensor.defined() ? static_cast<uint64_t>(tensor.numel()) * tensor.element_size() : 0;
}

uint64_t bytesOf(const std::vector<at::Tensor>& tensors) {
  uint64_t total = 0;
  for (const auto& t : tensors) total += bytesOf(t);
  return total;
}

uint64_t bytesOf(const std::vector<std::vector<at::Tensor>>& lists) {
  uint64_t total = 0;
  for (const auto& list : lists) total += bytesOf(list);
  return total;
}

}  // namespace tpcomm::coord
