#include "coordinator/cpu/cpu_hier_path.hpp"

#include <algorithm>
#include <cstring>

#include "coordinator/common/error.hpp"
#include "coordinator/faults/group_fault.hpp"
#include "message_queue/collectives/shm_reduce.hpp"

namespace tpcomm::coord {

// ---- the call's description --------------------------------------------------

namespace {

constexpr uint64_t kCallMagic = 0x7470636f6d6d6831ULL;  // "tpcommh1"
constexpr size_t kCallBytes = 64;
// Payload bytes that travel with a call's description between hosts (one
// round); larger ones follow in a second round.
constexpr size_t kInlineBytes = 4096;

enum class HierOp : uint32_t { kAllreduce = 1, kAllgather, kReduceScatter, kBroadcast, kBarrier };

const char* hierOpName(uint32_t op) {
  switch (static_cast<HierOp>(op)) {
    case HierOp::kAllreduce:
      return "allreduce";
    case HierOp::kAllgather:
      return "all_gather";
    case HierOp::kReduceScatter:
      return "reduce_scatter";
    case HierOp::kBroadcast:
      return "broadcast";
    case HierOp::kBarrier:
      return "barrier";
  }
  return "unknown call";
}

// The reduction's code in a description: kind, AVG, PREMUL_SUM.
uint32_t reductionCode(const mq::ReduceSpec& spec) {
  return static_cast<uint32_t>(spec.kind) | (spec.divisor != 1 ? 16u : 0u) |
         (spec.premultiply ? 32u : 0u);
}

}  // namespace

struct HierGroup::Call {
  uint64_t magic = kCallMagic;
  uint64_t number = 0;
  uint32_t op = 0;
  uint32_t dtype = 0xff;  // none
  uint64_t count = 0;     // elements (bytes for all-gather and broadcast)
  int64_t root = -1;
  uint32_t reduction = 0xff;  // none
  uint32_t partIndex = 0;
  uint32_t partOf = 1;
  uint32_t pad[3] = {0, 0, 0};

  std::string describe() const {
    if (magic != kCallMagic) return "something that is not a tpcomm call";
    std::string out = hierOpName(op);
    if (reduction != 0xff) {
      std::string how = mq::reduceKindName(static_cast<mq::ReduceKind>(reduction & 15));
      if (reduction & 16) how = "avg";
      if (reduction & 32) how = "premul_sum";
      out += " " + how;
    }
    if (dtype != 0xff) {
      out += detail::concat(" ", mq::dtypeName(static_cast<mq::DType>(dtype)), "[", count, "]");
    } else if (static_cast<HierOp>(op) != HierOp::kBarrier) {
      out += detail::concat(" of ", count, " B");
    }
    if (root >= 0) out += detail::concat(" root=", root);
    if (partOf > 1) out += detail::concat(" (tensor ", partIndex + 1, " of ", partOf, ")");
    return out + detail::concat(" (call #", number, ")");
  }
  bool operator==(const Call& o) const { return std::memcmp(this, &o, sizeof(Call)) == 0; }
};
static_assert(sizeof(HierGroup::Call) == kCallBytes, "a call's description is one cache line");

// ---- HierGroup ---------------------------------------------------------------

HierGroup::HierGroup(Parts parts) : parts_(std::move(parts)) {
  reduceIsa_.store(parts_.reduceIsa);
  if (parts_.local) {
    parts_.local->setTimeout(2 * parts_.timeout);
    parts_.local->setReduceIsa(parts_.reduceIsa);
  }
}

void HierGroup::setReduceIsa(mq::ReduceIsa isa) {
  if (!mq::cpuRunsReduceIsa(isa)) isa = mq::bestReduceIsa();
  reduceIsa_.store(isa);
  if (parts_.local) parts_.local->setReduceIsa(isa);
}

HierGroup::~HierGroup() = default;

at::Tensor HierGroup::scratch(int slot, size_t bytes) {
  at::Tensor& t = scratch_[slot];
  if (!t.defined() || static_cast<size_t>(t.numel()) < bytes) {
    t = at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 64))},
                  at::TensorOptions().dtype(at::kByte));
  }
  return t.narrow(0, 0, static_cast<int64_t>(bytes));
}

void HierGroup::setTimeout(std::chrono::milliseconds timeout) {
  parts_.timeout = timeout;
  if (parts_.local) parts_.local->setTimeout(2 * timeout);
  if (parts_.leaders) parts_.leaders->setTimeout(timeout);
  if (parts_.slices && parts_.slices != parts_.leaders) parts_.slices->setTimeout(timeout);
}

std::string HierGroup::failure() const {
  std::lock_guard<std::mutex> lock(failureMutex_);
  return failure_;
}

void HierGroup::abort(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(failureMutex_);
    if (failure_.empty()) failure_ = why;
  }
  if (parts_.local) parts_.local->abort(why);
}

HierGroup::Call HierGroup::nextCall(uint32_t op) {
  Call call;
  call.number = ++calls_;
  call.op = op;
  return call;
}

void HierGroup::throwIfFailed() const {
  const std::string earlier = failure();
  TPCOMM_CHECK(earlier.empty(), kPeerLost,
               "the group's collectives across hosts stopped after an earlier failure: ", earlier);
}

template <typename Fn>
void HierGroup::onHost(const Fn& fn) {
  if (!parts_.local) return;
  try {
    fn(*parts_.local);
  } catch (const Error& e) {
    const std::string what = detail::concat("on ", layout().describeHost(layout().host()),
                                            ", the shared-memory step failed: ", e.what());
    {
      std::lock_guard<std::mutex> lock(failureMutex_);
      if (failure_.empty()) failure_ = what;
    }
    throw Error(e.code(), what);
  }
}

void HierGroup::failBetweenHosts(const Call& call, const std::exception& e) {
  const HostLayout& l = layout();
  std::string others;
  for (int h = 0; h < l.hosts(); ++h) {
    if (h != l.host()) others += (others.empty() ? "" : ", ") + l.describeHost(h);
  }
  const std::string what = detail::concat(
      l.hosts() == 2 ? "" : "one of ", others,
      l.hosts() == 2 ? " went away or failed" : " went away or failed", " during ", call.describe(),
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

namespace {

// Every member of `backend` (one rank per host) sends `mine` to every other
// and receives theirs into slice h of `all` (bytes each; mine is copied to
// its own slice): point-to-point sends and receives, which Gloo runs in the
// calling thread (its collectives hop to a worker thread and back, which
// costs more than the message between two hosts of a fast network).
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

void exchange(c10d::Backend& backend, int me, int hosts, const at::Tensor& mine, at::Tensor& all,
              int tag, std::chrono::milliseconds timeout) {
  const int64_t bytes = mine.numel();
  if (bytes > 0)
    std::memcpy(static_cast<char*>(all.data_ptr()) + me * bytes, mine.data_ptr(), bytes);
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<std::vector<at::Tensor>> buffers;
  buffers.reserve(2 * hosts);
  for (int step = 1; step < hosts; ++step) {
    const int from = (me - step + hosts) % hosts;
    buffers.push_back({all.narrow(0, from * bytes, bytes)});
    works.push_back(backend.recv(buffers.back(), from, tag));
  }
  for (int step = 1; step < hosts; ++step) {
    const int to = (me + step) % hosts;
    buffers.push_back({mine});
    works.push_back(backend.send(buffers.back(), to, tag));
  }
  waitAll(works, timeout);
}

constexpr int kDescriptionTag = 0x7470;
constexpr int kPayloadTag = 0x7471;

}  // namespace

HierGroup::Received HierGroup::allgatherBetweenHosts(c10d::Backend& backend, const Call& call,
                                                     const void* payload, size_t bytes) {
  // Round 1, the same size on every rank whatever the call (Gloo ends the
  // process on a size mismatch): the description, and the payload if it
  // fits. Round 2, once every host described the same call: the payload.
  const int hosts = layout().hosts();
  const int me = layout().host();
  const size_t fixed = kCallBytes + kInlineBytes;
  const auto options = at::TensorOptions().dtype(at::kByte);
  const bool inlined = bytes <= kInlineBytes;
  at::Tensor send = scratch(kSendSlot, fixed);
  std::memset(send.data_ptr(), 0, fixed);
  Received out;
  out.buffer = scratch(kDescriptionsSlot, fixed * hosts);
  auto* s = static_cast<char*>(send.data_ptr());
  std::memcpy(s, &call, kCallBytes);
  if (inlined && bytes > 0) std::memcpy(s + kCallBytes, payload, bytes);
  try {
    exchange(backend, me, hosts, send, out.buffer, kDescriptionTag, parts_.timeout);
  } catch (const std::exception& e) {
    failBetweenHosts(call, e);
  }
  std::vector<Call> theirs(hosts);
  const auto* r = static_cast<const char*>(out.buffer.data_ptr());
  for (int h = 0; h < hosts; ++h) std::memcpy(&theirs[h], r + h * fixed, kCallBytes);
  checkCalls(call, theirs);
  if (inlined) {
    out.stride = fixed;
    out.offset = kCallBytes;
    return out;
  }
  at::Tensor mine =
      at::from_blob(const_cast<void*>(payload), {static_cast<int64_t>(bytes)}, options);
  out.buffer = scratch(kPayloadsSlot, bytes * hosts);
  out.stride = bytes;
  out.offset = 0;
  try {
    exchange(backend, me, hosts, mine, out.buffer, kPayloadTag, parts_.timeout);
  } catch (const std::exception& e) {
    failBetweenHosts(call, e);
  }
  return out;
}

void HierGroup::broadcastBetweenHosts(const Call& call, void* data, size_t bytes, int rootHost) {
  // Round 1 as in allgatherBetweenHosts (every leader's description; the
  // root's data when it fits), round 2 the rest from the root's leader.
  const bool root = layout().host() == rootHost;
  const Received first =
      allgatherBetweenHosts(*parts_.leaders, call, data, root && bytes <= kInlineBytes ? bytes : 0);
  if (bytes == 0) return;
  if (bytes <= kInlineBytes) {
    if (!root) std::memcpy(data, first.source(rootHost), bytes);
    return;
  }
  const at::Tensor message =
      at::from_blob(data, {static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
  try {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<std::vector<at::Tensor>> buffers(layout().hosts(), {message});
    if (root) {
      for (int h = 0; h < layout().hosts(); ++h) {
        if (h != rootHost) works.push_back(parts_.leaders->send(buffers[h], h, kPayloadTag));
      }
    } else {
      works.push_back(parts_.leaders->recv(buffers[0], rootHost, kPayloadTag));
    }
    waitAll(works, parts_.timeout);
  } catch (const std::exception& e) {
    failBetweenHosts(call, e);
  }
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

const char* HierGroup::allreducePath(size_t count, mq::DType dtype) const {
  const HostLayout& l = layout();
  const int local = l.localSize();
  const bool slices = l.even() && local >= 2 && count % local == 0 &&
                      count * mq::dtypeBytes(dtype) >= parts_.sliceMinBytes;
  return slices ? "slices" : "leaders";
}

void HierGroup::allreduce(const void* in, void* out, size_t count, mq::DType dtype,
                          const mq::ReduceSpec& spec, const mq::ShmPart& part) {
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  reduceAll(static_cast<uint32_t>(HierOp::kAllreduce), in, out, count, dtype, spec, part);
}

void HierGroup::reduceAll(uint32_t op, const void* in, void* out, size_t count, mq::DType dtype,
                          const mq::ReduceSpec& spec, const mq::ShmPart& part) {
  Call call = nextCall(op);
  call.dtype = static_cast<uint32_t>(dtype);
  call.count = count;
  call.reduction = reductionCode(spec);
  call.partIndex = part.index;
  call.partOf = part.of;
  const size_t esize = mq::dtypeBytes(dtype);

  // 1. The host's partial, with the ranks' factors applied (PREMUL_SUM).
  mq::ReduceSpec onHostSpec = spec;
  onHostSpec.divisor = 1;
  if (parts_.local) {
    onHost([&](mq::ShmGroup& g) { g.allreduce(in, out, count, dtype, onHostSpec, part); });
  } else if (onHostSpec.premultiply) {
    mq::copyScaled(out, in, count, dtype, onHostSpec);
  } else if (out != in && count > 0) {
    std::memmove(out, in, count * esize);
  }

  const HostLayout& l = layout();
  if (std::strcmp(allreducePath(count, dtype), "slices") == 0) {
    // 2. This local rank's slice across hosts, 3. the slices inside the host.
    const size_t each = count / l.localSize();
    char* slice = static_cast<char*>(out) + l.localRank() * each * esize;
    const Received received = allgatherBetweenHosts(*parts_.slices, call, slice, each * esize);
    reduceHosts(received, slice, each, dtype, spec);
    std::vector<void*> slices(l.localSize());
    for (int i = 0; i < l.localSize(); ++i) slices[i] = static_cast<char*>(out) + i * each * esize;
    onHost([&](mq::ShmGroup& g) { g.allgather(slice, each * esize, slices, part); });
    return;
  }
  // 2. The hosts' partials reduced by each leader, 3. sent inside the host.
  if (parts_.leaders) {
    const Received received = allgatherBetweenHosts(*parts_.leaders, call, out, count * esize);
    reduceHosts(received, out, count, dtype, spec);
  }
  onHost([&](mq::ShmGroup& g) { g.broadcast(out, count * esize, 0); });
}

void HierGroup::reduceScatter(const std::vector<const void*>& ins, void* out, size_t count,
                              mq::DType dtype, const mq::ReduceSpec& spec,
                              const mq::ShmPart& part) {
  // The whole input reduced (its parts in rank order, one buffer), this
  // rank's part kept.
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  const size_t bytes = count * mq::dtypeBytes(dtype);
  const int size = static_cast<int>(layout().hostOf.size());
  std::vector<char>& whole = wholeInput_;
  whole.resize(bytes * size);
  for (int r = 0; r < size; ++r) {
    if (bytes > 0) std::memcpy(whole.data() + r * bytes, ins[r], bytes);
  }
  reduceAll(static_cast<uint32_t>(HierOp::kReduceScatter), whole.data(), whole.data(), count * size,
            dtype, spec, part);
  if (bytes > 0) std::memcpy(out, whole.data() + layout().rank * bytes, bytes);
}

void HierGroup::allgather(const void* in, size_t bytes, const std::vector<void*>& outs,
                          const mq::ShmPart& part) {
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  Call call = nextCall(static_cast<uint32_t>(HierOp::kAllgather));
  call.count = bytes;
  call.partIndex = part.index;
  call.partOf = part.of;
  const HostLayout& l = layout();
  const std::vector<int>& mine = l.ranksOn[l.host()];
  // 1. This host's parts, straight into their outputs.
  std::vector<void*> hostOuts;
  for (int r : mine) hostOuts.push_back(outs[r]);
  if (parts_.local) {
    onHost([&](mq::ShmGroup& g) { g.allgather(in, bytes, hostOuts, part); });
  } else if (outs[l.rank] != in && bytes > 0) {
    std::memmove(outs[l.rank], in, bytes);
  }
  // 2. The leaders exchange their hosts' parts (padded to the largest host).
  size_t widest = 0;
  for (const auto& ranks : l.ranksOn) widest = std::max(widest, ranks.size());
  const size_t block = widest * bytes;
  at::Tensor received = scratch(kGatheredSlot, block * l.hosts());
  auto* all = static_cast<char*>(received.data_ptr());
  if (parts_.leaders) {
    at::Tensor oursTensor = scratch(kBlockSlot, block);
    char* ours = static_cast<char*>(oursTensor.data_ptr());
    for (size_t i = 0; i < mine.size(); ++i) {
      if (bytes > 0) std::memcpy(ours + i * bytes, outs[mine[i]], bytes);
    }
    const Received got = allgatherBetweenHosts(*parts_.leaders, call, ours, block);
    for (int h = 0; h < l.hosts(); ++h) {
      if (block > 0) std::memcpy(all + h * block, got.source(h), block);
    }
  }
  // 3. The other hosts' parts to this host's ranks.
  onHost([&](mq::ShmGroup& g) { g.broadcast(all, block * l.hosts(), 0); });
  for (int h = 0; h < l.hosts(); ++h) {
    if (h == l.host()) continue;
    for (size_t i = 0; i < l.ranksOn[h].size(); ++i) {
      if (bytes > 0) std::memcpy(outs[l.ranksOn[h][i]], all + h * block + i * bytes, bytes);
    }
  }
}

void HierGroup::broadcast(void* data, size_t bytes, int root) {
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  Call call = nextCall(static_cast<uint32_t>(HierOp::kBroadcast));
  call.count = bytes;
  call.root = root;
  const HostLayout& l = layout();
  const int rootHost = l.hostOf[root];
  const auto& rootRanks = l.ranksOn[rootHost];
  const int localRoot =
      static_cast<int>(std::find(rootRanks.begin(), rootRanks.end(), root) - rootRanks.begin());
  if (l.host() == rootHost) onHost([&](mq::ShmGroup& g) { g.broadcast(data, bytes, localRoot); });
  if (parts_.leaders) broadcastBetweenHosts(call, data, bytes, rootHost);
  if (l.host() != rootHost) onHost([&](mq::ShmGroup& g) { g.broadcast(data, bytes, 0); });
}

void HierGroup::barrier() {
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  Call call = nextCall(static_cast<uint32_t>(HierOp::kBarrier));
  onHost([](mq::ShmGroup& g) { g.barrier(); });
  if (parts_.leaders) allgatherBetweenHosts(*parts_.leaders, call, nullptr, 0);
  onHost([](mq::ShmGroup& g) { g.barrier(); });
}

}  // namespace tpcomm::coord
