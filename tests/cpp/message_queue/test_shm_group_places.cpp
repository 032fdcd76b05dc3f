// The places of a call's chunks in the shared-memory slots
// (message_queue/collectives/shm_group.hpp, ShmGroup::beginCall): calls of
// every op and of sizes from a few lines to several chunks, with a rank
// held back at random points, each against its reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>
#include <vector>

#include "common/error.hpp"
#include "message_queue/collectives/shm_group.hpp"
#include "shm_group_support.hpp"

namespace tpcomm::mq {
namespace {

using namespace std::chrono_literals;

// The float32 sum of every rank's makeInput(rank + call, count), in rank order.
std::vector<float> rankOrderSum(int n, int call, size_t count) {
  std::vector<float> sum(count, 0.0f);
  for (int r = 0; r < n; ++r) {
    std::vector<char> theirs;
    makeInput(DType::kFloat32, r + call, count, theirs, false);
    const float* x = reinterpret_cast<const float*>(theirs.data());
    for (size_t i = 0; i < count; ++i) sum[i] = r == 0 ? x[i] : sum[i] + x[i];
  }
  return sum;
}

// 400 calls of sizes drawn alike on every rank, from a few lines to several
// chunks, each checked against its reference: one-phase and two-phase
// allreduces, the fused allreduce + residual add + RMSNorm, reduce-scatters,
// all-gathers, broadcasts, and at call 200 an allreduce whose count rank 1
// gets wrong by one (so ranks' places differ), which every rank refuses.
int movingCalls(ShmGroup& g) {
  const int n = g.options().size, me = g.options().rank;
  unsigned seed = 11;
  for (int call = 0; call < 400; ++call) {
    seed = seed * 1103515245u + 12345u;
    // 64 B to 96 KiB: most below half a slot (32 KiB), some past a chunk.
    const size_t bytes = 64 + (seed >> 8) % (call % 5 == 4 ? 96 << 10 : 32 << 10);
    const size_t count = bytes / 4;
    ReduceSpec sum;
    std::vector<char> in;
    makeInput(DType::kFloat32, me + call, count, in, false);
    if (call == 200) {
      std::vector<char> out(in.size() + 4);
      try {
        g.allreduce(in.data(), out.data(), count + (me == 1 ? 1 : 0), DType::kFloat32, sum);
        CHILD_CHECK(false, "call %d: ranks' counts differ and the call was served", call);
      } catch (const Error& e) {
        CHILD_CHECK(e.code() == ErrorCode::kInvalidUsage, "call %d: %s", call, e.what());
      }
      continue;
    }
    if (call % 4 == 1) {
      const std::vector<float> expect = rankOrderSum(n, call, count);
      std::vector<char> out(count * 4, 0x5a);
      g.allreduce(in.data(), out.data(), count, DType::kFloat32, sum);
      CHILD_CHECK(std::memcmp(out.data(), expect.data(), count * 4) == 0,
                  "call %d: allreduce of %zu bytes differs from the reference", call, bytes);
      continue;
    }
    if (call % 4 == 3) {  // rows of 1 KiB: 1 to 32 rows here, up to 96 past a chunk
      const size_t hidden = 256, rows = std::max<size_t>(1, count / hidden);
      std::vector<float> residual(rows * hidden), weight(hidden), normed(rows * hidden),
          residualOut(rows * hidden), wantNormed(rows * hidden), wantOut(rows * hidden);
      for (size_t i = 0; i < residual.size(); ++i) residual[i] = 0.25f * ((i + call) % 13);
      for (size_t i = 0; i < hidden; ++i) weight[i] = 1.0f + 0.125f * (i % 5);
      NormRows norm;
      norm.residual = residual.data();
      norm.weight = weight.data();
      norm.hidden = hidden;
      NormRows want = norm;
      norm.residualOut = residualOut.data();
      norm.normed = normed.data();
      want.residualOut = wantOut.data();
      want.normed = wantNormed.data();
      makeInput(DType::kFloat32, me + call, rows * hidden, in, false);
      const std::vector<float> summed = rankOrderSum(n, call, rows * hidden);
      const void* source = summed.data();
      reduceAddRmsNorm(&source, 1, rows, DType::kFloat32, want);
      g.allreduceAddRmsNorm(in.data(), rows, DType::kFloat32, norm);
      CHILD_CHECK(residualOut == wantOut && normed == wantNormed,
                  "call %d: the fused call over %zu rows differs from the reference", call, rows);
      continue;
    }
    // A reduce-scatter of n pieces of count / n floats a rank.
    const size_t piece = std::max<size_t>(1, count / n);
    std::vector<char> full;
    makeInput(DType::kFloat32, me + call, piece * n, full, false);
    std::vector<const void*> ins;
    for (int p = 0; p < n; ++p) ins.push_back(full.data() + p * piece * 4);
    std::vector<float> scattered(piece, -1.0f);
    g.reduceScatter(ins, scattered.data(), piece, DType::kFloat32, sum);
    const std::vector<float> all = rankOrderSum(n, call, piece * n);
    CHILD_CHECK(std::memcmp(scattered.data(), all.data() + me * piece, piece * 4) == 0,
                "call %d: reduce_scatter of %zu floats a rank differs from the reference", call,
                piece);
    std::vector<char> mine(bytes);
    for (size_t i = 0; i < bytes; ++i) mine[i] = static_cast<char>(me * 31 + call + i);
    std::vector<std::vector<char>> gathered(n, std::vector<char>(bytes, 0));
    std::vector<void*> outs;
    for (auto& v : gathered) outs.push_back(v.data());
    g.allgather(mine.data(), bytes, outs);
    const int root = call % n;
    std::vector<char> data = me == root ? mine : std::vector<char>(bytes, 0);
    g.broadcast(data.data(), bytes, root);
    for (size_t i = 0; i < bytes; ++i) {
      for (int r = 0; r < n; ++r) {
        CHILD_CHECK(gathered[r][i] == static_cast<char>(r * 31 + call + i),
                    "call %d: all_gather of %zu bytes, rank %d's byte %zu", call, bytes, r, i);
      }
      CHILD_CHECK(data[i] == static_cast<char>(root * 31 + call + i),
                  "call %d: broadcast of %zu bytes from %d, byte %zu", call, bytes, root, i);
    }
  }
  return 0;
}

// Calls whose chunks fill at most half a slot start at the next place in it
// (ShmGroup::beginCall): movingCalls with rank 1 held back at random points,
// with 64 KiB slots on one thread and with slots of 68 KiB + 64 B (not a
// whole number of pages) on two. A place that two chunks in flight share, or
// that ranks compute differently, gives wrong sums or bytes (consecutive
// chunks sharing memory fail at the first call).
TEST(ShmGroup, CallsMovingThroughTheSlotsGiveTheReferenceWithARankHeldBack) {
  for (const auto& [buffer, threads] :
       {std::pair<uint64_t, int>{64 << 10, 1}, {(68 << 10) + 64, 2}}) {
    ShmGroupOptions o;
    o.bufferBytes = buffer;
    o.threads = threads;
    o.twoPhaseMinBytes = 16 << 10;
    o.spin = 0us;  // more ranks than cores here: sleep at once
    o.timeout = 60s;
    for (int code : runRanks(3, o, movingCalls, holdingRankOneBack))
      EXPECT_EQ(code, 0) << buffer << " B slots, " << threads << " thread(s)";
  }
}

}  // namespace
}  // namespace tpcomm::mq
