// ProcessGroupTpcomm: the group's own methods (making, options, timeout,
// abort, split, refusals from torch's front door), beside the calls of
// process_group_tpcomm.cpp.
#include <algorithm>

#include "backend/boundary.hpp"
#include "backend/process_group_tpcomm.hpp"
#include "backend/validation.hpp"
#include "backend/window/tpcomm_window.hpp"
#include "coordinator/cpu/cpu_shm_path.hpp"
#include "coordinator/route_stats.hpp"

namespace tpcomm::backend {

size_t ProcessGroupTpcomm::nextFlightPgId() {
  static std::atomic<size_t> groups{0};
  return groups.fetch_add(1);
}

ProcessGroupTpcomm::ProcessGroupTpcomm(std::shared_ptr<coord::GroupCoordinator> coordinator)
    : c10d::Backend(coordinator->rank(), coordinator->size()),
      coordinator_(std::move(coordinator)),
      flightPgId_(nextFlightPgId()) {
  init();
}

ProcessGroupTpcomm::ProcessGroupTpcomm(Unformed unformed)
    : c10d::Backend(unformed.options.rank, unformed.options.size),
      unformed_(std::move(unformed)),
      flightPgId_(nextFlightPgId()) {
  init();
}

coord::GroupCoordinator& ProcessGroupTpcomm::co() const {
  TPCOMM_CHECK(coordinator_, kInvalidUsage, "group '", groupName(),
               "' was made in the reconfigure regime (enable_reconfigure=True) and has no "
               "members yet: form it with torch.distributed._reconfigure(uuid, handles) first");
  return *coordinator_;
}

const std::string& ProcessGroupTpcomm::groupName() const {
  return coordinator_ ? coordinator_->options().groupName : unformed_->options.groupName;
}

std::string ProcessGroupTpcomm::describeCall(const char* op) const {
  return std::string(op) + " on group '" + groupName() + "' (rank " +
         std::to_string(rank_) + " of " + std::to_string(size_) + ")";
}

uint64_t& ProcessGroupTpcomm::callsOnThisThread() {
  static thread_local uint64_t calls = 0;
  return calls;
}

bool ProcessGroupTpcomm::onDeviceRoute() {
  const auto& route = coord::RouteStats::lastRoute();
  return route && (*route == coord::StatsRoute::kNccl || *route == coord::StatsRoute::kCustomOneShot ||
                   *route == coord::StatsRoute::kCustomTwoShot);
}

void ProcessGroupTpcomm::refuseFromPython(const std::string& op, const std::string& why) {
  translateErrors([&] {
    coord::GroupFault& fault = co().fault();
    if (!fault.usable()) fault.checkBeforeCall(op.c_str());
    const uint64_t seq = ++collectiveSeq_;
    if (co().options().debugChecks) {
      // TPCOMM_DEBUG: every rank raises at the check, the group survives.
      co().checkRefusedCall(op.c_str(), why);
    } else {
      fault.refused(seq, op.c_str(), why);
    }
  });
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupTpcomm::getBackendOptions() {
  const auto& current = coordinator_ ? coordinator_->options() : unformed_->options;
  auto options = c10::make_intrusive<TpcommOptions>(current.timeout);
  options->group_name = current.groupName;
  return options;
}

void ProcessGroupTpcomm::setTimeout(std::chrono::milliseconds timeout) {
  if (!coordinator_) {
    unformed_->options.timeout = timeout;
    return;
  }
  coordinator_->setTimeout(timeout);
}

void ProcessGroupTpcomm::eagerConnectSingleDevice(at::Device device) {
  // A group without members yet (the reconfigure regime) connects on its
  // first call after a reconfigure formed it.
  if (!coordinator_) return;
  translateErrors([&] { coordinator_->eagerConnect(device); });
}

void ProcessGroupTpcomm::setSequenceNumberForGroup() {
  // A group without members yet has no sequence to agree on.
  if (coordinator_) coordinator_->cpuBackend()->setSequenceNumberForGroup();
}

uint64_t ProcessGroupTpcomm::getSequenceNumberForGroup() {
  return coordinator_ ? coordinator_->cpuBackend()->getSequenceNumberForGroup() : 0;
}

void ProcessGroupTpcomm::abort() {
  hooks_->runAbort();
  ++aborts_;  // a reconfigure under way raises (backend/reconfigure.cpp)
  if (auto current = snapshot()) current->abort();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTpcomm::completed(
    c10::intrusive_ptr<c10d::Work> work) const {
#if defined(TPCOMM_COMPLETION_HOOKS)
  if (hooks_->wantsCompletion()) hooks_->runCompletion(work->getCompletionKey());
#endif
  return work;
}

#if defined(TPCOMM_ABORT_HOOKS)
void ProcessGroupTpcomm::registerAbortHook(int64_t hookId, c10d::AbortHook hook) {
  translateErrors([&] { hooks_->registerAbort(hookId, std::move(hook)); });
}

void ProcessGroupTpcomm::unregisterAbortHook(int64_t hookId) {
  translateErrors([&] { hooks_->unregisterAbort(hookId); });
}
#endif

#if defined(TPCOMM_COMPLETION_HOOKS)
void ProcessGroupTpcomm::registerCompletionHook(int64_t hookId, c10d::CompletionHook hook) {
  translateErrors([&] {
    TPCOMM_CHECK(static_cast<bool>(hook), kInvalidUsage, "registerCompletionHook: hook ", hookId,
                 " is empty");
    hooks_->registerCompletion(
        hookId, [hook = std::move(hook)](uint64_t key, std::optional<float> durationMs) {
          c10d::CompletionHookArgs args;
          args.completionKey = key;
          args.duration_ms = durationMs;
          hook(args);
        });
  });
}

void ProcessGroupTpcomm::unregisterCompletionHook(int64_t hookId) {
  translateErrors([&] { hooks_->unregisterCompletion(hookId); });
}
#endif

void ProcessGroupTpcomm::shutdown() {
  if (auto current = snapshot()) current->shutdown();
}

std::shared_ptr<coord::GroupCoordinator> ProcessGroupTpcomm::snapshot() const {
  std::lock_guard<std::mutex> lock(swapMutex_);
  return coordinator_;
}

void ProcessGroupTpcomm::startCoalescing() {
  translateErrors([&] {
    // A batch left open (its block raised before its end) is dropped, the
    // device backend's with it (its calls launched), and this one runs:
    // torch's abort wraps its aborts in a batch and must not fail here.
    if (coalescing_.open() && coordinator_) {
      try {
        coordinator_->endCoalescing();
      } catch (const std::exception&) {
      }
    }
    if (const size_t dropped = coalescing_.start()) {
      TORCH_WARN("tpcomm: startCoalescing on group '", groupName(),
                 "' dropped a batch of ", dropped,
                 " call(s) that was never ended (a coalescing block that raised?); each of its "
                 "calls keeps its own Work");
    }
    // A group without members yet: its calls raise, the batch stays empty.
    if (coordinator_) coordinator_->startCoalescing();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTpcomm::endCoalescing() {
  return translateErrors([&]() -> c10::intrusive_ptr<c10d::Work> {
    Coalescing::Batch batch = coalescing_.end("'" + groupName() + "'");
    const auto device = coordinator_ ? coordinator_->endCoalescing() : nullptr;
    if (device) batch.works.push_back(device);
    // Nothing called (an empty batch, as torch's abort makes): no Work, as
    // ProcessGroupNCCL. Calls that all completed without one: a completed one.
    if (batch.calls == 0) return {};
    if (batch.works.empty()) return coord::completedWork({});
    if (batch.works.size() == 1) return batch.works[0];
    return c10::make_intrusive<CoalescedWork>(rank_, std::move(batch.works), device != nullptr);
  });
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupTpcomm::split(
    const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
    const c10::intrusive_ptr<Options>& opts) {
  return translateErrors([&]() -> c10::intrusive_ptr<c10d::Backend> {
    TPCOMM_CHECK(!ranks.empty(), kInvalidUsage, "split: the rank list is empty");
    for (int r : ranks) checkRank("split", "rank", r, size_);
    if (std::find(ranks.begin(), ranks.end(), rank_) == ranks.end()) return nullptr;
    const std::string name = opts ? opts->group_name : std::string();
    const auto timeout = opts ? opts->timeout : co().options().timeout;
    std::lock_guard<std::mutex> lock(splitMutex_);
    if (!name.empty()) {
      auto it = splits_.find(name);
      if (it != splits_.end()) return it->second;
    }
    auto child =
        c10::make_intrusive<ProcessGroupTpcomm>(co().split(store, ranks, timeout, name));
    if (globalRanks_.size() == static_cast<size_t>(size_)) {
      std::vector<uint64_t> global;
      for (int r : ranks) global.push_back(globalRanks_[r]);
      child->setGlobalRanks(std::move(global));
    }
    if (!name.empty()) splits_[name] = child;
    return child;
  });
}

#if defined(TPCOMM_SHRINK)
c10::intrusive_ptr<c10d::Backend> ProcessGroupTpcomm::shrink(
    const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
    const c10::intrusive_ptr<Options>& opts) {
  return translateErrors([&]() -> c10::intrusive_ptr<c10d::Backend> {
    const std::string& group = co().options().groupName;
    TPCOMM_CHECK(shrinkFlags == 0 || shrinkFlags == 1, kInvalidUsage, "shrink: flags ",
                 shrinkFlags, " are neither SHRINK_DEFAULT (0) nor SHRINK_ABORT (1)");
    TPCOMM_CHECK(!ranksToExclude.empty(), kInvalidUsage, "shrink of group '", group,
                 "': no rank to exclude");
    std::vector<bool> excluded(size_, false);
    for (int64_t r : ranksToExclude) {
      TPCOMM_CHECK(r >= 0 && r < size_, kInvalidUsage, "shrink of group '", group, "': rank ", r,
                   " to exclude is not one of its ", size_, " ranks");
      TPCOMM_CHECK(!excluded[r], kInvalidUsage, "shrink of group '", group, "': rank ", r,
                   " is excluded twice");
      excluded[r] = true;
    }
    TPCOMM_CHECK(!excluded[rank_], kInvalidUsage, "shrink of group '", group, "': rank ", rank_,
                 " excludes itself (only the ranks that stay call shrink)");
    TPCOMM_CHECK(co().hasStore(), kInvalidUsage, "shrink of group '", group,
                 "': it was made without a store");
    std::vector<int> survivors;
    for (int r = 0; r < size_; ++r) {
      if (!excluded[r]) survivors.push_back(r);
    }
    if (shrinkFlags == 1) abort();
    const std::string name =
        opts && !opts->group_name.empty() ? opts->group_name : group + ":shrunk";
    const auto timeout = opts ? opts->timeout : co().options().timeout;
    auto child =
        c10::make_intrusive<ProcessGroupTpcomm>(co().shrink(survivors, timeout, name));
    if (globalRanks_.size() == static_cast<size_t>(size_)) {
      std::vector<uint64_t> global;
      for (int r : survivors) global.push_back(globalRanks_[r]);
      child->setGlobalRanks(std::move(global));
    }
    return child;
  });
}
#endif

#if defined(TPCOMM_WINDOW)
c10::intrusive_ptr<c10d::Window> ProcessGroupTpcomm::new_window(
    const std::optional<at::Tensor>& tensor) {
  return translateErrors([&]() -> c10::intrusive_ptr<c10d::Window> {
    co();  // raises on a group without members yet
    return c10::make_intrusive<TpcommWindow>(coordinator_, tensor);
  });
}
#endif

void ProcessGroupTpcomm::monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks) {
  translateErrors([&] { co().monitoredBarrier(opts, waitAllRanks); });
}

}  // namespace tpcomm::backend
