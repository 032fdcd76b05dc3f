#pragma once
// Messages that carry CPU tensors beside a pickle stream ("frames"), for the
// message queue's objects and tensor dicts. The pickle stream refers to its
// tensors by index; their bytes travel raw after it, each 64-byte aligned,
// or stay where they are when they lie in the queue's arena (zero copy).
//
//   +--------------------------------+ 0
//   | FrameHeader                    |  magic "TPQ1", tensors, stream and
//   |                                |  table bytes
//   +--------------------------------+ 24
//   | table: per tensor              |  where (inline / arena), dtype, ndim,
//   |   Entry + int64 shape[ndim]    |  arena slot, offset, bytes, shape
//   +--------------------------------+
//   | pickle stream                  |
//   +--------------------------------+ (64-aligned)
//   | tensor bytes, each 64-aligned  |  offset: from the frame's start
//   +--------------------------------+
//
// A message that is not a frame (a plain pickle stream starts with 0x80) is
// an object without tensors. Every field read back is checked against the
// message's length before it is used: a corrupt or truncated frame raises
// OSError naming what is wrong.

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "message_queue/arena/arena.hpp"
#include "message_queue/ring/ring.hpp"

namespace tpcomm::python {

constexpr uint32_t kFrameMagic = 0x31515054;  // "TPQ1"

// A frame ready to be written: `parts` point into `head`, the stream parts
// and `tensors`, which must stay alive (and unchanged) until it is written.
struct OutgoingFrame {
  std::vector<char> head;  // header and table
  std::vector<at::Tensor> tensors;
  std::vector<mq::Writer::Part> parts;
  // Arena blocks this frame refers to, one entry per tensor placed there.
  std::vector<uint32_t> arenaSlots;
  uint64_t bytes = 0;
};

// Builds a frame of the pickle stream `stream` (parts, back to back) and
// `tensors` (CPU, strided; made contiguous here). With `arena`, a
// contiguous tensor lying inside one of its live blocks is referred to in
// place instead of copied.
OutgoingFrame buildFrame(std::vector<mq::Writer::Part> stream, std::vector<at::Tensor> tensors,
                         mq::Arena* arena);

// Whether `data` starts a frame (else it is a plain pickle stream).
bool isFrame(const char* data, uint64_t bytes);

// The tensors of a received frame held in `message` (uint8, contiguous):
// views of it, or of `arena` for tensors placed there (each view releases
// its block when it dies). `streamOffset`/`streamBytes` locate the pickle
// stream inside `message`.
struct IncomingFrame {
  std::vector<at::Tensor> tensors;
  uint64_t streamOffset = 0;
  uint64_t streamBytes = 0;
};
IncomingFrame parseFrame(const at::Tensor& message, const std::shared_ptr<mq::Arena>& arena);

}  // namespace tpcomm::python
