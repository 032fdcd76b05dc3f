// Host-only decisions of the custom allreduce: buffer layout, algorithm and
// block choice, eligibility, error descriptions. No CUDA calls.
#include <algorithm>

#include "common/error.hpp"
#include "custom_allreduce/custom_allreduce.hpp"
#include "custom_allreduce/signal.hpp"

namespace tpcomm::car {

namespace {

constexpr size_t kAlign = 256;

size_t alignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

}  // namespace

std::string protocolId() {
  return detail::concat(
      "signal ", sizeof(Signal), " B, ", kMaxBlocks, " blocks of ", kThreads,
      " threads, poisoned flags, staging by call parity, one-shot with one barrier, "
      "two-shot without end barrier, push of ", kPushDepth, " buffers of ", kMaxRanks,
      " slots (zero empty, zeros sent as -0)");
}

const char* dtypeName(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
  }
  return "unknown";
}

size_t dtypeSize(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

const char* algorithmName(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kOneShot:
      return "one-shot";
    case Algorithm::kTwoShot:
      return "two-shot";
    case Algorithm::kPush:
      return "push";
  }
  return "unknown";
}

BufferLayout BufferLayout::forMaxBytes(size_t maxBytes) {
  TPCOMM_CHECK(maxBytes > 0 && maxBytes % kPackBytes == 0, kInvalidUsage,
               "custom allreduce: the maximum size must be a positive multiple of 16 bytes, got ",
               maxBytes);
  BufferLayout l;
  l.maxBytes = maxBytes;
  l.pushOffset = alignUp(sizeof(Signal), kAlign);
  l.pushSlotBytes = alignUp(std::min(maxBytes, kPushMaxBytes), kAlign);
  l.signalBytes = l.pushOffset + static_cast<size_t>(kPushDepth) * kMaxRanks * l.pushSlotBytes;
  l.stagingOffset = l.signalBytes;
  l.stagingBytes = alignUp(maxBytes, kAlign);
  l.resultOffset = l.stagingOffset + 2 * l.stagingBytes;
  l.totalBytes = l.resultOffset + alignUp(maxBytes, kAlign);
  return l;
}

size_t oneShotLimit(int worldSize, size_t maxBytes) {
  // One-shot reads N x the bytes; past about 1 MiB even at 2 ranks it is
  // likely to lose to two-shot (and to NCCL). Autotune replaces these.
  size_t limit = 1 << 20;
  if (worldSize > 2) limit = 512 << 10;
  if (worldSize > 4) limit = 256 << 10;
  return std::min(limit, maxBytes);
}

size_t pushLimit(int worldSize, size_t maxBytes, int64_t setting) {
  const size_t slot = std::min(maxBytes, kPushMaxBytes);
  if (setting >= 0) return std::min(static_cast<size_t>(setting), slot);
  // A push writes N - 1 copies of the call into peers' memory (the barrier
  // one-shot reads them instead), so its gain shrinks with size and N. On an
  // H200, ranks as streams (tests/gpu/NOTES.md rows 52-53): at 2 and 4 ranks
  // the push beat the barrier one-shot at every size up to its 256 KiB slot
  // (N=2: 4.1-4.5 against 5.5-5.7 us); at 8 ranks up to 4 KiB (8.8 against
  // 9.3 us) but not from 16 KiB (10.1 against 9.7). 5 to 7 ranks were not
  // measured and take 8's limit.
  const size_t limit = worldSize <= 4 ? kPushMaxBytes : size_t{8} << 10;
  return std::min(limit, slot);
}

bool pushApplies(int worldSize, size_t bytes, size_t maxBytes, int64_t setting) {
  return bytes <= pushLimit(worldSize, maxBytes, setting);
}

Algorithm chooseAlgorithm(int worldSize, size_t bytes, size_t maxBytes, int64_t pushSetting) {
  if (pushApplies(worldSize, bytes, maxBytes, pushSetting)) return Algorithm::kPush;
  return bytes <= oneShotLimit(worldSize, maxBytes) ? Algorithm::kOneShot : Algorithm::kTwoShot;
}

int chooseBlocks(Algorithm algorithm, int worldSize, size_t bytes, int override, int cap) {
  if (override > 0) {
    TPCOMM_CHECK(override <= kMaxBlocks, kInvalidUsage, "custom allreduce: ", override,
                 " blocks asked for; at most ", kMaxBlocks);
    return override;
  }
  // Packs one block's threads cover per pass; two-shot's reduction covers a
  // 1/N part, so it needs fewer blocks for the same size.
  size_t packs = (bytes + kPackBytes - 1) / kPackBytes;
  if (algorithm == Algorithm::kTwoShot) packs = (packs + worldSize - 1) / worldSize;
  const size_t wanted = (packs + kThreads - 1) / kThreads;
  // Up to the most a rank may use: on an H200 (ranks as streams, block
  // sweeps of tests/gpu/NOTES.md row 41) 64 blocks beat 36 at every N from
  // 4 MiB (two-shot at N=2, 64 MiB: 76% of the copy bandwidth against 53%;
  // N=4: 102% against 83%) and one-shot at N=2, 1 MiB (6.3 against 7.1 us).
  // Ranks sharing a GPU are capped further to what fits (sharedGpuBlocks).
  return static_cast<int>(std::clamp<size_t>(wanted, 1, std::clamp(cap, 1, kMaxBlocks)));
}

bool deviceScopeFor(const std::vector<int>& devices, const std::string& setting) {
  if (setting != "auto" || devices.empty()) return false;
  return std::all_of(devices.begin(), devices.end(), [&](int d) { return d == devices[0]; });
}

bool sharesAGpu(const std::vector<int>& devices) {
  std::vector<int> sorted = devices;
  std::sort(sorted.begin(), sorted.end());
  return std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end();
}

bool rangesOverlap(const void* a, const void* b, size_t bytes) {
  if (bytes == 0) return false;
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + bytes && y < x + bytes;
}

int sharedGpuBlocks(int worldSize, int requested, int chosen, int residentTotal) {
  TPCOMM_CHECK(worldSize >= 1 && residentTotal >= 1, kInvalidUsage, "custom allreduce: ", worldSize,
               " ranks on a GPU holding ", residentTotal, " blocks");
  const int fit = std::max(1, residentTotal / worldSize);
  if (requested > 0) {
    TPCOMM_CHECK(static_cast<int64_t>(requested) * worldSize <= residentTotal, kInvalidUsage,
                 "custom allreduce: ", worldSize, " ranks x ", requested,
                 " blocks = ", static_cast<int64_t>(requested) * worldSize,
                 " blocks must all be resident at once on one GPU (they wait for each other), "
                 "but it holds at most ",
                 residentTotal, " of this kernel: ask for at most ", fit, " blocks per rank");
    return requested;
  }
  return std::clamp(chosen, 1, fit);
}

Eligibility groupEligibility(const Topology& t) {
  const int n = static_cast<int>(t.hostIds.size());
  Eligibility e;
  if (n < 2 || n > kMaxRanks) {
    e.reason = detail::concat("world size ", n, " is outside 2..", kMaxRanks);
    return e;
  }
  for (int r = 1; r < n; ++r) {
    if (t.hostIds[r] != t.hostIds[0]) {
      e.reason = detail::concat("ranks 0 and ", r, " are on different hosts ('", t.hostIds[0],
                                "' and '", t.hostIds[r], "')");
      return e;
    }
  }
  TPCOMM_CHECK_EQ(t.devices.size(), t.hostIds.size(), "(devices vs ranks in the topology)");
  const auto at = [&](const std::vector<std::string>& m, int i, int j) {
    return i < static_cast<int>(m.size()) && j < static_cast<int>(m[i].size()) ? m[i][j] : '?';
  };
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i == j || t.devices[i] == t.devices[j]) continue;
      if (at(t.access, i, j) == 'x') {
        e.reason = detail::concat("no P2P access from rank ", i, " (GPU ", t.devices[i],
                                  ") to rank ", j, " (GPU ", t.devices[j], ")");
        return e;
      }
    }
  }
  std::vector<int> gpus = t.devices;
  std::sort(gpus.begin(), gpus.end());
  const auto distinct = std::unique(gpus.begin(), gpus.end()) - gpus.begin();
  if (distinct > 2) {
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        if (i == j || t.devices[i] == t.devices[j] || at(t.links, i, j) != 'p') continue;
        e.reason =
            detail::concat("ranks ", i, " and ", j, " (GPUs ", t.devices[i], " and ", t.devices[j],
                           ") are not linked by NVLink; past 2 GPUs the "
                           "custom kernel needs NVLink between every pair (over PCIe "
                           "NCCL is faster)");
        return e;
      }
    }
  }
  if (!t.probeSucceeded) {
    e.reason = "the IPC write probe failed: " + t.probeDetail;
    return e;
  }
  e.eligible = true;
  return e;
}

Eligibility callEligibility(const std::string& dtype, size_t bytes, uintptr_t input,
                            uintptr_t output, size_t maxBytes) {
  Eligibility e;
  if (dtype != "float32" && dtype != "float16" && dtype != "bfloat16") {
    e.reason = "dtype " + dtype + " (the kernel sums float32, float16 and bfloat16)";
  } else if (bytes > maxBytes) {
    e.reason = detail::concat(bytes, " bytes exceed the custom maximum of ", maxBytes);
  } else if (input % kPackBytes != 0 || output % kPackBytes != 0) {
    e.reason = "a tensor that is not 16-byte aligned";
  } else {
    e.eligible = true;
  }
  return e;
}

std::string describeError(uint32_t code) {
  if (code == 0) return "no error";
  static const char* kPhaseNames[kPhases] = {"start", "middle", "end"};
  const int peer = static_cast<int>(code & 0xff);
  const int block = static_cast<int>((code >> 8) & 0xff);
  const int phase = static_cast<int>((code >> 16) & 0x7f);
  const int reporter = reporterOf(code);
  if (phase == kAborted) {
    if (reporter < 0) return detail::concat("rank ", peer, " aborted the group");
    return detail::concat("the group is poisoned: rank ", reporter, " aborted it");
  }
  if (phase == kPush) {
    const std::string cause =
        detail::concat("rank ", peer, " did not arrive (block ", block, ", its pushed values)");
    if (reporter < 0) return cause;
    return detail::concat("the group is poisoned: rank ", reporter, " gave up because ", cause);
  }
  if (phase == kNotRegistered) {
    return "a graph captured inside graph_capture() was replayed before the context exited "
           "(its zero-copy buffers were never registered)";
  }
  const std::string cause =
      detail::concat("rank ", peer, " did not arrive (block ", block, ", ",
                     phase < kPhases ? kPhaseNames[phase] : "unknown", " barrier)");
  if (reporter < 0) return cause;
  return detail::concat("the group is poisoned: rank ", reporter, " gave up because ", cause);
}

}  // namespace tpcomm::car
