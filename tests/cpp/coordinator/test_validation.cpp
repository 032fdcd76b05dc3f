// ProcessGroupTpcomm: every bad argument raises c10::Error naming what is
// wrong before anything is sent; backend failures surface as DistBackendError.
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/exception.h>

#include "backend/process_group_tpcomm.hpp"
#include "group_fixture.hpp"
#include "torch_compat.hpp"

namespace tpcomm::testing {
namespace {

using backend::ProcessGroupTpcomm;

// Expects `call` to throw c10::Error (not DistBackendError) containing `text`.
template <typename F>
void expectArgumentErrorOn(F&& call, const std::string& text) {
  try {
    call();
    ADD_FAILURE() << "no error; expected: " << text;
  } catch (const c10::DistBackendError& e) {
    ADD_FAILURE() << "argument error surfaced as DistBackendError: " << e.what();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << text;
  }
}

class Validation : public ::testing::Test {
 protected:
  // Both ranks of a two-rank group; the calls here fail before any exchange.
  ThreadGroup group{2};
  c10::intrusive_ptr<ProcessGroupTpcomm> pg1 =
      c10::make_intrusive<ProcessGroupTpcomm>(group.coordinators[1]);
  c10::intrusive_ptr<ProcessGroupTpcomm> pg0 =
      c10::make_intrusive<ProcessGroupTpcomm>(group.coordinators[0]);
  // The rank the test's calls go to (their lambdas read it).
  c10::intrusive_ptr<ProcessGroupTpcomm> pg = pg0;

  // Every rank makes the same bad call, as a program does when its
  // arguments are wrong everywhere: a collective only one rank refuses
  // breaks the group (coordinator/faults/group_fault.hpp), and that rank's next
  // call waits for its peers' word.
  template <typename F>
  void expectArgumentError(F&& call, const std::string& text) {
    pg = pg1;
    expectArgumentErrorOn(call, text);
    pg = pg0;
    expectArgumentErrorOn(call, text);
  }

  void TearDown() override {
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(group.cpu[r]->calls.load(), 0) << "a rejected call reached rank " << r;
    }
    EXPECT_TRUE(group.coordinators[0]->fault().reason().empty());
  }
};

TEST_F(Validation, BitwiseOpOnFloat) {
  std::vector<at::Tensor> t{at::ones({4})};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::BXOR;
  expectArgumentError([&] { pg->allreduce(t, opts); },
                      "allreduce: ReduceOp.BXOR needs an integer or bool tensor, got float32");
}

TEST_F(Validation, PremulSumOnInteger) {
  std::vector<at::Tensor> t{at::ones({4}, at::kInt)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = tpcomm::test::preMulSum(2.0);
  expectArgumentError([&] { pg->allreduce(t, opts); },
                      "PREMUL_SUM needs a floating-point tensor, got int32");
}

TEST_F(Validation, AvgOnBool) {
  std::vector<at::Tensor> t{at::ones({4}, at::kBool)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::AVG;
  expectArgumentError([&] { pg->allreduce(t, opts); }, "ReduceOp.AVG is not defined for bool");
}

TEST_F(Validation, MoreThanOneTensor) {
  std::vector<at::Tensor> t{at::ones({4}), at::ones({4})};
  expectArgumentError([&] { pg->allreduce(t, c10d::AllreduceOptions()); },
                      "allreduce: expected exactly one tensor in tensors, got 2");
}

TEST_F(Validation, UnsupportedDevice) {
  std::vector<at::Tensor> t{at::empty({4}, at::TensorOptions().device(at::kMeta))};
  expectArgumentError([&] { pg->allreduce(t, c10d::AllreduceOptions()); },
                      "is on device meta; tpcomm handles cpu and cuda tensors");
}

TEST_F(Validation, NonContiguous) {
  std::vector<at::Tensor> t{at::ones({4, 4}).t()};
  expectArgumentError([&] { pg->broadcast(t, c10d::BroadcastOptions()); },
                      "broadcast: tensors[0] is not contiguous");
}

TEST_F(Validation, RootRankOutOfRange) {
  std::vector<at::Tensor> t{at::ones({4})};
  c10d::BroadcastOptions opts;
  opts.rootRank = 5;
  expectArgumentError([&] { pg->broadcast(t, opts); },
                      "broadcast: root rank 5 is out of range for a group of size 2");
  c10d::ReduceOptions ropts;
  ropts.rootRank = -1;
  expectArgumentError([&] { pg->reduce(t, ropts); }, "reduce: root rank -1 is out of range");
}

TEST_F(Validation, PeerRankOutOfRange) {
  std::vector<at::Tensor> t{at::ones({4})};
  expectArgumentError([&] { pg->send(t, 2, 0); },
                      "send: destination rank 2 is out of range for a group of size 2");
  expectArgumentError([&] { pg->recv(t, 7, 0); }, "recv: source rank 7 is out of range");
}

TEST_F(Validation, AllgatherListLength) {
  std::vector<at::Tensor> in{at::ones({4})};
  std::vector<std::vector<at::Tensor>> out{{at::empty({4})}};
  expectArgumentError([&] { pg->allgather(out, in, c10d::AllgatherOptions()); },
                      "allgather: output tensor list has 1 entries, expected 2");
}

TEST_F(Validation, AllgatherIntoTensorSize) {
  at::Tensor in = at::ones({4});
  at::Tensor out = at::empty({7});
  expectArgumentError([&] { pg->_allgather_base(out, in, c10d::AllgatherOptions()); },
                      "allgather_into_tensor: the output has 7 elements, expected 8");
}

TEST_F(Validation, MixedDtypes) {
  at::Tensor in = at::ones({4});
  at::Tensor out = at::empty({8}, at::kDouble);
  expectArgumentError([&] { pg->_allgather_base(out, in, c10d::AllgatherOptions()); },
                      "output[0] has dtype float64 but the call's dtype is float32");
}

TEST_F(Validation, ReduceScatterInputListLength) {
  std::vector<at::Tensor> out{at::empty({2})};
  std::vector<std::vector<at::Tensor>> in{{at::ones({2}), at::ones({2}), at::ones({2})}};
  expectArgumentError([&] { pg->reduce_scatter(out, in, c10d::ReduceScatterOptions()); },
                      "reduce_scatter: the input list has 3 entries, expected 2");
}

TEST_F(Validation, ScatterListOnlyOnRoot) {
  std::vector<at::Tensor> out{at::empty({2})};
  std::vector<std::vector<at::Tensor>> in{{at::ones({2}), at::ones({2})}};
  c10d::ScatterOptions opts;
  opts.rootRank = 1;
  // An error on rank 0 only (one call: nothing waits for the peers).
  expectArgumentErrorOn([&] { pg->scatter(out, in, opts); },
                        "scatter: only the root rank (1) passes a scatter list; rank 0 passed one");
}

TEST_F(Validation, GatherListOnRootHasWrongLength) {
  std::vector<at::Tensor> in{at::ones({2})};
  std::vector<std::vector<at::Tensor>> out{{at::empty({2})}};
  // An error on the root only (one call: nothing waits for the peers).
  expectArgumentErrorOn([&] { pg->gather(out, in, c10d::GatherOptions()); },
                        "gather: the gather list has 1 entries, expected 2");
}

TEST_F(Validation, AlltoallSplitsMustCoverTheTensor) {
  at::Tensor in = at::ones({5});
  at::Tensor out = at::empty({5});
  std::vector<int64_t> inSplits{2, 2};
  std::vector<int64_t> outSplits{3, 2};
  expectArgumentError(
      [&] { pg->alltoall_base(out, in, outSplits, inSplits, c10d::AllToAllOptions()); },
      "all_to_all_single: input_split_sizes sum to 4 but the tensor has 5 rows");
  std::vector<int64_t> three{1, 1, 3};
  expectArgumentError(
      [&] { pg->alltoall_base(out, in, outSplits, three, c10d::AllToAllOptions()); },
      "input_split_sizes has 3 entries, expected 2");
  std::vector<int64_t> none;
  expectArgumentError([&] { pg->alltoall_base(out, in, none, none, c10d::AllToAllOptions()); },
                      "dim 0 must divide evenly by the group size, got 5 rows for 2 ranks");
}

TEST_F(Validation, AlltoallListLengths) {
  std::vector<at::Tensor> in{at::ones({1})};
  std::vector<at::Tensor> out{at::empty({1}), at::empty({1})};
  expectArgumentError([&] { pg->alltoall(out, in, c10d::AllToAllOptions()); },
                      "all_to_all: input_tensor_list has 1 entries, expected 2");
}

TEST_F(Validation, CoalescedListsMustPair) {
  std::vector<at::Tensor> in{at::ones({2}), at::ones({2})};
  std::vector<at::Tensor> out{at::empty({4})};
  expectArgumentError(
      [&] { pg->allgather_into_tensor_coalesced(out, in, c10d::AllgatherOptions()); },
      "allgather_into_tensor_coalesced: outputs has 1 entries, expected 2");
}

TEST(BackendErrors, CommunicationFailureIsDistBackendErrorNamingTheCall) {
  auto pg = c10::make_intrusive<ProcessGroupTpcomm>(failingCoordinator());
  std::vector<at::Tensor> t{at::ones({4})};
  auto work = pg->allreduce(t, c10d::AllreduceOptions());
  try {
    work->wait();
    FAIL() << "no error";
  } catch (const c10::DistBackendError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("tpcomm: allreduce on group 'g' (rank 0 of 1) failed: Timed out"),
              std::string::npos)
        << what;
  }
  // The future carries the error wait() raised.
  auto future = work->getFuture();
  ASSERT_TRUE(future->hasError());
  try {
    std::rethrow_exception(future->exception_ptr());
  } catch (const c10::DistBackendError& e) {
    EXPECT_NE(std::string(e.what()).find("tpcomm: allreduce on group 'g' (rank 0 of 1) failed: "),
              std::string::npos)
        << e.what();
  }
}

TEST(BackendWork, FutureCompletesAfterTheFinishStep) {
  ThreadGroup group(1);
  auto pg = c10::make_intrusive<ProcessGroupTpcomm>(group.coordinators[0]);
  std::vector<at::Tensor> t{at::full({3}, 6.0)};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::AVG;
  auto work = pg->allreduce(t, opts);
  auto future = work->getFuture();
  future->wait();
  auto value = future->value().toTensorVector();
  ASSERT_EQ(value.size(), 1u);
  EXPECT_TRUE(at::equal(value[0], at::full({3}, 6.0)));
  EXPECT_TRUE(work->isCompleted());
  EXPECT_TRUE(work->wait());
  EXPECT_EQ(pg->getBackendName(), "tpcomm");
  EXPECT_TRUE(pg->supportsSplitting());
}

TEST(BackendWork, RoutedWorkWithoutFutureStillGetsOne) {
  // The coordinator marks CPU reduce-scatter as future-less (as Gloo's is).
  ThreadGroup group(1);
  auto pg = c10::make_intrusive<ProcessGroupTpcomm>(group.coordinators[0]);
  at::Tensor input = at::full({4}, 8.0);
  at::Tensor output = at::empty({4});
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::AVG;
  auto work = pg->_reduce_scatter_base(output, input, opts);
  auto future = work->getFuture();
  EXPECT_EQ(future.get(), work->getFuture().get()) << "one future per work";
  future->wait();
  ASSERT_FALSE(future->hasError());
  EXPECT_TRUE(at::equal(future->value().toTensorVector()[0], at::full({4}, 8.0)));
  EXPECT_TRUE(work->wait());
}

// A backend that, like ProcessGroupNCCL for asyncOp=false, returns no Work.
class NoWorkBackend : public ThreadedBackend {
 public:
  using ThreadedBackend::ThreadedBackend;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    ThreadedBackend::allreduce(tensors, opts);
    return {};
  }
};

TEST(BackendWork, SynchronousCallWithoutWorkReturnsNoneAfterFinishing) {
  auto hub = std::make_shared<Hub>(2);
  auto store = c10::make_intrusive<c10d::HashStore>();
  runRanks(2, [&](int r) {
    coord::GroupOptions options;
    options.cpuShm = false;  // fake CPU backends: the Gloo route, no shm set-up
    options.rank = r;
    options.size = 2;
    auto coordinator = std::make_shared<coord::GroupCoordinator>(
        options, store, c10::make_intrusive<NoWorkBackend>(hub, r), coord::BackendFactory());
    auto pg = c10::make_intrusive<ProcessGroupTpcomm>(coordinator);
    std::vector<at::Tensor> t{at::full({2}, 2.0 * (r + 1))};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::AVG;
    opts.asyncOp = false;
    auto work = pg->allreduce(t, opts);
    EXPECT_FALSE(work);
    EXPECT_TRUE(at::equal(t[0], at::full({2}, 3.0)));  // AVG's division already applied
  });
}

TEST(BackendWork, NoDeviceBackendIsAClearError) {
  auto hub = std::make_shared<Hub>(1);
  coord::GroupOptions options;
  options.cpuShm = false;  // fake CPU backends: the Gloo route, no shm set-up
  options.groupName = "cpu-only";
  auto coordinator = std::make_shared<coord::GroupCoordinator>(
      options, c10::make_intrusive<c10d::HashStore>(), c10::make_intrusive<ThreadedBackend>(hub, 0),
      coord::BackendFactory());
  auto pg = c10::make_intrusive<ProcessGroupTpcomm>(coordinator);
  expectArgumentErrorOn([&] { pg->eagerConnectSingleDevice(at::Device(at::kCUDA, 0)); },
                        "group 'cpu-only' has no device backend (CUDA is not available)");
}

}  // namespace
}  // namespace tpcomm::testing
