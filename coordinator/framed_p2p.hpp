#pragma once
// Point-to-point on the CPU route (Gloo), framed, so that a send and a recv
// that differ raise instead of killing the receiving process (a larger
// send: Gloo's size check aborts it) or filling part of its tensor silently
// (a smaller one).
//
// A send of n bytes is one Gloo message of a 32-byte header (magic, bytes,
// dtype, elements) and the first min(n, kFramedFirstPart) bytes, then, past
// that, a second message with the rest. A recv posts at once a recv of the
// largest first part into a staging buffer (a smaller message fills part of
// it, a larger one cannot come), checks the header when it has come, copies
// the bytes out and only then posts the rest's recv, of the size the header
// announced. Up to kFramedFirstPart a call costs what Gloo's own does, plus
// one copy per side; past it the rest's recv waits for the header.
//
// A mismatch (bytes or dtype) breaks the group (`breakGroup`) with a reason
// naming both sides, before the rest is read: the receiving rank's recv
// raises it, and the sending rank's send is released with it (or, if it
// already completed, its next call on the group raises it).
//
// A recv with a rest has its first part taken by its wait() or, when nobody
// waits on it 200 us after it was made, by a thread of its own (Gloo's recv
// completes only inside a wait). So an irecv nobody waits on yet still
// completes, as Gloo's own does: two ranks that each leave an irecv pending
// and block in a send to the other are never stuck.
//
// `python -m tpcomm.bench p2p` times it against a plain Gloo group.

#include <cstdint>
#include <functional>
#include <string>

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace tpcomm::coord {

// The bytes a send carries in its first message (with the header).
constexpr int64_t kFramedFirstPart = int64_t{256} << 10;

// `tensor`: contiguous; its bytes are sent as they are, whatever its dtype.
c10::intrusive_ptr<c10d::Work> framedSend(const c10::intrusive_ptr<c10d::Backend>& cpu,
                                          const at::Tensor& tensor, int dstRank, int tag);

// `srcRank` -1: from any rank (recvAnysource). `rank`: this rank, for the
// mismatch's reason.
c10::intrusive_ptr<c10d::Work> framedRecv(const c10::intrusive_ptr<c10d::Backend>& cpu,
                                          const at::Tensor& tensor, int srcRank, int tag, int rank,
                                          std::function<void(const std::string&)> breakGroup);

}  // namespace tpcomm::coord
