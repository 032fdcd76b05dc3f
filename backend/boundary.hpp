#pragma once
// The c10d Backend boundary: tpcomm::Error becomes what torch's callers
// expect (argument errors c10::Error, the rest c10d::DistBackendError).

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/exception.h>

#include "common/error.hpp"

namespace tpcomm::backend {

template <typename F>
auto translateErrors(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const tpcomm::Error& e) {
    if (e.code() == ErrorCode::kInvalidUsage) {
      TORCH_CHECK(false, e.what());
    }
    C10_THROW_ERROR(DistBackendError, e.what());
  }
}

}  // namespace tpcomm::backend
