// The CUDA allreduce routing table: decisions by op, dtype, size and world
// size, the overrides, the table describe() shows, and TPCOMM_LOG=routes.
#include <gtest/gtest.h>

#include <map>

#include "common/error.hpp"
#include "common/settings.hpp"
#include "coordinator/routing.hpp"

namespace tpcomm::coord {
namespace {

RoutingTable available(int worldSize, RoutingConfig config = {}) {
  RoutingTable t(worldSize, config);
  t.setCustomAvailability(true, "");
  return t;
}

DeviceRoute routeOf(const RoutingTable& t, int64_t bytes,
                    c10d::ReduceOp::RedOpType op = c10d::ReduceOp::SUM,
                    at::ScalarType dtype = at::kFloat) {
  return t.decide(op, dtype, bytes).route;
}

TEST(Routing, DefaultTableByWorldSize) {
  const int64_t max = 8 << 20;
  EXPECT_EQ(routeOf(available(2), 16), DeviceRoute::kCustomOneShot);
  // Untuned, one-shot stops near 1 MiB at 2 ranks too.
  EXPECT_EQ(routeOf(available(2), 1 << 20), DeviceRoute::kCustomOneShot);
  EXPECT_EQ(routeOf(available(2), (1 << 20) + 2), DeviceRoute::kCustomTwoShot);
  EXPECT_EQ(routeOf(available(2), max), DeviceRoute::kCustomTwoShot);
  EXPECT_EQ(routeOf(available(2), max + 2), DeviceRoute::kNccl);
  for (int n : {3, 4}) {
    EXPECT_EQ(routeOf(available(n), 512 << 10), DeviceRoute::kCustomOneShot) << n;
    EXPECT_EQ(routeOf(available(n), (512 << 10) + 2), DeviceRoute::kCustomTwoShot) << n;
    EXPECT_EQ(routeOf(available(n), max), DeviceRoute::kCustomTwoShot) << n;
  }
  for (int n : {5, 8}) {
    EXPECT_EQ(routeOf(available(n), 256 << 10), DeviceRoute::kCustomOneShot) << n;
    EXPECT_EQ(routeOf(available(n), (256 << 10) + 2), DeviceRoute::kCustomTwoShot) << n;
    EXPECT_EQ(routeOf(available(n), max + 2), DeviceRoute::kNccl) << n;
  }
  const RouteDecision d = available(4).decide(c10d::ReduceOp::SUM, at::kHalf, 4096);
  EXPECT_EQ(d.reason, "<= 524288 B at 4 ranks");
}

TEST(Routing, WhatTheKernelCannotTakeGoesToNccl) {
  const RoutingTable t = available(4);
  EXPECT_EQ(routeOf(t, 64, c10d::ReduceOp::AVG), DeviceRoute::kCustomOneShot);
  RouteDecision d = t.decide(c10d::ReduceOp::MAX, at::kFloat, 64);
  EXPECT_EQ(d.route, DeviceRoute::kNccl);
  EXPECT_EQ(d.reason, "the custom kernel only sums");
  d = t.decide(c10d::ReduceOp::SUM, at::kLong, 64);
  EXPECT_EQ(d.route, DeviceRoute::kNccl);
  EXPECT_EQ(d.reason, "dtype int64 is not summed by the kernel");
  // An empty tensor needs no communication: the custom route launches
  // nothing (and makes no NCCL communicator, which ranks sharing a GPU lack).
  d = t.decide(c10d::ReduceOp::SUM, at::kFloat, 0);
  EXPECT_EQ(d.route, DeviceRoute::kCustomOneShot);
  EXPECT_EQ(d.reason, "empty tensor (nothing is launched)");
  EXPECT_EQ(routeOf(available(1), 64), DeviceRoute::kNccl);
  RoutingTable off(4, {});
  off.setCustomAvailability(false, "ranks 0 and 2 are on different hosts");
  d = off.decide(c10d::ReduceOp::SUM, at::kFloat, 64);
  EXPECT_EQ(d.route, DeviceRoute::kNccl);
  EXPECT_EQ(d.reason, "custom kernel unavailable: ranks 0 and 2 are on different hosts");
}

TEST(Routing, OverridesFromSettings) {
  RoutingConfig c;
  c.mode = "nccl";
  EXPECT_EQ(available(2, c).decide(c10d::ReduceOp::SUM, at::kFloat, 64).reason,
            "TPCOMM_ROUTE=nccl");
  c.mode = "twoshot";
  EXPECT_EQ(routeOf(available(2, c), 64), DeviceRoute::kCustomTwoShot);
  c.mode = "auto";
  c.oneShotMaxBytes = 1024;
  EXPECT_EQ(routeOf(available(2, c), 1024), DeviceRoute::kCustomOneShot);
  EXPECT_EQ(routeOf(available(2, c), 1040), DeviceRoute::kCustomTwoShot);
  c.oneShotMaxBytes = -1;
  c.customMaxBytes = 4096;
  EXPECT_EQ(routeOf(available(8, c), 4096), DeviceRoute::kCustomOneShot);
  EXPECT_EQ(routeOf(available(8, c), 4112), DeviceRoute::kNccl);
  c.mode = "ring";
  try {
    RoutingTable bad(2, c);
    FAIL() << "accepted mode 'ring'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'ring' is not one of auto, nccl"), std::string::npos);
  }
}

TEST(Routing, RowsDescribeTheTableInForce) {
  const auto rows = available(4).rows();
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].route, DeviceRoute::kCustomOneShot);
  EXPECT_EQ(rows[0].toBytes, 512 << 10);
  EXPECT_EQ(rows[1].route, DeviceRoute::kCustomTwoShot);
  EXPECT_EQ(rows[1].fromBytes, (512 << 10) + 1);
  EXPECT_EQ(rows[2].route, DeviceRoute::kNccl);
  EXPECT_EQ(rows[2].toBytes, -1);
  EXPECT_EQ(available(2).rows().size(), 3u);  // one-shot to 1 MiB, two-shot, NCCL
  RoutingTable off(4, {});
  ASSERT_EQ(off.rows().size(), 1u);
  EXPECT_EQ(off.rows()[0].route, DeviceRoute::kNccl);
}

TEST(Routing, LogWritesEachDecisionOnce) {
  RouteLog log(false);
  EXPECT_TRUE(log.once("a", "line a"));
  EXPECT_FALSE(log.once("a", "line a"));
  EXPECT_TRUE(log.once("b", "line b"));
}

TEST(Routing, SettingsParseRouteAndLog) {
  const auto env = [](std::map<std::string, std::string> m) {
    return [m](const std::string& k) -> std::optional<std::string> {
      auto it = m.find(k);
      return it == m.end() ? std::nullopt : std::optional<std::string>(it->second);
    };
  };
  Settings s = Settings::parse(env({{"TPCOMM_ROUTE", "oneshot"},
                                    {"TPCOMM_ONESHOT_MAX_BYTES", "4096"},
                                    {"TPCOMM_LOG", "routes"}}));
  EXPECT_EQ(s.route, "oneshot");
  EXPECT_EQ(s.oneShotMaxBytes, 4096);
  EXPECT_TRUE(s.logRoutes);
  EXPECT_FALSE(Settings::parse(env({})).logRoutes);
  for (auto [name, value] :
       std::vector<std::pair<std::string, std::string>>{{"TPCOMM_ROUTE", "fast"},
                                                        {"TPCOMM_LOG", "routes,sizes"},
                                                        {"TPCOMM_ONESHOT_MAX_BYTES", "-2"}}) {
    try {
      Settings::parse(env({{name, value}}));
      ADD_FAILURE() << name << "=" << value << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace tpcomm::coord
