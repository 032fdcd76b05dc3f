#pragma once
// The hooks a caller registers on a group (torch 2.15's c10d::Backend:
// registerAbortHook, registerCompletionHook; c10d/Hooks.hpp), kept apart
// from torch's types so that every supported torch compiles it.
//
// Contract:
//  - Abort hooks run, in hook id order, on the thread that is about to raise
//    a communication failure of the group (a timeout, a lost or failed peer,
//    an abort, a call on a group that broke) and in abort(), before the
//    group's abort. One failure may run them more than once (torch asks
//    hooks to be idempotent): on each rank's failing call, again on its next
//    call of the broken group, in abort(). They run with the group already
//    marked broken, so its reason (`backend.fault` in Python) and the flight
//    recorder are in reach.
//  - Completion hooks run once per Work that completed successfully, on the
//    thread that established it (the caller's, or the routed backend's
//    callback thread), with the Work's completion key. Failed work runs
//    none.
//  - A hook's exception is caught and logged (one line), never raised into
//    the call. Hooks are copied out before they run: a hook may register or
//    unregister hooks. Thread-safe.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>

namespace tpcomm::backend {

class BackendHooks {
 public:
  using AbortHook = std::function<void()>;
  using CompletionHook = std::function<void(uint64_t key, std::optional<float> durationMs)>;

  // Registering an id that is taken replaces its hook; unregistering an id
  // that is not registered raises tpcomm::Error (InvalidUsage) naming it.
  void registerAbort(int64_t id, AbortHook hook);
  void unregisterAbort(int64_t id);
  void registerCompletion(int64_t id, CompletionHook hook);
  void unregisterCompletion(int64_t id);

  void runAbort() const;
  // Cheap when none is registered (one atomic load): called per Work.
  bool wantsCompletion() const { return completionCount_.load(std::memory_order_acquire) > 0; }
  void runCompletion(uint64_t key) const;

  // A key no Work of this process reuses (Work::getCompletionKey).
  static uint64_t nextCompletionKey();

 private:
  mutable std::mutex mutex_;
  std::map<int64_t, AbortHook> abort_;
  std::map<int64_t, CompletionHook> completion_;
  std::atomic<size_t> completionCount_{0};
};

}  // namespace tpcomm::backend
