// TPCOMM_AUTOTUNE's GPU-free parts: crossovers from timings, the cache file,
// and the routing table they produce.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "coordinator/cuda/autotune.hpp"
#include "coordinator/routing.hpp"

namespace tpcomm::coord {
namespace {

RouteTimings timings(std::vector<double> one, std::vector<double> two, std::vector<double> nccl) {
  RouteTimings t;
  for (size_t i = 0; i < one.size(); ++i) t.sizes.push_back(int64_t{4096} << i);
  t.oneShotUs = std::move(one);
  t.twoShotUs = std::move(two);
  t.ncclUs = std::move(nccl);
  return t;
}

TEST(Autotune, CrossoversAreTheLastSizesBeforeTheNextRouteWins) {
  // 4K 8K 16K 32K 64K: two-shot wins from 32K, NCCL from 64K.
  const RouteTimings t = timings({5, 5, 6, 9, 14}, {7, 7, 7, 7, 10}, {20, 20, 20, 20, 8});
  const TunedRoutes r = chooseCrossovers(t, 1 << 20);
  EXPECT_EQ(r.oneShotMaxBytes, 16384);
  EXPECT_EQ(r.customMaxBytes, 32768);
}

TEST(Autotune, NoiseWithinTheMarginKeepsTheCurrentRoute) {
  // Two-shot 1% faster at 8K: not enough to switch.
  const RouteTimings t = timings({5, 5.05, 5}, {6, 5.0, 6}, {});
  const TunedRoutes r = chooseCrossovers(t, 16384);
  EXPECT_EQ(r.oneShotMaxBytes, 16384);
  EXPECT_EQ(r.customMaxBytes, 16384);  // NCCL not measured: the custom maximum
}

TEST(Autotune, NcclFasterEverywhereMeansNoCustomSizes) {
  const RouteTimings t = timings({5, 6}, {7, 7}, {1, 1});
  const TunedRoutes r = chooseCrossovers(t, 8192);
  EXPECT_EQ(r.customMaxBytes, 0);
  EXPECT_EQ(r.oneShotMaxBytes, 0);
}

TEST(Autotune, CacheFileRoundTripsAndRejectsWhatItDidNotWrite) {
  const RouteTimings t = timings({5, 6}, {7, 4}, {9, 9});
  const TunedRoutes r = chooseCrossovers(t, 8192);
  const std::string text = formatTuned(r, t);
  EXPECT_NE(text.find("\n# 8192 6 4 9\n"), std::string::npos) << text;
  auto parsed = parseTuned(text, 8192);
  ASSERT_TRUE(parsed.has_value());
  EXPECT_EQ(parsed->oneShotMaxBytes, r.oneShotMaxBytes);
  EXPECT_EQ(parsed->customMaxBytes, r.customMaxBytes);
  EXPECT_FALSE(parseTuned("oneshot_max_bytes=4096\n", 8192));  // a key missing
  EXPECT_FALSE(parseTuned("oneshot_max_bytes=4096\ncustom_max_bytes=x\n", 8192));
  EXPECT_FALSE(parseTuned("oneshot_max_bytes=4096\ncustom_max_bytes=99999\n", 8192));  // > max
  EXPECT_FALSE(parseTuned("oneshot_max_bytes=8192\ncustom_max_bytes=4096\n", 8192));
  EXPECT_FALSE(parseTuned("oneshot_max_bytes=1\ncustom_max_bytes=2\nblocks=3\n", 8192));
}

TEST(Autotune, WriteCreatesTheDirectoryAndReadFindsIt) {
  const std::string dir = "/tmp/tpcomm-autotune-test-" + std::to_string(::getpid());
  const std::string path =
      dir + "/a/b/" + autotuneKey("node 1", "NVIDIA H100 80GB HBM3", 4, 8 << 20) + ".txt";
  EXPECT_NE(path.find("node_1-NVIDIA_H100_80GB_HBM3-ws4-max8388608.txt"), std::string::npos);
  EXPECT_FALSE(readTuned(path, 8 << 20));
  EXPECT_EQ(writeTuned(path, "oneshot_max_bytes=65536\ncustom_max_bytes=4194304\n"), "");
  auto read = readTuned(path, 8 << 20);
  ASSERT_TRUE(read.has_value());
  EXPECT_EQ(read->oneShotMaxBytes, 65536);
  EXPECT_EQ(read->customMaxBytes, 4194304);
  // An unwritable place is reported, not thrown.
  EXPECT_NE(writeTuned("/proc/tpcomm-cannot/x.txt", "x"), "");
  std::remove(path.c_str());
  std::system(("rm -rf " + dir).c_str());
}

TEST(Autotune, TunedCrossoversShapeTheRoutingTable) {
  RoutingTable t(4, {});
  t.setCustomAvailability(true, "");
  t.applyTuned(65536, 1 << 20, "measured");
  EXPECT_EQ(t.tuneSource(), "measured");
  EXPECT_EQ(t.decide(c10d::ReduceOp::SUM, at::kHalf, 65536).route, DeviceRoute::kCustomOneShot);
  EXPECT_EQ(t.decide(c10d::ReduceOp::SUM, at::kHalf, 65552).route, DeviceRoute::kCustomTwoShot);
  const RouteDecision d = t.decide(c10d::ReduceOp::SUM, at::kHalf, (1 << 20) + 16);
  EXPECT_EQ(d.route, DeviceRoute::kNccl);
  EXPECT_EQ(d.reason, "above the tuned custom limit of 1048576 B");
  const auto rows = t.rows();
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].toBytes, 65536);
  EXPECT_EQ(rows[1].fromBytes, 65537);
  EXPECT_EQ(rows[1].toBytes, 1 << 20);
  EXPECT_EQ(rows[2].fromBytes, (1 << 20) + 1);
  // Never above the configured maximum; an explicit one-shot limit wins.
  RoutingConfig c;
  c.oneShotMaxBytes = 4096;
  RoutingTable capped(2, c);
  capped.setCustomAvailability(true, "");
  capped.applyTuned(1 << 20, int64_t{1} << 40, "cache");
  EXPECT_EQ(capped.customLimitBytes(), c.customMaxBytes);
  EXPECT_EQ(capped.oneShotMaxBytes(), 4096);
}

}  // namespace
}  // namespace tpcomm::coord
