#pragma once
// TPCOMM_CUDA_CHECK(call): throws tpcomm::Error (code Cuda) with the call's
// text, the CUDA error's name and message, file and line.

#include <cuda_runtime_api.h>

#include "common/error.hpp"

#define TPCOMM_CUDA_CHECK(call)                                                       \
  do {                                                                                \
    const cudaError_t tpcomm_status_ = (call);                                        \
    if (tpcomm_status_ != cudaSuccess) {                                              \
      TPCOMM_THROW(kCuda, #call, " failed: ", cudaGetErrorName(tpcomm_status_), " (", \
                   cudaGetErrorString(tpcomm_status_), ")");                          \
    }                                                                                 \
  } while (0)
