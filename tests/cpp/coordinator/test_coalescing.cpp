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
  std::vector<at::Tensor> result() override { return {result_}; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  at::Tensor result_;
};

TEST(Coalescing, TheBatchCompletesWhenEveryCallHasWithTheirResultsInOrder) {
  auto a = c10::make_intrusive<ManualWork>(at::full({2}, 1.0));
  auto b = c10::make_intrusive<ManualWork>(at::full({3}, 2.0));
  CoalescedWork batch(0, {a, b});
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
  CoalescedWork batch(1, {a, b});
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

TEST(Coalescing, ABatchIsCountedAndMisuseIsNamed) {
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
  coalescing.start("'tp'");
  EXPECT_TRUE(coalescing.open());
  coalescing.add(c10::make_intrusive<ManualWork>(at::ones({1})));
  coalescing.add(WorkPtr());  // a call that completed without a Work
  try {
    coalescing.start("'tp'");
    FAIL() << "a second start passed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("its batch of 2 call(s) is still open"), std::string::npos)
        << e.what();
  }
  // The refused start dropped the open batch: nothing is open now.
  EXPECT_FALSE(coalescing.open());
  coalescing.start("'tp'");
  coalescing.add(WorkPtr());
  coalescing.add(c10::make_intrusive<ManualWork>(at::ones({1})));
  coalescing.add(c10::make_intrusive<ManualWork>(at::ones({1})));
  const Coalescing::Batch batch = coalescing.end("'tp'");
  EXPECT_EQ(batch.calls, 3u);
  EXPECT_EQ(batch.works.size(), 2u);
  EXPECT_FALSE(coalescing.open());
}

}  // namespace
}  // namespace tpcomm::testing
