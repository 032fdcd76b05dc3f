#pragma once
// The project's one error type and its check macros.
//
// Every layer (backend, coordinator, custom_allreduce, message_queue) throws
// tpcomm::Error; this folder includes nothing else of the project, so any
// layer may include it. At the c10d Backend boundary argument errors become
// c10::Error (TORCH_CHECK) and communication failures c10d::DistBackendError.
//
// Library code never calls exit() or abort(): a failed check throws.

#include <cstdint>
#include <cstdio>
#include <iterator>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace tpcomm {

enum class ErrorCode {
  kInvalidUsage,  // the caller passed something wrong; nothing was sent
  kTimeout,       // a bounded wait ran out
  kPeerLost,      // a peer died or left mid-operation
  kCuda,          // a CUDA runtime or kernel error
  kSystem,        // an OS call failed (errno attached in the message)
};

// "InvalidUsage", "Timeout", ...
const char* errorCodeName(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message);
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

namespace detail {

// Message formatting without iostreams: torch's libc10 exports its own weak
// copies of std::ostringstream, and an extension built by another compiler
// that binds to them crashes (seen with gcc 13). Supported pieces: strings,
// characters, booleans, numbers, addresses, anything with str() (c10::Device), and
// ranges of those (IntArrayRef, std::vector) printed as "[a, b]".
inline void append(std::string& out, const std::string& s) { out += s; }
inline void append(std::string& out, std::string_view s) { out.append(s); }
inline void append(std::string& out, const char* s) { out += s; }
inline void append(std::string& out, char c) { out += c; }
inline void append(std::string& out, bool b) { out += b ? "true" : "false"; }
// Addresses in hex ("0x7f..."); without this a pointer would print as a bool.
inline void append(std::string& out, const void* p) {
  char text[2 + 2 * sizeof(void*) + 1];
  std::snprintf(text, sizeof(text), "0x%llx",
                static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p)));
  out += text;
}

template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
void append(std::string& out, T value) {
  out += std::to_string(value);
}

template <typename T>
auto append(std::string& out, const T& value) -> decltype(value.str(), void()) {
  out += value.str();
}

template <typename T>
auto append(std::string& out, const T& range)
    -> decltype(std::begin(range), std::end(range), void()) {
  out += '[';
  bool first = true;
  for (const auto& item : range) {
    if (!first) out += ", ";
    first = false;
    append(out, item);
  }
  out += ']';
}

// The fields of `text` split at `separator` (a final separator adds no
// empty field; no iostreams: see test_registration.py).
inline std::vector<std::string> splitAt(const std::string& text, char separator) {
  std::vector<std::string> fields;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find(separator, at);
    if (end == std::string::npos) end = text.size();
    fields.push_back(text.substr(at, end - at));
    at = end + 1;
  }
  return fields;
}

// `text` up to its first newline.
inline std::string firstLine(const std::string& text) { return text.substr(0, text.find('\n')); }

// `text`'s bytes, as a store's values are.
inline std::vector<uint8_t> bytesOf(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

// The lines of `text` (split at '\n'; a final newline adds no empty line).
inline std::vector<std::string> splitLines(const std::string& text) {
  return splitAt(text, '\n');
}

template <typename... Args>
std::string concat(const Args&... args) {
  std::string out;
  (append(out, args), ...);
  return out;
}

// Builds "tpcomm <Code>: <message> (at file:line)" and throws it.
[[noreturn]] void throwError(ErrorCode code, const char* file, int line,
                             const std::string& message);

}  // namespace detail
}  // namespace tpcomm

#define TPCOMM_THROW(code, ...)                                               \
  ::tpcomm::detail::throwError(::tpcomm::ErrorCode::code, __FILE__, __LINE__, \
                               ::tpcomm::detail::concat(__VA_ARGS__))

// TPCOMM_CHECK(cond, kInvalidUsage, "what went wrong ", value);
#define TPCOMM_CHECK(cond, code, ...)      \
  do {                                     \
    if (!(cond)) {                         \
      TPCOMM_THROW(code, "", __VA_ARGS__); \
    }                                      \
  } while (0)

// Binary checks print both operands: "expected a == b (3 vs 4): message".
#define TPCOMM_CHECK_OP_(a, b, op, code, ...)                                                  \
  do {                                                                                         \
    const auto& tpcomm_lhs_ = (a);                                                             \
    const auto& tpcomm_rhs_ = (b);                                                             \
    if (!(tpcomm_lhs_ op tpcomm_rhs_)) {                                                       \
      TPCOMM_THROW(code, "expected " #a " " #op " " #b " (", tpcomm_lhs_, " vs ", tpcomm_rhs_, \
                   ") ", ##__VA_ARGS__);                                                       \
    }                                                                                          \
  } while (0)

#define TPCOMM_CHECK_EQ(a, b, ...) TPCOMM_CHECK_OP_(a, b, ==, kInvalidUsage, ##__VA_ARGS__)
#define TPCOMM_CHECK_NE(a, b, ...) TPCOMM_CHECK_OP_(a, b, !=, kInvalidUsage, ##__VA_ARGS__)
#define TPCOMM_CHECK_LT(a, b, ...) TPCOMM_CHECK_OP_(a, b, <, kInvalidUsage, ##__VA_ARGS__)
#define TPCOMM_CHECK_LE(a, b, ...) TPCOMM_CHECK_OP_(a, b, <=, kInvalidUsage, ##__VA_ARGS__)
#define TPCOMM_CHECK_GT(a, b, ...) TPCOMM_CHECK_OP_(a, b, >, kInvalidUsage, ##__VA_ARGS__)
#define TPCOMM_CHECK_GE(a, b, ...) TPCOMM_CHECK_OP_(a, b, >=, kInvalidUsage, ##__VA_ARGS__)
