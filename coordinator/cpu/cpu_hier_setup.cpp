// Groups across hosts: which ranks share a host (HostLayout) and the
// collective set-up of the hierarchical path (setUpHier), over
// cpu_hier_path.hpp.
#include <algorithm>
#include <map>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "common/error.hpp"
#include "coordinator/cpu/cpu_hier_path.hpp"
#include "coordinator/cuda/custom_setup.hpp"  // the set-up exchange helpers

namespace tpcomm::coord {

// ---- HostLayout ------------------------------------------------------------

HostLayout HostLayout::of(const std::vector<std::string>& identities, int rank) {
  HostLayout layout;
  layout.rank = rank;
  std::map<std::string, int> index;
  for (const auto& id : identities) {
    auto [it, added] = index.emplace(id, static_cast<int>(layout.ranksOn.size()));
    if (added) {
      layout.ranksOn.emplace_back();
      layout.names.push_back(id.substr(0, id.find('#')));
    }
    layout.ranksOn[it->second].push_back(static_cast<int>(layout.hostOf.size()));
    layout.hostOf.push_back(it->second);
  }
  return layout;
}

int HostLayout::localRank() const {
  const auto& mine = ranksOn[host()];
  return static_cast<int>(std::find(mine.begin(), mine.end(), rank) - mine.begin());
}

bool HostLayout::even() const {
  return std::all_of(ranksOn.begin(), ranksOn.end(),
                     [&](const std::vector<int>& r) { return r.size() == ranksOn[0].size(); });
}

std::string HostLayout::describeHost(int h) const {
  std::string ranks;
  for (int r : ranksOn[h]) ranks += detail::concat(ranks.empty() ? "" : ", ", r);
  return detail::concat("host '", names[h], "' (rank", ranksOn[h].size() > 1 ? "s " : " ", ranks,
                        ")");
}

std::string HostLayout::describe() const {
  std::string out = detail::concat(hosts(), " hosts: ");
  for (int h = 0; h < hosts(); ++h) out += (h ? ", " : "") + describeHost(h).substr(5);
  return out;
}

// ---- set-up ------------------------------------------------------------------

namespace {

// The machine part of a host identity (hostIdentity(): after '@'), empty
// for one given by TPCOMM_HOST_ID.
std::string machineOf(const std::string& identity) {
  const size_t at = identity.rfind('@');
  return identity.find('#') == std::string::npos || at == std::string::npos
             ? std::string()
             : identity.substr(at + 1);
}

}  // namespace

HierSetup setUpHier(c10d::Backend& cpu, const BackendFactory& factory,
                    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                    const std::vector<std::string>& identities, const CpuShmConfig& config,
                    std::chrono::milliseconds timeout, const std::string& requiredBy) {
  HierSetup result;
  const HostLayout layout = HostLayout::of(identities, rank);
  const auto refuse = [&](std::string reason) -> HierSetup {
    TPCOMM_CHECK(requiredBy.empty(), kInvalidUsage, "TPCOMM_CPU_SHM=1 (on rank(s) ", requiredBy,
                 ") but the group cannot use shared memory across hosts: ", reason);
    result.reason = std::move(reason);
    return std::move(result);
  };
  // Decided alike on every rank, without an exchange.
  if (layout.hosts() == size)
    return refuse(detail::concat("its ranks are on different hosts, each alone on its host (",
                                 layout.describe(), "): nothing to share in memory"));
  if (!factory) return refuse("no factory for Gloo sub-groups (unit-test group)");

  // Ranks on this machine (one kernel: namespaced hosts share its cores).
  const std::string machine = machineOf(identities[rank]);
  int machineRanks = 0;
  for (const auto& id : identities) machineRanks += !machine.empty() && machineOf(id) == machine;
  HierGroup::Parts parts;
  parts.machineRanks = std::max(machineRanks, layout.localSize());
  parts.layout = layout;
  parts.timeout = timeout;
  parts.sliceMinBytes = static_cast<uint64_t>(config.hierSliceBytes);
  parts.gatherMaxBytes = static_cast<uint64_t>(config.hierGatherBytes);
  parts.inlineBytes = static_cast<uint64_t>(config.hierInlineBytes);
  parts.reduceIsa = reduceIsaOf(config.reduceIsa);
  std::string failure;
  const int host = layout.host();
  const int local = layout.localRank();
  const int hosts = layout.hosts();
  const auto subStore = [&](const std::string& name) {
    return c10::make_intrusive<c10d::PrefixStore>("tpcomm-hier/" + name + "/", store);
  };
  // Every sub-group is made whatever failed before it on this rank, so that
  // no peer waits for this rank in a rendezvous it skipped.
  const auto attempt = [&](const auto& make) {
    try {
      make();
    } catch (const std::exception& e) {
      if (failure.empty()) failure = failureOf(e);
    }
  };
  if (layout.localSize() >= 2) {
    attempt([&] {
      auto onHost =
          factory(subStore(detail::concat("host", host)), local, layout.localSize(), timeout);
      CpuShmConfig onHostConfig = config;
      onHostConfig.mode = "auto";
      onHostConfig.machineRanks = machineRanks;
      onHostConfig.rankNames = layout.ranksOn[host];
      // A host's ranks mostly wait for the leader's step between hosts:
      // where the machine's cores are oversubscribed (namespaced hosts of
      // one kernel), polling would take the core that step needs, so they
      // sleep at once.
      if (config.spinUs < 0 && machineRanks > usableCpus()) onHostConfig.spinUs = 0;
      CpuShmSetup shm = setUpCpuShm(*onHost, local, layout.localSize(), identities[rank],
                                    onHostConfig, 2 * timeout);
      if (!shm.group) {
        failure = detail::concat("shared memory on ", layout.describeHost(host), ": ", shm.reason);
      }
      parts.local = std::move(shm.group);
    });
  }
  if (local == 0)
    attempt([&] { parts.leaders = factory(subStore("leaders"), host, hosts, timeout); });
  if (layout.even() && layout.localSize() >= 2) {
    if (local == 0) {
      parts.slices = parts.leaders;
    } else {
      attempt([&] {
        parts.slices = factory(subStore(detail::concat("slices", local)), host, hosts, timeout);
      });
    }
  }
  // Every rank's failure, and its crossovers (the smallest counts, so that
  // every host takes the same path and algorithm for a call).
  constexpr size_t kFailureWidth = 384;
  const auto statuses = allgatherBytes(
      cpu, size,
      fixedWidth(failure, kFailureWidth) + fixedWidth(std::to_string(config.hierSliceBytes), 24) +
          fixedWidth(std::to_string(config.hierGatherBytes), 24) +
          fixedWidth(std::to_string(config.hierInlineBytes), 24));
  std::vector<std::string> failures;
  for (const auto& s : statuses) {
    failures.push_back(trimmed(s.substr(0, kFailureWidth)));
    const std::string slice = trimmed(s.substr(kFailureWidth, 24));
    if (!slice.empty())
      parts.sliceMinBytes = std::min<uint64_t>(parts.sliceMinBytes, std::stoull(slice));
    const std::string gather = trimmed(s.substr(kFailureWidth + 24, 24));
    if (!gather.empty())
      parts.gatherMaxBytes = std::min<uint64_t>(parts.gatherMaxBytes, std::stoull(gather));
    const std::string inlined = trimmed(s.substr(kFailureWidth + 48));
    if (!inlined.empty())
      parts.inlineBytes = std::min<uint64_t>(parts.inlineBytes, std::stoull(inlined));
  }
  const std::string reason = firstFailure(failures);
  if (!reason.empty()) return refuse(reason);
  result.group = std::make_unique<HierGroup>(std::move(parts));
  return result;
}

}  // namespace tpcomm::coord
