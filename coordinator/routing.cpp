#include "coordinator/routing.hpp"

#include <algorithm>
#include <cstdio>

#include "common/error.hpp"
#include "common/settings.hpp"
#include "coordinator/debug/debug_check.hpp"
#include "custom_allreduce/custom_allreduce.hpp"

namespace tpcomm::coord {

const char* deviceRouteName(DeviceRoute route) {
  switch (route) {
    case DeviceRoute::kNccl:
      return "nccl";
    case DeviceRoute::kCustomOneShot:
      return "custom_oneshot";
    case DeviceRoute::kCustomTwoShot:
      return "custom_twoshot";
  }
  return "unknown";
}

RoutingConfig RoutingConfig::fromSettings() {
  RoutingConfig c;
  c.mode = settings().route;
  c.oneShotMaxBytes = settings().oneShotMaxBytes;
  c.customMaxBytes = settings().carMaxBytes;
  return c;
}

RoutingTable::RoutingTable(int worldSize, RoutingConfig config)
    : worldSize_(worldSize), config_(std::move(config)) {
  TPCOMM_CHECK(config_.mode == "auto" || config_.mode == "nccl" || config_.mode == "oneshot" ||
                   config_.mode == "twoshot",
               kInvalidUsage, "routing mode '", config_.mode,
               "' is not one of auto, nccl, oneshot, twoshot");
  const int64_t byWorld =
      static_cast<int64_t>(car::oneShotLimit(worldSize_, config_.customMaxBytes));
  oneShotMax_ = config_.oneShotMaxBytes >= 0
                    ? std::min<int64_t>(config_.oneShotMaxBytes, config_.customMaxBytes)
                    : byWorld;
  customLimit_ = config_.customMaxBytes;
  if (settings().autotune) tuneSource_ = "pending (at the custom kernel's set-up)";
}

void RoutingTable::setMode(const std::string& mode) {
  TPCOMM_CHECK(mode == "auto" || mode == "nccl" || mode == "oneshot" || mode == "twoshot",
               kInvalidUsage, "routing mode '", mode,
               "' is not one of auto, nccl, oneshot, twoshot");
  config_.mode = mode;
}

void RoutingTable::applyTuned(int64_t oneShotMaxBytes, int64_t customMaxBytes, std::string source) {
  customLimit_ = std::clamp<int64_t>(customMaxBytes, 0, config_.customMaxBytes);
  // An explicit TPCOMM_ONESHOT_MAX_BYTES wins over the measurement.
  if (config_.oneShotMaxBytes < 0)
    oneShotMax_ = std::clamp<int64_t>(oneShotMaxBytes, 0, customLimit_);
  tuneSource_ = std::move(source);
}

void RoutingTable::setCustomAvailability(bool available, std::string reason) {
  customAvailable_ = available;
  customReason_ = available ? "" : std::move(reason);
}

RouteDecision RoutingTable::decide(c10d::ReduceOp::RedOpType op, at::ScalarType dtype,
                                   int64_t bytes, bool withReason) const {
  RouteDecision d;
  // The reason is only put together when asked for (the log, tests): the
  // per-call path takes the route alone.
  const auto why = [&](const auto&... parts) {
    if (withReason) d.reason = detail::concat(parts...);
  };
  if (config_.mode == "nccl") {
    why("TPCOMM_ROUTE=nccl");
  } else if (op != c10d::ReduceOp::SUM && op != c10d::ReduceOp::AVG) {
    why("the custom kernel only sums");
  } else if (dtype != at::kFloat && dtype != at::kHalf && dtype != at::kBFloat16) {
    why("dtype ", dtypeName(dtype), " is not summed by the kernel");
  } else if (worldSize_ < 2) {
    why("one rank");
  } else if (!customAvailable_) {
    why("custom kernel unavailable: ", customReason_);
  } else if (bytes == 0) {
    // Nothing to reduce: no kernel is launched, and no NCCL communicator is
    // made for it.
    d.route = DeviceRoute::kCustomOneShot;
    why("empty tensor (nothing is launched)");
  } else if (bytes > config_.customMaxBytes) {
    why("above the custom maximum of ", config_.customMaxBytes, " B");
  } else if (bytes > customLimit_ && config_.mode == "auto") {
    why("above the tuned custom limit of ", customLimit_, " B");
  } else if (config_.mode == "oneshot" || config_.mode == "twoshot") {
    d.route = config_.mode == "oneshot" ? DeviceRoute::kCustomOneShot : DeviceRoute::kCustomTwoShot;
    why("TPCOMM_ROUTE=", config_.mode);
  } else if (bytes <= oneShotMax_) {
    d.route = DeviceRoute::kCustomOneShot;
    why("<= ", oneShotMax_, " B at ", worldSize_, " ranks");
  } else {
    d.route = DeviceRoute::kCustomTwoShot;
    why("> ", oneShotMax_, " B at ", worldSize_, " ranks");
  }
  return d;
}

std::vector<RouteRow> RoutingTable::rows() const {
  if (config_.mode == "nccl" || !customAvailable_ || worldSize_ < 2) {
    return {{DeviceRoute::kNccl, 0, -1}};
  }
  const int64_t max = config_.mode == "auto" ? customLimit_ : config_.customMaxBytes;
  if (max < 1) return {{DeviceRoute::kNccl, 0, -1}};
  if (config_.mode == "oneshot")
    return {{DeviceRoute::kCustomOneShot, 1, max}, {DeviceRoute::kNccl, max + 1, -1}};
  if (config_.mode == "twoshot")
    return {{DeviceRoute::kCustomTwoShot, 1, max}, {DeviceRoute::kNccl, max + 1, -1}};
  std::vector<RouteRow> rows;
  const int64_t oneShot = std::min(oneShotMax_, max);
  if (oneShot >= 1) rows.push_back({DeviceRoute::kCustomOneShot, 1, oneShot});
  if (oneShot < max) rows.push_back({DeviceRoute::kCustomTwoShot, oneShot + 1, max});
  rows.push_back({DeviceRoute::kNccl, max + 1, -1});
  return rows;
}

bool RouteLog::once(const std::string& key, const std::string& line) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!seen_.insert(key).second) return false;
  if (enabled_) std::fprintf(stderr, "%s\n", line.c_str());
  return true;
}

}  // namespace tpcomm::coord
