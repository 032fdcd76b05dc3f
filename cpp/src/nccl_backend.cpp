// torch's ProcessGroupNCCL made from C++: the device group of a tpcomm group
// made through the C++ interface (Python makes it through torch's bindings).
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "common/error.hpp"
#include "cpp/src/torch_backends.hpp"

namespace tpcomm::cpp {

coord::BackendFactory ncclFactory() {
  return [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
            std::chrono::milliseconds timeout) -> c10::intrusive_ptr<c10d::Backend> {
    // Options are allocated here with the size this build's nccl.h gives
    // them (its ncclConfig_t): only the NCCL torch was built with fits.
    TPCOMM_CHECK(std::string(TPCOMM_NCCL_HEADER_VERSION) == TPCOMM_TORCH_NCCL_VERSION, kSystem,
                 "tpcomm's C++ interface was built with NCCL ", TPCOMM_NCCL_HEADER_VERSION,
                 "'s header but torch uses NCCL '", TPCOMM_TORCH_NCCL_VERSION,
                 "': it cannot make torch's ProcessGroupNCCL (rebuild tpcomm with the "
                 "nvidia-nccl wheel torch pins)");
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    return checkMade(c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options),
                     "nccl", rank, size);
  };
}

}  // namespace tpcomm::cpp
