// The steps between hosts of a group across hosts (cpu_hier_path.hpp has the
// algorithms' table): Bruck's gather of the hosts' call descriptions, the
// reduce-scatter and all-gather of large allreduces, the broadcast, each
// through Gloo's point-to-point sends and receives.
#include <algorithm>
#include <cstring>

#include "common/error.hpp"
#include "coordinator/cpu/cpu_hier_call.hpp"
#include "coordinator/cpu/cpu_hier_path.hpp"
#include "coordinator/faults/group_fault.hpp"
#include "message_queue/collectives/shm_reduce.hpp"

namespace tpcomm::coord {

namespace {

constexpr int kDescriptionTag = 0x7470;  // + round (Bruck's gather)
constexpr int kPayloadTag = 0x7480;
constexpr int kAllgatherTag = 0x7481;

// Waits for every one of `works` within one deadline `timeout` from now.
// On a failure it still waits for the others (each fails at once when its
// peer is gone, else by the deadline), so that no send or receive outlives
// the call whose memory it uses; then rethrows the first failure.
void waitAll(std::vector<c10::intrusive_ptr<c10d::Work>>& works,
             std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::exception_ptr first;
  for (auto& w : works) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    try {
      if (!waitWork(*w, std::max(left, std::chrono::milliseconds(1)))) {
        TPCOMM_THROW(kTimeout, "timed out after ", timeout.count(), " ms");
      }
    } catch (...) {
      if (!first) first = std::current_exception();
      w->abort();
    }
  }
  if (first) std::rethrow_exception(first);
}

at::Tensor bytesAt(const void* p, size_t bytes) {
  return at::from_blob(const_cast<void*>(p), {static_cast<int64_t>(bytes)},
                       at::TensorOptions().dtype(at::kByte));
}

// One round of point-to-point messages: each `sends[i]` to its peer, each
// `recvs[i]` from its peer, all posted at once, then waited for.
struct Message {
  int peer;
  at::Tensor bytes;
};
void round(c10d::Backend& backend, const std::vector<Message>& sends,
           const std::vector<Message>& recvs, int tag, std::chrono::milliseconds timeout) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<std::vector<at::Tensor>> buffers;
  buffers.reserve(sends.size() + recvs.size());
  for (const auto& m : recvs) {
    if (m.bytes.numel() == 0) continue;
    buffers.push_back({m.bytes});
    works.push_back(backend.recv(buffers.back(), m.peer, tag));
  }
  for (const auto& m : sends) {
    if (m.bytes.numel() == 0) continue;
    buffers.push_back({m.bytes});
    works.push_back(backend.send(buffers.back(), m.peer, tag));
  }
  waitAll(works, timeout);
}

// Bruck's all-gather of `block`-byte blocks among `hosts` (this one `me`):
// block 0 of `all` holds this host's on entry; on return block i holds host
// (me + i) mod hosts's. Round k sends the first min(2^k, hosts - 2^k)
// blocks to host me - 2^k and receives as many from host me + 2^k into
// blocks 2^k on: ceil(log2 hosts) rounds, hosts - 1 blocks sent in all.
void bruckGather(c10d::Backend& backend, int me, int hosts, at::Tensor& all, size_t block,
                 std::chrono::milliseconds timeout) {
  int roundIndex = 0;
  for (int dist = 1; dist < hosts; dist *= 2, ++roundIndex) {
    const int64_t count = std::min(dist, hosts - dist);
    const int64_t bytes = count * static_cast<int64_t>(block);
    round(backend, {{(me - dist + hosts) % hosts, all.narrow(0, 0, bytes)}},
          {{(me + dist) % hosts, all.narrow(0, dist * static_cast<int64_t>(block), bytes)}},
          kDescriptionTag + roundIndex, timeout);
  }
}

// Chunk h of `count` elements split among `hosts`: [first, first + size).
struct Chunk {
  size_t first;
  size_t size;
};
Chunk chunkOf(size_t count, int hosts, int h) {
  const size_t first = count * h / hosts;
  return {first, count * (h + 1) / hosts - first};
}

}  // namespace

void HierGroup::failBetweenHosts(const Call& call, const std::exception& e) {
  const HostLayout& l = layout();
  std::string others;
  for (int h = 0; h < l.hosts(); ++h) {
    if (h != l.host()) others += (others.empty() ? "" : ", ") + l.describeHost(h);
  }
  const std::string what = detail::concat(
      l.hosts() == 2 ? "" : "one of ", others, " went away or failed during ", call.describe(),
      " (group rank ", l.rank, " on ", l.describeHost(l.host()), "): ", e.what());
  abort(what);
  const std::string text = e.what();
  if (text.find("imed out") != std::string::npos || text.find("imeout") != std::string::npos)
    TPCOMM_THROW(kTimeout, what);
  TPCOMM_THROW(kPeerLost, what);
}

void HierGroup::checkCalls(const Call& mine, const std::vector<Call>& theirs) {
  const HostLayout& l = layout();
  for (int h = 0; h < static_cast<int>(theirs.size()); ++h) {
    if (theirs[h] == mine) continue;
    const std::string what =
        detail::concat("mismatched collectives across hosts: ", l.describeHost(l.host()), " calls ",
                       mine.describe(), " but ", l.describeHost(h), " calls ", theirs[h].describe(),
                       " (every rank must issue the same collectives in the same order)");
    abort(what);
    TPCOMM_THROW(kInvalidUsage, what);
  }
}

HierGroup::Received HierGroup::gatherBetweenHosts(c10d::Backend& backend, const Call& call,
                                                  const void* payload, size_t bytes) {
  // Round 1, blocks of one size whatever the call (Gloo ends the process on
  // a size mismatch): the description, and the payload if it fits. Then,
  // once every host described the same call, the payload to every host.
  const int hosts = layout().hosts();
  const int me = layout().host();
  const size_t inlineBytes = parts_.inlineBytes;
  const size_t fixed = hier::kCallBytes + inlineBytes;
  const bool inlined = bytes <= inlineBytes;
  Received out;
  out.hosts = hosts;
  out.buffer = scratch(kDescriptionsSlot, fixed * hosts);
  auto* block = static_cast<char*>(out.buffer.data_ptr());
  std::memcpy(block, &call, hier::kCallBytes);
  if (inlined && bytes > 0) std::memcpy(block + hier::kCallBytes, payload, bytes);
  std::memset(block + hier::kCallBytes + (inlined ? bytes : 0), 0,
              inlineBytes - (inlined ? bytes : 0));
  try {
    bruckGather(backend, me, hosts, out.buffer, fixed, parts_.timeout);
  } catch (const std::exception& e) {
    failBetweenHosts(call, e);
  }
  out.rotation = me;
  out.stride = fixed;
  std::vector<Call> theirs(hosts);
  for (int h = 0; h < hosts; ++h) std::memcpy(&theirs[h], out.source(h), hier::kCallBytes);
  checkCalls(call, theirs);
  out.offset = hier::kCallBytes;
  if (inlined) return out;

  Received full;
  full.hosts = hosts;
  full.stride = bytes;
  full.buffer = scratch(kPayloadsSlot, bytes * hosts);
  char* all = static_cast<char*>(full.buffer.data_ptr());
  std::memcpy(all + me * bytes, payload, bytes);
  std::vector<Message> sends, recvs;
  for (int h = 0; h < hosts; ++h) {
    if (h == me) continue;
    sends.push_back({h, bytesAt(payload, bytes)});
    recvs.push_back({h, full.buffer.narrow(0, h * static_cast<int64_t>(bytes), bytes)});
  }
  try {
    round(backend, sends, recvs, kPayloadTag, parts_.timeout);
  } catch (const std::exception& e) {
    failBetweenHosts(call, e);
  }
  return full;
}

void HierGroup::reduceHosts(const Received& received, void* out, size_t count, mq::DType dtype,
                            const mq::ReduceSpec& spec) {
  const int hosts = layout().hosts();
  std::vector<const void*> sources(hosts);
  for (int h = 0; h < hosts; ++h) sources[h] = received.source(h);
  mq::ReduceSpec between;
  between.kind = spec.kind;
  between.divisor = spec.divisor;
  mq::reduceIntoWith(reduceIsa(), out, sources.data(), hosts, count, dtype, between);
}

void HierGroup::allreduceBetweenHosts(c10d::Backend& backend, const Call& call, void* data,
                                      size_t count, mq::DType dtype, const mq::ReduceSpec& spec) {
  const size_t esize = mq::dtypeBytes(dtype);
  if (count * esize <= parts_.gatherMaxBytes) {
    reduceHosts(gatherBetweenHosts(backend, call, data, count * esize), data, count, dtype, spec);
    return;
  }
  gatherBetweenHosts(backend, call, nullptr, 0);  // the descriptions, checked
  // Reduce-scatter: host h receives chunk h of every host and reduces it in
  // host order; then the chunks go to every host.
  const int hosts = layout().hosts();
  const int me = layout().host();
  char* bytes = static_cast<char*>(data);
  const Chunk mine = chunkOf(count, hosts, me);
  at::Tensor parts = scratch(kPayloadsSlot, mine.size * esize * hosts);
  char* part = static_cast<char*>(parts.data_ptr());
  const int64_t partBytes = static_cast<int64_t>(mine.size * esize);
  if (partBytes > 0) std::memcpy(part + me * partBytes, bytes + mine.first * esize, partBytes);
  std::vector<Message> sends, recvs;
  for (int h = 0; h < hosts; ++h) {
    if (h == me) continue;
    const Chunk theirs = chunkOf(count, hosts, h);
    sends.push_back({h, bytesAt(bytes + theirs.first * esize, theirs.size * esize)});
    recvs.push_back({h, parts.narrow(0, h * partBytes, partBytes)});
  }
  try {
    round(backend, sends, recvs, kPayloadTag, parts_.timeout);
  } catch (const std::exception& e) {
    failBetweenHosts(call, e);
  }
  Received received;
  received.buffer = parts;
  received.stride = static_cast<size_t>(partBytes);
  received.hosts = hosts;
  reduceHosts(received, bytes + mine.first * esize, mine.size, dtype, spec);
  // All-gather of the reduced chunks.
  sends.clear();
  recvs.clear();
  for (int h = 0; h < hosts; ++h) {
    if (h == me) continue;
    const Chunk theirs = chunkOf(count, hosts, h);
    sends.push_back({h, bytesAt(bytes + mine.first * esize, mine.size * esize)});
    recvs.push_back({h, bytesAt(bytes + theirs.first * esize, theirs.size * esize)});
  }
  try {
    round(backend, sends, recvs, kAllgatherTag, parts_.timeout);
  } catch (const std::exception& e) {
    failBetweenHosts(call, e);
  }
}

void HierGroup::reduceScatterBetweenHosts(const Call& call, const char* whole, size_t count,
                                          mq::DType dtype, const mq::ReduceSpec& spec,
                                          char* mine) {
  // Host h receives, from every host, that host's partial of host h's
  // ranks' parts, and reduces them in host order.
  gatherBetweenHosts(*parts_.leaders, call, nullptr, 0);
  const HostLayout& l = layout();
  const int hosts = l.hosts();
  const int me = l.host();
  const size_t part = count * mq::dtypeBytes(dtype);
  const size_t ours = l.ranksOn[me].size() * part;
  // This host's partial of each host's ranks' parts, each host's together.
  std::vector<at::Tensor> outgoing(hosts);
  at::Tensor parts = scratch(kPayloadsSlot, ours * hosts);
  char* received = static_cast<char*>(parts.data_ptr());
  std::vector<Message> sends, recvs;
  for (int h = 0; h < hosts; ++h) {
    const auto& ranks = l.ranksOn[h];
    char* target = h == me ? received + me * ours : nullptr;
    if (h != me) {
      outgoing[h] = at::empty({static_cast<int64_t>(ranks.size() * part)},
                              at::TensorOptions().dtype(at::kByte));
      target = static_cast<char*>(outgoing[h].data_ptr());
      sends.push_back({h, outgoing[h]});
      recvs.push_back({h, parts.narrow(0, h * static_cast<int64_t>(ours), ours)});
    }
    for (size_t i = 0; i < ranks.size() && part > 0; ++i) {
      std::memcpy(target + i * part, whole + ranks[i] * part, part);
    }
  }
  try {
    round(*parts_.leaders, sends, recvs, kPayloadTag, parts_.timeout);
  } catch (const std::exception& e) {
    failBetweenHosts(call, e);
  }
  Received all;
  all.buffer = parts;
  all.stride = ours;
  all.hosts = hosts;
  reduceHosts(all, mine, count * l.ranksOn[me].size(), dtype, spec);
}

void HierGroup::broadcastBetweenHosts(const Call& call, void* data, size_t bytes, int rootHost) {
  // The descriptions (and the root's data when it fits), then the rest:
  // up to the gather size from the root's leader to every host; larger, a
  // scatter of chunks from it, then an all-gather of the chunks.
  const int hosts = layout().hosts();
  const int me = layout().host();
  const bool root = me == rootHost;
  const bool inlined = bytes <= parts_.inlineBytes;
  const Received first =
      gatherBetweenHosts(*parts_.leaders, call, data, root && inlined ? bytes : 0);
  if (bytes == 0) return;
  if (inlined) {
    if (!root) std::memcpy(data, first.source(rootHost), bytes);
    return;
  }
  char* message = static_cast<char*>(data);
  try {
    std::vector<Message> sends, recvs;
    if (bytes <= parts_.gatherMaxBytes) {
      for (int h = 0; h < hosts && root; ++h) {
        if (h != rootHost) sends.push_back({h, bytesAt(message, bytes)});
      }
      if (!root) recvs.push_back({rootHost, bytesAt(message, bytes)});
      round(*parts_.leaders, sends, recvs, kPayloadTag, parts_.timeout);
      return;
    }
    for (int h = 0; h < hosts && root; ++h) {
      const Chunk c = chunkOf(bytes, hosts, h);
      if (h != rootHost) sends.push_back({h, bytesAt(message + c.first, c.size)});
    }
    const Chunk mine = chunkOf(bytes, hosts, me);
    if (!root) recvs.push_back({rootHost, bytesAt(message + mine.first, mine.size)});
    round(*parts_.leaders, sends, recvs, kPayloadTag, parts_.timeout);
    sends.clear();
    recvs.clear();
    // (The root has every chunk: nothing goes back to it.)
    for (int h = 0; h < hosts; ++h) {
      if (h == me) continue;
      const Chunk theirs = chunkOf(bytes, hosts, h);
      if (h != rootHost) sends.push_back({h, bytesAt(message + mine.first, mine.size)});
      if (!root) recvs.push_back({h, bytesAt(message + theirs.first, theirs.size)});
    }
    round(*parts_.leaders, sends, recvs, kAllgatherTag, parts_.timeout);
  } catch (const std::exception& e) {
    failBetweenHosts(call, e);
  }
}

}  // namespace tpcomm::coord
