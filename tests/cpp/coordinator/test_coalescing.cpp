// A group's batch (backend/coalescing.hpp): its Work completes when every
// call's has, raises the first failure, bounds its wait, and its future
// carries every call's results in order; a batch misused is named.
#include <gtest/gtest.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include "backend/coalescing.hpp"
#include "common/error.hpp"

namespace tpcomm::testing {
namespace {

using backend::CoalescedWork;
using backend::Coalescing;
using backend::WorkPtr;

// A call's Work that completes when the test says, with its own future.
class ManualWork : public c10d::Work {
 public:
  explicit ManualWork(at::Tensor result)
      : future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors())),
        result_(std::move(result)) {}
  void succeed() {
    finish();
    future_->markCompleted(c10::IValue(std::vector<at::Tensor>{result_}));
  }
  void fail(const std::string& why) {
    auto error = std::make_exception_ptr(std::runtime_error(why));
    finish(error);
    future_->setError(error);
  }
  // Its wait returns false from now on, as an aborted Work's does.
  void abortWait() { aborted_ = true; }
  bool wait(std::chrono::milliseconds timeout) override {
    if (aborted_) return false;
    return c10d::Work::wait(timeout);
  }
  std::vector<at::Tensor> result() override { return {result_}; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  at::Tensor result_;
  bool aborted_ = false;
};

TEST(Coalescing, TheBatchCompletesWhenEveryCallHasWithTheirResultsInOrder) {
  auto a = c10::make_intrusive<ManualWork>(at::full({2}, 1.0));
  auto b = c10::make_intrusive<ManualWork>(at::full({3}, 2.0));
  CoalescedWork batch(0, {a, b}, false);
  auto future = batch.getFuture();
  EXPECT_FALSE(batch.isCompleted());
  // A bounded wait on a call that has not completed raises its timeout.
  EXPECT_ANY_THROW(batch.wait(std::chrono::milliseconds(20)));
  b->succeed();
  EXPECT_FALSE(batch.isCompleted());
  EXPECT_FALSE(future->completed());
  a->succeed();
  EXPECT_TRUE(batch.isCompleted());
  EXPECT_TRUE(batch.wait(std::chrono::milliseconds(1000)));
  ASSERT_TRUE(future->completed());
  EXPECT_FALSE(future->hasError());
  const auto values = future->value().toTensorVector();
  ASSERT_EQ(values.size(), 2u);
  EXPECT_TRUE(values[0].equal(at::full({2}, 1.0)));
  EXPECT_TRUE(values[1].equal(at::full({3}, 2.0)));
  EXPECT_EQ(batch.result().size(), 2u);
  EXPECT_EQ(batch.exception(), nullptr);
}

TEST(Coalescing, TheFirstFailureIsTheBatchs) {
  auto a = c10::make_intrusive<ManualWork>(at::ones({1}));
  auto b = c10::make_intrusive<ManualWork>(at::ones({1}));
  CoalescedWork batch(1, {a, b}, false);
  auto future = batch.getFuture();
  b->fail("rank 1's recv from rank 0: 10 bytes sent, 12 expected");
  ASSERT_TRUE(future->completed());
  ASSERT_TRUE(future->hasError());
  EXPECT_NE(future->tryRetrieveErrorMessage().find("12 expected"), std::string::npos);
  ASSERT_NE(batch.exception(), nullptr);
  a->succeed();
  try {
    batch.wait();
    FAIL() << "the failed call's error was not raised";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("12 expected"), std::string::npos) << e.what();
  }
}

TEST(Coalescing, APartDoneBeforeTheFutureAnAbortedPartAndADeviceBatch) {
  auto a = c10::make_intrusive<ManualWork>(at::full({1}, 3.0));
  auto b = c10::make_intrusive<ManualWork>(at::full({1}, 4.0));
  a->succeed();  // before the batch's future is made
  CoalescedWork batch(0, {a, b}, false);
  auto future = batch.getFuture();
  EXPECT_FALSE(future->completed());
  b->succeed();
  ASSERT_TRUE(future->completed());
  const auto values = future->value().toTensorVector();
  ASSERT_EQ(values.size(), 2u);
  EXPECT_EQ(values[0].item<double>(), 3.0);
  EXPECT_EQ(values[1].item<double>(), 4.0);
  // A part whose wait says it was aborted: so does the batch's.
  auto c = c10::make_intrusive<ManualWork>(at::ones({1}));
  c->abortWait();
  CoalescedWork aborted(0, {a, c}, false);
  EXPECT_FALSE(aborted.wait(std::chrono::milliseconds(1000)));
  // A batch with the device backend's part has no future, and says so.
  CoalescedWork device(0, {a, b}, true);
  try {
    device.getFuture();
    FAIL() << "a device batch's future was made";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("wait() on it instead"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(device.wait());
}

TEST(Coalescing, ABatchIsCountedALeftOneDroppedAndMisuseNamed) {
  Coalescing coalescing;
  // Closed: calls are not counted.
  coalescing.add(c10::make_intrusive<ManualWork>(at::ones({1})));
  try {
    coalescing.end("'tp'");
    FAIL() << "end without start passed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
    EXPECT_NE(std::string(e.what()).find("endCoalescing on group 'tp' without startCoalescing"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(coalescing.start(), 0u);
  EXPECT_TRUE(coalescing.open());
  coalescing.add(c10::make_intrusive<ManualWork>(at::ones({1})));
  coalescing.add(WorkPtr());  // a call that completed without a Work
  // A batch left open is dropped by the next start, which says how many
  // calls it had; the new batch counts from nothing.
  EXPECT_EQ(coalescing.start(), 2u);
  EXPECT_TRUE(coalescing.open());
  coalescing.add(WorkPtr());
  coalescing.add(c10::make_intrusive<ManualWork>(at::ones({1})));
  coalescing.add(c10::make_intrusive<ManualWork>(at::ones({1})));
  const Coalescing::Batch batch = coalescing.end("'tp'");
  EXPECT_EQ(batch.calls, 3u);
  EXPECT_EQ(batch.works.size(), 2u);
  EXPECT_FALSE(coalescing.open());
  // A batch keeps at most kMaxKeptWorks Works; more is named at its end.
  coalescing.start();
  auto one = c10::make_intrusive<ManualWork>(at::ones({1}));
  for (size_t i = 0; i <= Coalescing::kMaxKeptWorks; ++i) coalescing.add(one);
  try {
    coalescing.end("'tp'");
    FAIL() << "an overflowed batch ended";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a batch of 65537 calls"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(coalescing.open());
}

}  // namespace
}  // namespace tpcomm::testing
