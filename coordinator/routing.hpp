#pragma once
// Where a CUDA allreduce goes: the custom kernel (one-shot or two-shot) or
// NCCL, decided per call from the op, dtype and size against a table that
// depends on the world size (defaults: one-shot up to the custom maximum at
// 2 ranks, up to 512 KiB at 3-4 and 256 KiB at 5-8; two-shot above, up to
// the custom maximum; NCCL beyond, for ops other than SUM/AVG, for other
// dtypes and whenever the group cannot use the kernel).
//
// The decision depends only on values every rank shares (op, dtype, size,
// group-wide availability), never on a rank's pointers, so every rank of a
// group takes the same route for the same call.

#include <mutex>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

namespace tpcomm::coord {

enum class DeviceRoute { kNccl, kCustomOneShot, kCustomTwoShot };
const char* deviceRouteName(DeviceRoute route);

struct RoutingConfig {
  std::string mode = "auto";         // TPCOMM_ROUTE: auto, nccl, oneshot, twoshot
  int64_t oneShotMaxBytes = -1;      // TPCOMM_ONESHOT_MAX_BYTES; -1: by world size
  int64_t customMaxBytes = 8 << 20;  // TPCOMM_CAR_MAX_BYTES
  static RoutingConfig fromSettings();
};

struct RouteDecision {
  DeviceRoute route = DeviceRoute::kNccl;
  std::string reason;  // why, in a few words
};

// One row of the table in force: sizes in [fromBytes, toBytes] go to route.
struct RouteRow {
  DeviceRoute route;
  int64_t fromBytes;
  int64_t toBytes;  // -1: unbounded
};

class RoutingTable {
 public:
  RoutingTable(int worldSize, RoutingConfig config);

  // Group-wide: whether the custom kernel can be used at all, and why not.
  void setCustomAvailability(bool available, std::string reason);
  bool customAvailable() const { return customAvailable_; }
  const std::string& customReason() const { return customReason_; }
  int64_t oneShotMaxBytes() const { return oneShotMax_; }
  // Sizes above this go to NCCL (the custom maximum unless tuned).
  int64_t customLimitBytes() const { return customLimit_; }
  // TPCOMM_AUTOTUNE's crossovers (capped by the configured maximum); `source`
  // says where they came from, for describe().
  void applyTuned(int64_t oneShotMaxBytes, int64_t customMaxBytes, std::string source);
  const std::string& tuneSource() const { return tuneSource_; }
  // Replaces TPCOMM_ROUTE for this table (auto, nccl, oneshot, twoshot).
  void setMode(const std::string& mode);
  const RoutingConfig& config() const { return config_; }

  // `withReason` false leaves RouteDecision::reason empty (the per-call path).
  RouteDecision decide(c10d::ReduceOp::RedOpType op, at::ScalarType dtype, int64_t bytes,
                       bool withReason = true) const;
  // The size ranges of each route for a SUM of an eligible dtype.
  std::vector<RouteRow> rows() const;

 private:
  int worldSize_;
  RoutingConfig config_;
  int64_t oneShotMax_;
  int64_t customLimit_;
  std::string tuneSource_ = "off";
  bool customAvailable_ = false;
  std::string customReason_ = "not set up";
};

// TPCOMM_LOG=routes: each distinct decision is written to stderr once per
// group ("tpcomm route: group 'tp:0' allreduce float32 4096 B -> custom_oneshot (...)").
class RouteLog {
 public:
  explicit RouteLog(bool enabled) : enabled_(enabled) {}
  // Returns whether the line was new (and, when enabled, written).
  bool once(const std::string& key, const std::string& line);

 private:
  bool enabled_;
  std::mutex mutex_;
  std::set<std::string> seen_;
};

}  // namespace tpcomm::coord
