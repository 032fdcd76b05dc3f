#pragma once
// Declarations only (see ../README.md). ProcessGroupGloo.hpp holds contexts
// through shared_ptr and names one method in an inline body tpcomm never
// emits (the class's vtable lives in torch).
#include <chrono>

namespace gloo {

class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);
};

}  // namespace gloo
