// Host-only logic of the custom allreduce (no GPU needed): buffer layout,
// algorithm and block choice, eligibility over faked topologies, the checks
// a call passes before anything is launched, and failure descriptions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>

#include "common/error.hpp"
#include "custom_allreduce/custom_allreduce.hpp"
#include "custom_allreduce/signal.hpp"

namespace tpcomm::car {
namespace {

template <typename Fn>
std::string expectError(ErrorCode code, Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error thrown";
  return "";
}

TEST(CarLayout, RegionsAreAlignedAndDisjoint) {
  for (size_t maxBytes : {size_t{16}, size_t{4096}, size_t{8} << 20, size_t{(8 << 20) + 48}}) {
    const BufferLayout l = BufferLayout::forMaxBytes(maxBytes);
    EXPECT_GE(l.pushOffset, sizeof(Signal));
    EXPECT_EQ(l.pushOffset % 256, 0u);
    // The push buffers: every round of every source, inside the area a
    // reset zeroes, each slot large enough for a push of the group's size.
    EXPECT_GE(l.pushSlotBytes, std::min(maxBytes, kPushMaxBytes));
    EXPECT_EQ(l.pushSlotBytes % 256, 0u);
    EXPECT_EQ(l.signalBytes, l.pushOffset + kPushDepth * kMaxRanks * l.pushSlotBytes);
    EXPECT_EQ(l.stagingOffset, l.signalBytes);
    EXPECT_EQ(l.stagingOffset % 256, 0u);
    EXPECT_EQ(l.resultOffset % 256, 0u);
    EXPECT_GE(l.resultOffset, l.stagingOffset + maxBytes);
    EXPECT_GE(l.totalBytes, l.resultOffset + maxBytes);
    EXPECT_LT(l.totalBytes, l.resultOffset + maxBytes + 256);
  }
  expectError(ErrorCode::kInvalidUsage, [] { BufferLayout::forMaxBytes(0); });
  const std::string what =
      expectError(ErrorCode::kInvalidUsage, [] { BufferLayout::forMaxBytes(100); });
  EXPECT_NE(what.find("multiple of 16 bytes, got 100"), std::string::npos) << what;
}

TEST(CarLayout, EveryFlagSlotHasItsOwnCacheLine) {
  EXPECT_EQ(sizeof(FlagSlot), 128u);
  Signal* s = nullptr;
  const auto at = [&](const void* p) { return reinterpret_cast<uintptr_t>(p); };
  EXPECT_EQ(at(&s->flags[0][0][1]) - at(&s->flags[0][0][0]), 128u);
  EXPECT_EQ(at(&s->flags[0][1][0]) - at(&s->flags[0][0][0]), 128u * kMaxRanks);
  EXPECT_EQ(at(&s->flags[1][0][0]) - at(&s->flags[0][0][0]), 128u * kMaxRanks * kPhases);
  EXPECT_GE(offsetof(Signal, epoch), offsetof(Signal, probe) + kMaxRanks * 128);
}

TEST(CarAlgorithm, OneShotLimitsByWorldSize) {
  const size_t max = 8 << 20;
  EXPECT_EQ(oneShotLimit(2, max), 1u << 20);
  EXPECT_EQ(oneShotLimit(2, 512 << 10), 512u << 10);
  EXPECT_EQ(oneShotLimit(3, max), 512u << 10);
  EXPECT_EQ(oneShotLimit(4, max), 512u << 10);
  EXPECT_EQ(oneShotLimit(5, max), 256u << 10);
  EXPECT_EQ(oneShotLimit(8, max), 256u << 10);
  EXPECT_EQ(oneShotLimit(8, 4096), 4096u);  // never above the maximum
  EXPECT_EQ(chooseAlgorithm(2, 1 << 20, max), Algorithm::kOneShot);
  EXPECT_EQ(chooseAlgorithm(2, (1 << 20) + 16, max), Algorithm::kTwoShot);
  EXPECT_EQ(chooseAlgorithm(4, 512 << 10, max), Algorithm::kOneShot);
  EXPECT_EQ(chooseAlgorithm(4, (512 << 10) + 16, max), Algorithm::kTwoShot);
  EXPECT_EQ(chooseAlgorithm(8, 256 << 10, max), Algorithm::kOneShot);
  EXPECT_EQ(chooseAlgorithm(8, 1 << 20, max), Algorithm::kTwoShot);
  EXPECT_STREQ(algorithmName(Algorithm::kTwoShot), "two-shot");
  EXPECT_STREQ(algorithmName(Algorithm::kPush), "push");
}

// The push takes the small one-shot calls: up to 256 KiB at 2-4 ranks and
// 8 KiB at 5-8 (the crossovers measured on an H200), never past the push slot or the group's maximum; the
// setting (TPCOMM_CAR_PUSH_MAX_BYTES) replaces the limit, 0 turns it off.
TEST(CarAlgorithm, PushLimitsByWorldSizeAndSetting) {
  const size_t max = 8 << 20;
  EXPECT_EQ(pushLimit(2, max), 256u << 10);
  EXPECT_EQ(pushLimit(4, max), 256u << 10);
  EXPECT_EQ(pushLimit(5, max), 8u << 10);
  EXPECT_EQ(pushLimit(8, max), 8u << 10);
  EXPECT_EQ(pushLimit(2, 4096), 4096u);
  EXPECT_EQ(pushLimit(2, max, 0), 0u);
  EXPECT_EQ(pushLimit(8, max, 200 << 10), 200u << 10);
  EXPECT_EQ(pushLimit(2, max, 1 << 30), kPushMaxBytes);  // never past the slot
  EXPECT_EQ(chooseAlgorithm(2, 16, max), Algorithm::kPush);
  EXPECT_EQ(chooseAlgorithm(2, 256 << 10, max), Algorithm::kPush);
  EXPECT_EQ(chooseAlgorithm(2, (256 << 10) + 16, max), Algorithm::kOneShot);
  EXPECT_EQ(chooseAlgorithm(8, 8 << 10, max), Algorithm::kPush);
  EXPECT_EQ(chooseAlgorithm(8, (8 << 10) + 16, max), Algorithm::kOneShot);
  EXPECT_EQ(chooseAlgorithm(2, 16, max, 0), Algorithm::kOneShot);
  EXPECT_TRUE(pushApplies(3, 1000, max));
  EXPECT_FALSE(pushApplies(3, 1000, max, 512));
  EXPECT_NE(describeError(errorCode(3, kPush, 2)).find("rank 3 did not arrive (block 2, its "
                                                       "pushed values)"),
            std::string::npos);
}

// Byte ranges, not addresses: a view that starts elsewhere but shares bytes
// overlaps.
TEST(CarOverlap, IsAnySharedByte) {
  alignas(16) char buffer[256];
  EXPECT_TRUE(rangesOverlap(buffer, buffer, 16));
  EXPECT_TRUE(rangesOverlap(buffer, buffer + 15, 16));
  EXPECT_TRUE(rangesOverlap(buffer + 15, buffer, 16));
  EXPECT_FALSE(rangesOverlap(buffer, buffer + 16, 16));
  EXPECT_FALSE(rangesOverlap(buffer + 16, buffer, 16));
  EXPECT_FALSE(rangesOverlap(buffer, buffer, 0));
}

// Ranks sharing one GPU wait for each other's blocks: all must be resident.
TEST(CarAlgorithm, SharedGpuBlocksFitOrAreRefused) {
  EXPECT_EQ(sharedGpuBlocks(8, 0, 36, 132), 16);  // chosen, capped to fit
  EXPECT_EQ(sharedGpuBlocks(2, 0, 4, 132), 4);
  EXPECT_EQ(sharedGpuBlocks(8, 0, 36, 4), 1);  // at least one
  EXPECT_EQ(sharedGpuBlocks(4, 33, 0, 132), 33);
  try {
    sharedGpuBlocks(8, 17, 0, 132);
    FAIL() << "8 x 17 blocks on a GPU holding 132 were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
    EXPECT_NE(std::string(e.what()).find("8 ranks x 17 blocks = 136 blocks must all be resident "
                                         "at once on one GPU (they wait for each other), but it "
                                         "holds at most 132 of this kernel: ask for at most 16 "
                                         "blocks per rank"),
              std::string::npos)
        << e.what();
  }
}

TEST(CarAlgorithm, BlocksGrowWithSizeAndAreCapped) {
  EXPECT_EQ(chooseBlocks(Algorithm::kOneShot, 2, 0, 0), 1);
  EXPECT_EQ(chooseBlocks(Algorithm::kOneShot, 2, 8 << 10, 0), 1);  // 512 packs
  EXPECT_EQ(chooseBlocks(Algorithm::kOneShot, 2, (8 << 10) + 16, 0), 2);
  EXPECT_EQ(chooseBlocks(Algorithm::kOneShot, 8, 64 << 20, 0), kMaxBlocks);
  EXPECT_EQ(chooseBlocks(Algorithm::kTwoShot, 2, 4 << 20, 0), kMaxBlocks);
  EXPECT_EQ(chooseBlocks(Algorithm::kTwoShot, 8, 64 << 20, 0, kSharedGpuBlocks), 36);
  EXPECT_EQ(chooseBlocks(Algorithm::kTwoShot, 8, 64 << 20, 40, kSharedGpuBlocks), 40);
  // Two-shot reduces a 1/N part per rank: N times fewer packs per block.
  EXPECT_EQ(chooseBlocks(Algorithm::kTwoShot, 4, 128 << 10, 0), 4);
  EXPECT_EQ(chooseBlocks(Algorithm::kOneShot, 4, 128 << 10, 0), 16);
  EXPECT_EQ(chooseBlocks(Algorithm::kTwoShot, 4, 128 << 10, 7), 7);
  const std::string what = expectError(
      ErrorCode::kInvalidUsage, [] { chooseBlocks(Algorithm::kOneShot, 2, 16, kMaxBlocks + 1); });
  EXPECT_NE(what.find("65 blocks asked for; at most 64"), std::string::npos) << what;
}

Topology topology(int n) {
  Topology t;
  for (int r = 0; r < n; ++r) {
    t.hostIds.push_back("node0");
    t.devices.push_back(r);
  }
  t.access.assign(n, std::string(n, 'y'));
  t.links.assign(n, std::string(n, 'n'));
  return t;
}

TEST(CarEligibility, GroupChecksExplainWhatFails) {
  for (int n = 2; n <= 8; ++n) EXPECT_TRUE(groupEligibility(topology(n)).eligible) << n;
  EXPECT_EQ(groupEligibility(topology(1)).reason, "world size 1 is outside 2..8");
  EXPECT_EQ(groupEligibility(topology(9)).reason, "world size 9 is outside 2..8");
  Topology hosts = topology(4);
  hosts.hostIds[2] = "node1";
  EXPECT_EQ(groupEligibility(hosts).reason,
            "ranks 0 and 2 are on different hosts ('node0' and 'node1')");
  Topology noP2p = topology(4);
  noP2p.access[1][3] = 'x';
  EXPECT_EQ(groupEligibility(noP2p).reason, "no P2P access from rank 1 (GPU 1) to rank 3 (GPU 3)");
  Topology shared = topology(4);  // four ranks on one GPU (how tests run)
  shared.devices = {0, 0, 0, 0};
  shared.access.assign(4, std::string(4, 'x'));
  shared.links.assign(4, std::string(4, 'p'));
  EXPECT_TRUE(groupEligibility(shared).eligible) << groupEligibility(shared).reason;
  // One visible GPU per process: peers' GPUs are unknown to CUDA there; the
  // write probe decides.
  Topology hidden = topology(4);
  hidden.access.assign(4, std::string(4, '?'));
  hidden.links.assign(4, std::string(4, '?'));
  EXPECT_TRUE(groupEligibility(hidden).eligible) << groupEligibility(hidden).reason;
  // PCIe: fine between 2 GPUs, refused past 2 (NVLink needed between every pair).
  Topology pcie2 = topology(2);
  pcie2.links.assign(2, std::string(2, 'p'));
  EXPECT_TRUE(groupEligibility(pcie2).eligible) << groupEligibility(pcie2).reason;
  Topology pcie2Gpus4Ranks = topology(4);
  pcie2Gpus4Ranks.devices = {0, 0, 1, 1};
  pcie2Gpus4Ranks.links.assign(4, std::string(4, 'p'));
  EXPECT_TRUE(groupEligibility(pcie2Gpus4Ranks).eligible);
  Topology pcie4 = topology(4);
  pcie4.links[2][3] = 'p';
  EXPECT_EQ(groupEligibility(pcie4).reason,
            "ranks 2 and 3 (GPUs 2 and 3) are not linked by NVLink; past 2 GPUs the custom kernel "
            "needs NVLink between every pair (over PCIe NCCL is faster)");
  Topology probe = topology(2);
  probe.probeSucceeded = false;
  probe.probeDetail = "rank 1 saw 0 from rank 0";
  EXPECT_EQ(groupEligibility(probe).reason, "the IPC write probe failed: rank 1 saw 0 from rank 0");
}

TEST(CarEligibility, CallChecksDtypeSizeAndAlignment) {
  const size_t max = 1 << 20;
  for (const char* dtype : {"float32", "float16", "bfloat16"}) {
    EXPECT_TRUE(callEligibility(dtype, 64, 0x1000, 0x2000, max).eligible) << dtype;
  }
  EXPECT_EQ(callEligibility("int64", 64, 0x1000, 0x2000, max).reason,
            "dtype int64 (the kernel sums float32, float16 and bfloat16)");
  EXPECT_EQ(callEligibility("float32", max + 4, 0x1000, 0x2000, max).reason,
            "1048580 bytes exceed the custom maximum of 1048576");
  EXPECT_EQ(callEligibility("float32", 64, 0x1004, 0x2000, max).reason,
            "a tensor that is not 16-byte aligned");
  EXPECT_EQ(callEligibility("float16", 64, 0x1000, 0x2008, max).reason,
            "a tensor that is not 16-byte aligned");
  EXPECT_TRUE(callEligibility("float32", max, 0x1000, 0x1000, max).eligible);  // in place
}

TEST(CarHost, CallsAreCheckedBeforeAnythingIsLaunched) {
  uint32_t error = 0;
  std::vector<void*> buffers{reinterpret_cast<void*>(0x10000), reinterpret_cast<void*>(0x20000)};
  CustomAllreduce car(0, 2, buffers, 4096, std::chrono::milliseconds(100), &error, &error);
  void* in = reinterpret_cast<void*>(0x30000);
  std::string what = expectError(ErrorCode::kInvalidUsage, [&] {
    car.allreduce(in, in, 2048, DType::kFloat32, nullptr);  // 8 KiB > 4 KiB
  });
  EXPECT_NE(what.find("8192 bytes exceed the custom maximum of 4096"), std::string::npos) << what;
  what = expectError(ErrorCode::kInvalidUsage, [&] {
    car.allreduce(reinterpret_cast<char*>(in) + 2, in, 4, DType::kFloat16, nullptr);
  });
  EXPECT_NE(what.find("not 16-byte aligned"), std::string::npos) << what;
  car.allreduce(in, in, 0, DType::kFloat32, nullptr);  // nothing to do, nothing launched
  // A kernel that timed out left a code: the host names the peer and refuses more calls.
  error = errorCode(1, kStart, 3);
  what = expectError(ErrorCode::kTimeout, [&] { car.checkError(); });
  EXPECT_NE(what.find("rank 1 did not arrive (block 3, start barrier) within 100 ms"),
            std::string::npos)
      << what;
  what = expectError(ErrorCode::kPeerLost,
                     [&] { car.allreduce(in, in, 4, DType::kFloat32, nullptr); });
  EXPECT_NE(what.find("an earlier call failed (rank 1 did not arrive"), std::string::npos) << what;
  car.clearError();
  EXPECT_EQ(car.errorCode(), 0u);
  EXPECT_NO_THROW(car.checkError());
}

TEST(CarHost, ConstructorRefusesBadGroups) {
  uint32_t error = 0;
  const auto make = [&](int rank, int n, std::vector<void*> buffers) {
    CustomAllreduce(rank, n, std::move(buffers), 4096, std::chrono::milliseconds(100), &error,
                    &error);
  };
  void* p = reinterpret_cast<void*>(0x10000);
  EXPECT_NE(expectError(ErrorCode::kInvalidUsage, [&] { make(0, 1, {p}); })
                .find("world size 1 is outside 2..8"),
            std::string::npos);
  EXPECT_NE(expectError(ErrorCode::kInvalidUsage,
                        [&] {
                          make(2, 2, {p, p});
                        })
                .find("rank 2 is outside 0..1"),
            std::string::npos);
  EXPECT_NE(expectError(ErrorCode::kInvalidUsage,
                        [&] {
                          make(0, 2, {p, nullptr});
                        })
                .find("no buffer for rank 1"),
            std::string::npos);
}

TEST(CarErrors, DescribeNamesPeerBlockAndPhase) {
  EXPECT_EQ(describeError(0), "no error");
  EXPECT_EQ(describeError(errorCode(7, kMiddle, 35)),
            "rank 7 did not arrive (block 35, middle barrier)");
  EXPECT_EQ(describeError(errorCode(0, kEnd, 0)), "rank 0 did not arrive (block 0, end barrier)");
}

}  // namespace
}  // namespace tpcomm::car
