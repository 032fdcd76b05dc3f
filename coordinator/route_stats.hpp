#pragma once
// Per-route counters of one group: how many calls each route carried and how
// many bytes they sent. One counter pair per route, relaxed atomics (a
// snapshot is a consistent count per counter, not across counters).
//
// Bytes are the call's input bytes on this rank: the tensor for allreduce and
// broadcast, the input of a gather or all-to-all, the input list of a
// reduce-scatter. Barriers count as calls of 0 bytes.

#include <array>
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace tpcomm::coord {

// Where a call went. The custom-kernel routes are counted once the routing
// sends calls there.
enum class StatsRoute { kGloo, kCpuShm, kCpuHier, kCustomOneShot, kCustomTwoShot, kNccl };
inline constexpr int kNumStatsRoutes = 6;
const char* statsRouteName(StatsRoute route);

struct RouteCount {
  std::string route;
  uint64_t calls = 0;
  uint64_t bytes = 0;
};

class RouteStats {
 public:
  void record(StatsRoute route, uint64_t bytes) {
    lastRoute() = route;
    auto& c = counters_[static_cast<int>(route)];
    c.calls.fetch_add(1, std::memory_order_relaxed);
    c.bytes.fetch_add(bytes, std::memory_order_relaxed);
  }
  // The route of the last call this thread recorded (any group), for the
  // flight recorder's entry of the call; reset before a call.
  static std::optional<StatsRoute>& lastRoute() {
    static thread_local std::optional<StatsRoute> route;
    return route;
  }
  // Every route in enum order, zero counts included.
  std::vector<RouteCount> snapshot() const;
  void reset();

 private:
  struct Counter {
    std::atomic<uint64_t> calls{0};
    std::atomic<uint64_t> bytes{0};
  };
  std::array<Counter, kNumStatsRoutes> counters_;
};

uint64_t bytesOf(const at::Tensor& tensor);
uint64_t bytesOf(const std::vector<at::Tensor>& tensors);
uint64_t bytesOf(const std::vector<std::vector<at::Tensor>>& lists);

}  // namespace tpcomm::coord
