// GroupCoordinator: routing and the operations it composes for backends that
// lack them, at world sizes 1..8, against float64 references.
#include <gtest/gtest.h>

#include "common/error.hpp"
#include "group_fixture.hpp"
#include "torch_compat.hpp"

namespace tpcomm::testing {
namespace {

using coord::Pending;

at::Tensor rankInput(int rank, int64_t n, at::ScalarType dtype) {
  auto x = at::arange(n, at::kDouble) * (rank + 1) - 0.25 * rank;
  if (at::isIntegralType(dtype, false)) x = at::arange(n, at::kDouble) * (rank + 1) - 3 * rank;
  return x.to(dtype);
}

class CoordinatorSizes : public ::testing::TestWithParam<int> {};

TEST_P(CoordinatorSizes, AllreduceAvgMatchesFloat64Reference) {
  ThreadGroup group(GetParam());
  for (auto dtype : {at::kFloat, at::kDouble, at::kLong}) {
    for (int64_t n : {0, 1, 7, 33}) {
      at::Tensor sum = at::zeros({n}, at::kDouble);
      for (int r = 0; r < group.size(); ++r) sum += rankInput(r, n, dtype).to(at::kDouble);
      at::Tensor expected = at::isIntegralType(dtype, false) ? at::div(sum, group.size(), "trunc")
                                                             : sum / group.size();
      runRanks(group.size(), [&](int r) {
        std::vector<at::Tensor> t{rankInput(r, n, dtype)};
        c10d::AllreduceOptions opts;
        opts.reduceOp = c10d::ReduceOp::AVG;
        Pending p = group.coordinators[r]->allreduce(t, opts);
        complete(p);
        EXPECT_TRUE(at::allclose(t[0].to(at::kDouble), expected, 1e-6, 1e-6))
            << "rank " << r << " n " << n << " dtype " << dtype;
      });
    }
  }
}

TEST_P(CoordinatorSizes, PremulSumScalarAndTensorFactor) {
  ThreadGroup group(GetParam());
  const int64_t n = 19;
  at::Tensor sum = at::zeros({n}, at::kDouble);
  for (int r = 0; r < group.size(); ++r) sum += rankInput(r, n, at::kDouble);
  for (bool tensorFactor : {false, true}) {
    runRanks(group.size(), [&](int r) {
      std::vector<at::Tensor> t{rankInput(r, n, at::kDouble)};
      c10d::AllreduceOptions opts;
      opts.reduceOp = tensorFactor ? tpcomm::test::preMulSum(at::full({1}, 0.5, at::kDouble))
                                   : tpcomm::test::preMulSum(0.5);
      Pending p = group.coordinators[r]->allreduce(t, opts);
      complete(p);
      EXPECT_TRUE(at::allclose(t[0], sum * 0.5)) << "rank " << r;
    });
  }
}

TEST_P(CoordinatorSizes, ReduceAvgWritesOnlyTheRoot) {
  ThreadGroup group(GetParam());
  const int root = group.size() - 1;
  const int64_t n = 5;
  at::Tensor sum = at::zeros({n}, at::kDouble);
  for (int r = 0; r < group.size(); ++r) sum += rankInput(r, n, at::kDouble);
  runRanks(group.size(), [&](int r) {
    at::Tensor original = rankInput(r, n, at::kDouble);
    std::vector<at::Tensor> t{original.clone()};
    c10d::ReduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::AVG;
    opts.rootRank = root;
    Pending p = group.coordinators[r]->reduce(t, opts);
    complete(p);
    if (r == root) {
      EXPECT_TRUE(at::allclose(t[0], sum / group.size()));
    } else {
      EXPECT_TRUE(at::equal(t[0], original)) << "non-root rank " << r << " was modified";
    }
  });
}

TEST_P(CoordinatorSizes, ReduceScatterAvgAndPremulLeaveInputUntouched) {
  ThreadGroup group(GetParam());
  const int64_t chunk = 3;
  const int64_t n = chunk * group.size();
  at::Tensor sum = at::zeros({n}, at::kDouble);
  for (int r = 0; r < group.size(); ++r) sum += rankInput(r, n, at::kDouble);
  for (bool premul : {false, true}) {
    runRanks(group.size(), [&](int r) {
      at::Tensor input = rankInput(r, n, at::kDouble);
      at::Tensor before = input.clone();
      at::Tensor output = at::empty({chunk}, at::kDouble);
      c10d::ReduceScatterOptions opts;
      opts.reduceOp = premul ? tpcomm::test::preMulSum(2.0) : c10d::ReduceOp(c10d::ReduceOp::AVG);
      Pending p = group.coordinators[r]->reduceScatterBase(output, input, opts);
      complete(p);
      at::Tensor full = premul ? sum * 2.0 : sum / group.size();
      EXPECT_TRUE(at::allclose(output, full.narrow(0, r * chunk, chunk))) << "rank " << r;
      EXPECT_TRUE(at::equal(input, before)) << "rank " << r << " input modified";
    });
  }
}

TEST_P(CoordinatorSizes, AlltoallListWithUnevenSizes) {
  ThreadGroup group(GetParam());
  const int size = group.size();
  runRanks(size, [&](int r) {
    // Rank r sends (r + d) elements of value 100 r + d to rank d.
    std::vector<at::Tensor> inputs;
    std::vector<at::Tensor> outputs;
    for (int d = 0; d < size; ++d) {
      inputs.push_back(at::full({r + d}, 100.0 * r + d, at::kFloat));
      outputs.push_back(at::full({d + r}, -1.0, at::kFloat));
    }
    Pending p = group.coordinators[r]->alltoall(outputs, inputs, c10d::AllToAllOptions());
    complete(p);
    for (int src = 0; src < size; ++src) {
      EXPECT_TRUE(at::equal(outputs[src], at::full({src + r}, 100.0 * src + r, at::kFloat)))
          << "rank " << r << " from " << src;
    }
  });
}

TEST_P(CoordinatorSizes, CpuCallsNeverCreateTheDeviceBackend) {
  ThreadGroup group(GetParam());
  runRanks(group.size(), [&](int r) {
    auto& c = *group.coordinators[r];
    std::vector<at::Tensor> t{at::ones({4})};
    Pending p = c.allreduce(t, c10d::AllreduceOptions());
    complete(p);
    Pending b = c.barrier(c10d::BarrierOptions());
    complete(b);
    EXPECT_EQ(c.routeFor(t[0]), coord::Route::kCpu);
    EXPECT_FALSE(c.deviceBackendIfCreated());
  });
  EXPECT_EQ(group.deviceFactoryCalls->load(), 0);
  for (const auto& cpu : group.cpu) EXPECT_EQ(cpu->calls.load(), 2);
}

TEST_P(CoordinatorSizes, DeviceBackendIsCreatedOnceOnFirstUse) {
  ThreadGroup group(GetParam());
  runRanks(group.size(), [&](int r) {
    group.coordinators[r]->eagerConnect(at::Device(at::kCUDA, 0));
    group.coordinators[r]->eagerConnect(at::Device(at::kCUDA, 0));
    group.coordinators[r]->eagerConnect(at::Device(at::kCPU));
    EXPECT_TRUE(group.coordinators[r]->deviceBackendIfCreated());
  });
  EXPECT_EQ(group.deviceFactoryCalls->load(), group.size());
}

TEST_P(CoordinatorSizes, StatsCountCallsAndBytesPerRoute) {
  ThreadGroup group(GetParam());
  const int n = group.size();
  runRanks(n, [&](int r) {
    auto& c = *group.coordinators[r];
    std::vector<at::Tensor> t{at::ones({5})};  // 20 bytes
    c10d::AllreduceOptions avg;
    avg.reduceOp = c10d::ReduceOp::AVG;  // composed: still one call on the route
    Pending a = c.allreduce(t, avg);
    complete(a);
    std::vector<at::Tensor> d{at::ones({3}, at::kDouble)};  // 24 bytes
    Pending b = c.broadcast(d, c10d::BroadcastOptions());
    complete(b);
    std::vector<at::Tensor> in{at::ones({2}, at::kLong)};  // 16 bytes
    std::vector<std::vector<at::Tensor>> out(1);
    for (int i = 0; i < n; ++i) out[0].push_back(at::empty({2}, at::kLong));
    Pending g = c.allgather(out, in, c10d::AllgatherOptions());
    complete(g);
    Pending bar = c.barrier(c10d::BarrierOptions());
    complete(bar);
  });
  for (int r = 0; r < n; ++r) {
    auto rows = group.coordinators[r]->stats();
    ASSERT_EQ(rows.size(), 6u);
    EXPECT_EQ(rows[1].route, "cpu_shm");
    EXPECT_EQ(rows[2].route, "cpu_hier");
    EXPECT_EQ(rows[0].route, "gloo");
    EXPECT_EQ(rows[0].calls, 4u) << "rank " << r;
    EXPECT_EQ(rows[0].bytes, 20u + 24u + 16u) << "rank " << r;
    for (size_t i = 1; i < rows.size(); ++i) {
      EXPECT_EQ(rows[i].calls, 0u) << rows[i].route;
      EXPECT_EQ(rows[i].bytes, 0u) << rows[i].route;
    }
    EXPECT_EQ(rows[5].route, "nccl");
    group.coordinators[r]->resetStats();
    EXPECT_EQ(group.coordinators[r]->stats()[0].calls, 0u);
  }
}

TEST_P(CoordinatorSizes, DebugCheckPassesWhenRanksAgree) {
  ThreadGroup group(GetParam(), /*debugChecks=*/true);
  runRanks(group.size(), [&](int r) {
    std::vector<at::Tensor> t{at::full({6}, 1.0)};
    Pending p = group.coordinators[r]->allreduce(t, c10d::AllreduceOptions());
    complete(p);
    EXPECT_TRUE(at::equal(t[0], at::full({6}, 1.0 * group.size())));
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CoordinatorSizes, ::testing::Range(1, 9));

TEST(CoordinatorDebug, MismatchRaisesOnEveryRankNamingRanksAndShapes) {
  ThreadGroup group(3, /*debugChecks=*/true);
  std::vector<std::string> messages(3);
  runRanks(3, [&](int r) {
    std::vector<at::Tensor> t{at::ones({r == 1 ? 5 : 4})};
    try {
      group.coordinators[r]->allreduce(t, c10d::AllreduceOptions());
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
      messages[r] = e.what();
    }
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(messages[r].find("ranks 0,2 called allreduce SUM float32[4]"), std::string::npos)
        << messages[r];
    EXPECT_NE(messages[r].find("rank 1 called allreduce SUM float32[5]"), std::string::npos)
        << messages[r];
  }
  // The mismatched collective itself was never issued.
  for (const auto& cpu : group.cpu) EXPECT_EQ(cpu->calls.load(), 2);  // the two check gathers
}

TEST(CoordinatorDebug, DifferentOperationsAreNamed) {
  ThreadGroup group(2, /*debugChecks=*/true);
  std::vector<std::string> messages(2);
  runRanks(2, [&](int r) {
    std::vector<at::Tensor> t{at::ones({4})};
    try {
      if (r == 0) {
        group.coordinators[r]->allreduce(t, c10d::AllreduceOptions());
      } else {
        group.coordinators[r]->broadcast(t, c10d::BroadcastOptions());
      }
    } catch (const Error& e) {
      messages[r] = e.what();
    }
  });
  for (const auto& m : messages) {
    EXPECT_NE(m.find("rank 0 called allreduce"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 1 called broadcast root=0"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace tpcomm::testing
