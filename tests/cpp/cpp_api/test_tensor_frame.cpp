// The C++ message queue's message layout: every dtype and shape round-trips
// bit for bit, and a damaged message throws instead of reading past its end.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstring>

#include "common/error.hpp"
#include "cpp/src/tensor_frame.hpp"

namespace tpcomm::cpp {
namespace {

std::string flatten(const Frame& frame) {
  std::string bytes = frame.head;
  for (const auto& t : frame.cpuData) {
    bytes.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
  }
  return bytes;
}

TEST(TensorFrame, EveryDtypeAndShapeRoundTrips) {
  TensorDict in;
  const std::vector<at::ScalarType> types = {
      at::kByte,  at::kChar,   at::kShort,    at::kInt,          at::kLong,
      at::kHalf,  at::kFloat,  at::kDouble,   at::kComplexFloat, at::kBool,
      at::kBFloat16, at::kUInt16, at::kFloat8_e4m3fn};
  const std::vector<std::vector<int64_t>> shapes = {{}, {0}, {1}, {7}, {3, 5}, {2, 0, 4}, {2, 3, 1, 5}};
  int i = 0;
  for (auto type : types) {
    for (const auto& shape : shapes) {
      at::Tensor t = at::randint(0, 100, shape, at::kLong).to(type);
      in["t" + std::to_string(i++)] = t;
    }
  }
  in["strided"] = at::arange(24, at::kFloat).reshape({4, 6}).t();  // not contiguous
  const std::string bytes = flatten(encodeTensorDict(in));
  const Decoded out = decode(bytes.data(), bytes.size());
  ASSERT_FALSE(out.isBytes);
  ASSERT_EQ(out.tensors.size(), in.size());
  EXPECT_TRUE(out.cudaNames.empty());
  for (const auto& [name, t] : in) {
    const at::Tensor& got = out.tensors.at(name);
    EXPECT_EQ(got.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(got.sizes(), t.sizes()) << name;
    ASSERT_EQ(got.nbytes(), t.nbytes()) << name;
    EXPECT_EQ(std::memcmp(got.data_ptr(), t.contiguous().data_ptr(), t.nbytes()), 0) << name;
  }
}

// A lazy conjugate or negation travels as its values.
TEST(TensorFrame, ConjugateAndNegativeViewsTravelAsTheirValues) {
  const at::Tensor z = at::complex(at::arange(4, at::kFloat), at::ones({4}));
  const TensorDict in{{"conj", z.conj()}, {"neg", at::imag(z.conj())}};
  const std::string bytes = flatten(encodeTensorDict(in));
  const Decoded out = decode(bytes.data(), bytes.size());
  EXPECT_TRUE(at::equal(out.tensors.at("conj"), z.conj().resolve_conj()));
  EXPECT_TRUE(at::equal(out.tensors.at("neg"), at::full({4}, -1.0f)));
}

TEST(TensorFrame, BytesRoundTripIncludingEmptyAndZeros) {
  for (const std::string payload : {std::string(), std::string("a"), std::string(1000, '\0')}) {
    const std::string bytes = encodeBytes(payload) + payload;
    const Decoded out = decode(bytes.data(), bytes.size());
    ASSERT_TRUE(out.isBytes);
    EXPECT_EQ(out.bytes, payload);
  }
}

// Every cut of a valid message throws (the codec never reads past the end).
TEST(TensorFrame, EveryTruncationThrows) {
  TensorDict in{{"a", at::arange(10, at::kFloat)}, {"bb", at::ones({2, 3}, at::kLong)}};
  const std::string bytes = flatten(encodeTensorDict(in));
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    const std::string part = bytes.substr(0, cut);
    EXPECT_THROW(decode(part.data(), part.size()), tpcomm::Error) << "cut at " << cut;
  }
  const std::string longer = bytes + "x";
  EXPECT_THROW(decode(longer.data(), longer.size()), tpcomm::Error);
}

TEST(TensorFrame, DamagedFieldsAreNamed) {
  const TensorDict in{{"a", at::arange(4, at::kFloat)}};
  const std::string good = flatten(encodeTensorDict(in));
  const auto expectMessage = [](std::string bytes, const std::string& needle) {
    try {
      decode(bytes.data(), bytes.size());
      ADD_FAILURE() << "no throw for " << needle;
    } catch (const tpcomm::Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kSystem);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  std::string bad = good;
  bad[0] ^= 1;
  expectMessage(bad, "magic");
  bad = good;
  bad[4] = 9;  // kind
  expectMessage(bad, "unknown message kind");
  bad = good;
  bad[8] = static_cast<char>(0xff);  // entry count: more entries than bytes
  expectMessage(bad, "entries in");
  bad = good;
  bad[16 + 4] = static_cast<char>(200);  // the entry's dtype code
  expectMessage(bad, "dtype code");
  bad = good;
  bad[16 + 6] = 65;  // ndim
  expectMessage(bad, "dimensions");
  bad = good;
  const int64_t negative = -1;
  std::memcpy(bad.data() + 16 + 8 + 1, &negative, sizeof(negative));  // after name "a"
  expectMessage(bad, "has size -1");
}

TEST(TensorFrame, RefusesWhatItCannotCarry) {
  EXPECT_THROW(encodeTensorDict({{"u", at::Tensor()}}), tpcomm::Error);
  EXPECT_THROW(encodeTensorDict({{"s", at::ones({2, 2}).to_sparse()}}), tpcomm::Error);
  EXPECT_THROW(encodeTensorDict({{"q", at::quantize_per_tensor(at::ones({2}), 0.1, 0, at::kQInt8)}}),
               tpcomm::Error);
}

}  // namespace
}  // namespace tpcomm::cpp
