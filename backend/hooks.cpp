#include "backend/hooks.hpp"

#include <cstdio>
#include <exception>

#include "common/error.hpp"

namespace tpcomm::backend {

namespace {

// A hook's failure is the hook's: one line on stderr, never the call's.
template <typename F>
void runGuarded(const char* kind, int64_t id, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tpcomm: %s hook %lld raised (ignored): %s\n", kind,
                 static_cast<long long>(id), e.what());
  } catch (...) {
    std::fprintf(stderr, "tpcomm: %s hook %lld raised (ignored)\n", kind,
                 static_cast<long long>(id));
  }
}

}  // namespace

void BackendHooks::registerAbort(int64_t id, AbortHook hook) {
  TPCOMM_CHECK(static_cast<bool>(hook), kInvalidUsage, "registerAbortHook: hook ", id,
               " is empty");
  std::lock_guard<std::mutex> lock(mutex_);
  abort_[id] = std::move(hook);
}

void BackendHooks::unregisterAbort(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  TPCOMM_CHECK(abort_.erase(id) == 1, kInvalidUsage, "unregisterAbortHook: no abort hook ", id,
               " is registered on this group");
}

void BackendHooks::registerCompletion(int64_t id, CompletionHook hook) {
  TPCOMM_CHECK(static_cast<bool>(hook), kInvalidUsage, "registerCompletionHook: hook ", id,
               " is empty");
  std::lock_guard<std::mutex> lock(mutex_);
  completion_[id] = std::move(hook);
  completionCount_.store(completion_.size(), std::memory_order_release);
}

void BackendHooks::unregisterCompletion(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  TPCOMM_CHECK(completion_.erase(id) == 1, kInvalidUsage,
               "unregisterCompletionHook: no completion hook ", id,
               " is registered on this group");
  completionCount_.store(completion_.size(), std::memory_order_release);
}

void BackendHooks::runAbort() const {
  std::map<int64_t, AbortHook> hooks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (abort_.empty()) return;
    hooks = abort_;
  }
  for (const auto& [id, hook] : hooks) runGuarded("abort", id, hook);
}

void BackendHooks::runCompletion(uint64_t key) const {
  std::map<int64_t, CompletionHook> hooks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (completion_.empty()) return;
    hooks = completion_;
  }
  // tpcomm does not time its calls: no duration (torch's nullopt).
  for (const auto& [id, hook] : hooks) {
    runGuarded("completion", id, [&] { hook(key, std::nullopt); });
  }
}

uint64_t BackendHooks::nextCompletionKey() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace tpcomm::backend
