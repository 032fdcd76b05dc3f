// The group's faults, timeouts, abort and shutdown: what breaking the group
// releases on each route (group_fault.hpp), and the device work the
// watchdog watches.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "common/error.hpp"
#include "coordinator/group_coordinator.hpp"
#include "coordinator/group_life.hpp"

namespace tpcomm::coord {

namespace {

// Destroys broken groups' Gloo groups on a thread of its own, each once
// nothing else holds it (checked every 200 ms), so that a destruction that
// waits for a Gloo worker blocked in a released call never blocks a
// caller, and a serving process that breaks groups for days keeps no
// thread, socket or mapping of theirs.
class GlooReaper {
 public:
  static GlooReaper& get() {
    static auto* reaper = new GlooReaper();  // never destroyed: a detached thread
    return *reaper;
  }
  void keep(c10::intrusive_ptr<c10d::Backend> backend) {
    std::lock_guard<std::mutex> lock(mutex_);
    kept_.push_back(std::move(backend));
    wake_.notify_one();
  }

 private:
  GlooReaper() {
    std::thread([this] { loop(); }).detach();
  }
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return !kept_.empty(); });
      std::vector<c10::intrusive_ptr<c10d::Backend>> free;
      for (auto it = kept_.begin(); it != kept_.end();) {
        // Only this list holds it: nothing can take it again.
        if (it->use_count() == 1) {
          free.push_back(std::move(*it));
          it = kept_.erase(it);
        } else {
          ++it;
        }
      }
      lock.unlock();
      free.clear();  // the destructions, without the lock
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      lock.lock();
    }
  }
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<c10::intrusive_ptr<c10d::Backend>> kept_;  // by mutex_
};

}  // namespace

void GroupCoordinator::watchFaults() {
  fault_->setReleaser([this](const std::string& why) {
    // Gloo's worker threads may stay blocked in a released call until its
    // connections' shutdown reaches them; destroying the Gloo group joins
    // them. So a broken group's Gloo group is destroyed by the reaper's
    // thread, once the group let it go, never by the caller's.
    GlooReaper::get().keep(cpu_);
    if (auto* shm = shmFast_.load()) shm->abort(why);
    if (auto* hier = hierFast_.load()) hier->abort(why);
    if (auto* custom = customFast_.load()) custom->abort();  // cheap: before NCCL's
    if (auto device = deviceBackendIfCreated()) device->abort();
  });
  fault_->setDeviceProbe([this] {
    auto* custom = customFast_.load();
    return custom != nullptr && custom->launchesPending();
  });
}

void GroupCoordinator::setTimeout(std::chrono::milliseconds timeout) {
  options_.timeout = timeout;
  cpu_->setTimeout(timeout);
  if (p2p_) p2p_->setTimeout(timeout);
  if (auto* shm = shmFast_.load()) shm->setTimeout(timeout);
  if (auto* hier = hierFast_.load()) hier->setTimeout(timeout);
  if (auto device = deviceBackendIfCreated()) device->setTimeout(timeout);
  if (auto custom = customPath()) custom->setTimeout(customTimeout());
  fault_->setTimeout(timeout);
}

void GroupCoordinator::abort() {
  // Published, then released (the shared-memory paths, the device backend,
  // the Gloo connections, the calls in flight): group_fault.hpp.
  fault_->breakGroup(detail::concat("rank ", rank(), " aborted the group"));
  // Published before the Gloo group's connections close: a peer whose call
  // fails on them then finds the abort as its cause, not its own failure.
  fault_->publishQueued();
  cpu_->abort();
  // torch aborts groups it then drops without a shutdown (a shrink of the
  // default group aborts every other group): this rank is done with the
  // group's store now, as after a shutdown.
  endLifeIfIdle();
}

void GroupCoordinator::shutdown() {
  if (auto device = deviceBackendIfCreated()) device->shutdown();
  cpu_->shutdown();
  endLifeIfIdle();
}

void GroupCoordinator::endLifeIfIdle() {
  // This rank is done with the group's store: the last rank out removes
  // the life's keys (group_life.hpp). Not while a call of this rank is in
  // flight (it may still read the store): the keys stay then, unless a
  // later shutdown or abort finds it idle. On a thread of its own, waited
  // for at most a second, so that a store that no longer answers (a broken
  // group's may be gone with its host) never holds the way out; an aborted
  // group's keys go as a working group's do. Once per rank.
  if (!fault_->idle() || lifeEnded_.exchange(true)) return;
  auto ended = std::make_shared<std::promise<void>>();
  auto future = ended->get_future();
  std::thread([fault = fault_, store = store_, size = options_.size, rank = options_.rank, ended] {
    fault->retire();
    endLife(store, size, {rank});
    ended->set_value();
  }).detach();
  future.wait_for(std::chrono::seconds(1));
}

c10::intrusive_ptr<c10d::Store> GroupCoordinator::baseStore() const {
  if (auto* life = dynamic_cast<c10d::PrefixStore*>(store_.get())) {
    return life->getUnderlyingStore();
  }
  return store_;
}

std::shared_ptr<GroupCoordinator> GroupCoordinator::form(const c10::intrusive_ptr<c10d::Store>& store,
                                                          GroupOptions options,
                                                          BackendFactory cpuFactory,
                                                          BackendFactory deviceFactory) {
  TPCOMM_CHECK(store, kInvalidUsage, "group '", options.groupName, "' needs a store to be made");
  TPCOMM_CHECK(static_cast<bool>(cpuFactory), kInvalidUsage, "group '", options.groupName,
               "' needs a CPU backend factory to be made");
  // Every key of the group (its Gloo group's too) under its life's prefix:
  // nothing of a group made earlier on the same store reaches it.
  options.life = agreeOnLife(store, options.rank, options.size, options.timeout);
  const auto lifeStore = storeOfLife(store, options.life);
  // Returned once every rank made its part; the Gloo group outlives a
  // failure until every rank ended the making (group_life.hpp).
  c10::intrusive_ptr<c10d::Backend> cpu;
  return makeTogether(lifeStore, options.rank, options.size, options.timeout, [&] {
    auto cpuStore = c10::make_intrusive<c10d::PrefixStore>("cpu/", lifeStore);
    cpu = cpuFactory(cpuStore, options.rank, options.size, options.timeout);
    TPCOMM_CHECK(cpu, kInvalidUsage, "group '", options.groupName,
                 "': the CPU backend factory made no backend");
    auto sockets = GlooSockets::ofGroup(cpuStore, options.rank, options.size);
    auto made = std::make_shared<GroupCoordinator>(options, lifeStore, cpu, deviceFactory);
    made->setCpuBackendFactory(cpuFactory);
    made->fault().addGlooSockets(sockets);
    return made;
  });
}

std::shared_ptr<GroupCoordinator> GroupCoordinator::shrink(const std::vector<int>& survivors,
                                                           std::chrono::milliseconds timeout,
                                                           const std::string& groupName) {
  // The store the group was made on (its life's prefix taken off): the new
  // group's keys must not lie under this group's life, whose keys go when
  // the survivors destroy this group.
  auto store = c10::make_intrusive<c10d::PrefixStore>(
      "tpcomm-shrink-" + std::to_string(shrinks_++), baseStore());
  auto child = split(store, survivors, timeout, groupName);
  if (child->rank() == 0) {
    std::vector<int> excluded;
    for (int r = 0; r < size(); ++r) {
      if (std::find(survivors.begin(), survivors.end(), r) == survivors.end()) excluded.push_back(r);
    }
    countAsLeft(excluded);
  }
  return child;
}

}  // namespace tpcomm::coord
