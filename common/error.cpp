#include "common/error.hpp"

namespace tpcomm {

const char* errorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidUsage:
      return "InvalidUsage";
    case ErrorCode::kTimeout:
      return "Timeout";
    case ErrorCode::kPeerLost:
      return "PeerLost";
    case ErrorCode::kCuda:
      return "Cuda";
    case ErrorCode::kSystem:
      return "System";
  }
  return "Unknown";
}

Error::Error(ErrorCode code, const std::string& message)
    : std::runtime_error(message), code_(code) {}

namespace detail {

[[noreturn]] void throwError(ErrorCode code, const char* file, int line,
                             const std::string& message) {
  const char* base = file;
  for (const char* p = file; *p != '\0'; ++p) {
    if (*p == '/') base = p + 1;
  }
  throw Error(code,
              concat("tpcomm ", errorCodeName(code), ": ", message, " (", base, ":", line, ")"));
}

}  // namespace detail
}  // namespace tpcomm
