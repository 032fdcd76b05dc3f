#pragma once
// The bytes of one message of the C++ message queue: raw bytes, or a tensor
// dict whose CPU tensors travel raw in the same message and whose CUDA
// tensors travel over the group's CUDA backend after it.
//
//   Header   magic "TPQ1" (u32), kind (u32: 1 bytes, 2 tensor dict),
//            count (u64: payload bytes, or entries)
//   Entry[count] (tensor dict)
//            name bytes (u32), dtype (u8, c10::ScalarType), device (u8: 0 CPU,
//            1 CUDA), ndim (u16), name, ndim sizes (i64 each)
//   Payload  bytes: `count` bytes; tensor dict: each CPU entry's bytes in
//            entry order (numel x element size, row-major)
//
// Everything read is checked against the message's length before use: a
// bad message throws tpcomm::Error (kSystem) naming what is wrong.

#include <string>
#include <vector>

#include "tpcomm/tpcomm.hpp"

namespace tpcomm::cpp {

struct Frame {
  std::string head;                   // header and entries
  std::vector<at::Tensor> cpuData;    // contiguous CPU tensors, payload order
  std::vector<at::Tensor> cudaData;   // contiguous CUDA tensors, entry order
};

std::string encodeBytes(const std::string& bytes);
// Checks `tensors` (names, dtypes, devices) and lays them out.
Frame encodeTensorDict(const TensorDict& tensors);

// Decodes one message. Bytes: `bytes` holds them. Tensor dict: `tensors`
// holds every entry, CPU ones filled, CUDA ones allocated on the current
// device (their data follows over the CUDA backend, in `cudaNames` order).
struct Decoded {
  bool isBytes = false;
  std::string bytes;
  TensorDict tensors;
  std::vector<std::string> cudaNames;
};
Decoded decode(const char* data, uint64_t length);

}  // namespace tpcomm::cpp
