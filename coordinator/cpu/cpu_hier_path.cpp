#include "coordinator/cpu/cpu_hier_path.hpp"
#include "coordinator/cpu/cpu_hier_call.hpp"

#include <algorithm>
#include <cstring>

#include "common/error.hpp"
#include "coordinator/faults/group_fault.hpp"
#include "message_queue/collectives/shm_reduce.hpp"

namespace tpcomm::coord {


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
  reduceAll(static_cast<uint32_t>(hier::HierOp::kAllreduce), in, out, count, dtype, spec, part);
}

HierGroup::Call HierGroup::reductionCall(uint32_t op, size_t count, mq::DType dtype,
                                         const mq::ReduceSpec& spec, const mq::ShmPart& part) {
  Call call = nextCall(op);
  call.dtype = static_cast<uint32_t>(dtype);
  call.count = count;
  call.reduction = hier::reductionCode(spec);
  call.partIndex = part.index;
  call.partOf = part.of;
  return call;
}

void HierGroup::hostPartial(const void* in, void* out, size_t count, mq::DType dtype,
                            const mq::ReduceSpec& spec, const mq::ShmPart& part) {
  mq::ReduceSpec onHostSpec = spec;
  onHostSpec.divisor = 1;
  if (parts_.local) {
    onHost([&](mq::ShmGroup& g) { g.allreduce(in, out, count, dtype, onHostSpec, part); });
  } else if (onHostSpec.premultiply) {
    mq::copyScaled(out, in, count, dtype, onHostSpec);
  } else if (out != in && count > 0) {
    std::memmove(out, in, count * mq::dtypeBytes(dtype));
  }
}

void HierGroup::reduceAll(uint32_t op, const void* in, void* out, size_t count, mq::DType dtype,
                          const mq::ReduceSpec& spec, const mq::ShmPart& part) {
  const Call call = reductionCall(op, count, dtype, spec, part);
  const size_t esize = mq::dtypeBytes(dtype);
  // 1. The host's partial.
  hostPartial(in, out, count, dtype, spec, part);

  const HostLayout& l = layout();
  if (std::strcmp(allreducePath(count, dtype), "slices") == 0) {
    // 2. This local rank's slice across hosts, 3. the slices inside the host.
    const size_t each = count / l.localSize();
    char* slice = static_cast<char*>(out) + l.localRank() * each * esize;
    allreduceBetweenHosts(*parts_.slices, call, slice, each, dtype, spec);
    std::vector<void*> slices(l.localSize());
    for (int i = 0; i < l.localSize(); ++i) slices[i] = static_cast<char*>(out) + i * each * esize;
    onHost([&](mq::ShmGroup& g) { g.allgather(slice, each * esize, slices, part); });
    return;
  }
  // 2. The hosts' partials reduced by each leader, 3. sent inside the host.
  if (parts_.leaders) allreduceBetweenHosts(*parts_.leaders, call, out, count, dtype, spec);
  onHost([&](mq::ShmGroup& g) { g.broadcast(out, count * esize, 0); });
}

void HierGroup::reduceScatter(const std::vector<const void*>& ins, void* out, size_t count,
                              mq::DType dtype, const mq::ReduceSpec& spec,
                              const mq::ShmPart& part) {
  // The whole input (its parts in rank order, one buffer) reduced on the
  // host; then up to the gather size the allreduce of it, each rank keeping
  // its part; larger, a reduce-scatter between hosts (each host gets its
  // ranks' parts) and a broadcast of them inside the host.
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  const size_t bytes = count * mq::dtypeBytes(dtype);
  const HostLayout& l = layout();
  const int size = static_cast<int>(l.hostOf.size());
  std::vector<char>& whole = wholeInput_;
  whole.resize(bytes * size);
  for (int r = 0; r < size; ++r) {
    if (bytes > 0) std::memcpy(whole.data() + r * bytes, ins[r], bytes);
  }
  const uint32_t op = static_cast<uint32_t>(hier::HierOp::kReduceScatter);
  if (bytes * size <= parts_.gatherMaxBytes) {
    reduceAll(op, whole.data(), whole.data(), count * size, dtype, spec, part);
    if (bytes > 0) std::memcpy(out, whole.data() + l.rank * bytes, bytes);
    return;
  }
  const Call call = reductionCall(op, count * size, dtype, spec, part);
  hostPartial(whole.data(), whole.data(), count * size, dtype, spec, part);
  const size_t ours = l.localSize() * bytes;
  char* mine = static_cast<char*>(scratch(kHostPartsSlot, ours).data_ptr());
  if (parts_.leaders) reduceScatterBetweenHosts(call, whole.data(), count, dtype, spec, mine);
  onHost([&](mq::ShmGroup& g) { g.broadcast(mine, ours, 0); });
  if (bytes > 0) std::memcpy(out, mine + l.localRank() * bytes, bytes);
}

void HierGroup::allgather(const void* in, size_t bytes, const std::vector<void*>& outs,
                          const mq::ShmPart& part) {
  std::lock_guard<std::mutex> lock(mutex_);
  throwIfFailed();
  Call call = nextCall(static_cast<uint32_t>(hier::HierOp::kAllgather));
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
    const Received got = gatherBetweenHosts(*parts_.leaders, call, ours, block);
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
  Call call = nextCall(static_cast<uint32_t>(hier::HierOp::kBroadcast));
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
  Call call = nextCall(static_cast<uint32_t>(hier::HierOp::kBarrier));
  onHost([](mq::ShmGroup& g) { g.barrier(); });
  if (parts_.leaders) gatherBetweenHosts(*parts_.leaders, call, nullptr, 0);
  onHost([](mq::ShmGroup& g) { g.barrier(); });
}

}  // namespace tpcomm::coord
