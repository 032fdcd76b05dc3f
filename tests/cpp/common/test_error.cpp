#include <gtest/gtest.h>

#include "common/error.hpp"

namespace tpcomm {
namespace {

TEST(Error, CodeNames) {
  EXPECT_STREQ(errorCodeName(ErrorCode::kInvalidUsage), "InvalidUsage");
  EXPECT_STREQ(errorCodeName(ErrorCode::kTimeout), "Timeout");
  EXPECT_STREQ(errorCodeName(ErrorCode::kPeerLost), "PeerLost");
  EXPECT_STREQ(errorCodeName(ErrorCode::kCuda), "Cuda");
  EXPECT_STREQ(errorCodeName(ErrorCode::kSystem), "System");
}

TEST(Error, ThrowCarriesCodeMessageAndLocation) {
  try {
    TPCOMM_THROW(kTimeout, "peer ", 3, " did not arrive");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    const std::string what = e.what();
    EXPECT_NE(what.find("tpcomm Timeout: peer 3 did not arrive"), std::string::npos) << what;
    EXPECT_NE(what.find("test_error.cpp:"), std::string::npos) << what;
  }
}

TEST(Error, CheckEqPrintsBothOperandsAndExpression) {
  const int expected = 4;
  const int actual = 3;
  try {
    TPCOMM_CHECK_EQ(actual, expected, "while testing");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
    const std::string what = e.what();
    EXPECT_NE(what.find("expected actual == expected (3 vs 4) while testing"), std::string::npos)
        << what;
  }
}

TEST(Error, ChecksPassQuietlyWhenTrue) {
  EXPECT_NO_THROW(TPCOMM_CHECK_EQ(1, 1));
  EXPECT_NO_THROW(TPCOMM_CHECK_LT(1, 2));
  EXPECT_NO_THROW(TPCOMM_CHECK_GE(2, 2));
  EXPECT_NO_THROW(TPCOMM_CHECK(true, kSystem, "unused"));
  EXPECT_THROW(TPCOMM_CHECK_NE(1, 1), Error);
  EXPECT_THROW(TPCOMM_CHECK_GT(1, 1), Error);
  EXPECT_THROW(TPCOMM_CHECK_LE(2, 1), Error);
}

TEST(Error, CheckKeepsItsCode) {
  try {
    TPCOMM_CHECK(false, kPeerLost, "rank ", 2, " died");
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kPeerLost);
    EXPECT_NE(std::string(e.what()).find("rank 2 died"), std::string::npos);
  }
}

}  // namespace
}  // namespace tpcomm

TEST(Error, AddressesPrintInHexNotAsBooleans) {
  int value = 0;
  const void* p = &value;
  char want[32];
  std::snprintf(want, sizeof(want), "0x%llx",
                static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p)));
  EXPECT_EQ(tpcomm::detail::concat("at ", p), std::string("at ") + want);
  EXPECT_EQ(tpcomm::detail::concat(static_cast<void*>(nullptr)), "0x0");
  EXPECT_EQ(tpcomm::detail::concat(true, " ", "text"), "true text");  // still a bool, a string
}

TEST(Error, SplitLinesKeepsEmptyLinesButNoTrailingOne) {
  using tpcomm::detail::splitLines;
  EXPECT_EQ(splitLines(""), std::vector<std::string>{});
  EXPECT_EQ(splitLines("a\nb"), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(splitLines("a\n\nb\n"), (std::vector<std::string>{"a", "", "b"}));
}
