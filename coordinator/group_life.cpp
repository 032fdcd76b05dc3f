#include "coordinator/group_life.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <thread>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "coordinator/common/error.hpp"

namespace tpcomm::coord {

namespace {

const std::string kLifeKey = "tpcomm/life";

std::string readKey(const std::string& life) { return "tpcomm/life-read/" + life; }
std::string doneKey(const std::string& life) { return "tpcomm/life-done/" + life; }
// Kept (16 bytes per life): a rank may still be about to read it.
std::string okKey(const std::string& life) { return "tpcomm/life-ok/" + life; }

std::string randomLife() {
  std::random_device device;
  const uint64_t high = device();
  const uint64_t low = device();
  const uint64_t mixed =
      (high << 32 | low) ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
      (static_cast<uint64_t>(getpid()) << 40);
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(mixed));
  return text;
}

std::vector<uint8_t> bytesOf(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

// Waits up to `left` for `key`; the error names the group's `timeout`.
void waitFor(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key,
             std::chrono::milliseconds left, std::chrono::milliseconds timeout, int rank,
             const char* what) {
  try {
    store->wait({key}, left);
  } catch (const std::exception& e) {
    const std::string why = e.what();
    TPCOMM_THROW(kTimeout, "rank ", rank, " waited ", timeout.count(), " ms for ", what,
                 " (store key '", key, "'): ", why.substr(0, why.find('\n')));
  }
}

}  // namespace

std::string agreeOnLife(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                        std::chrono::milliseconds timeout) {
  TPCOMM_CHECK(store, kInvalidUsage, "a group's life needs its store");
  if (rank == 0) {
    const std::string life = randomLife();
    if (size == 1) return life;
    store->set(kLifeKey, bytesOf(life));
    waitFor(store, doneKey(life), timeout, timeout, rank,
            "every rank of the group to take part in making it");
    store->set(okKey(life), bytesOf("1"));
    // The id goes before anything of this life is made (see the header).
    // A store without deleteKey keeps them: ids never repeat.
    for (const auto& key : {kLifeKey, readKey(life), doneKey(life)}) {
      try {
        store->deleteKey(key);
      } catch (const std::exception&) {
      }
    }
    return life;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto left = [&] {
    return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline - std::chrono::steady_clock::now()),
                    std::chrono::milliseconds(1));
  };
  waitFor(store, kLifeKey, left(), timeout, rank, "rank 0 to make the group");
  auto bytes = store->get(kLifeKey);
  std::string life(bytes.begin(), bytes.end());
  TPCOMM_CHECK(!life.empty(), kPeerLost, "rank ", rank,
               " read an empty life of the group being made (store key '", kLifeKey, "')");
  for (;;) {
    if (store->add(readKey(life), 1) == size - 1) store->set(doneKey(life), bytesOf("1"));
    // Rank 0 confirms its id once every rank read it. An id a rank 0 that
    // died while making an earlier life left behind is never confirmed:
    // the current rank 0 replaces it, and its id is taken instead.
    for (;;) {
      if (store->check({okKey(life)})) return life;
      if (std::chrono::steady_clock::now() >= deadline)
        TPCOMM_THROW(kTimeout, "rank ", rank, " waited ", timeout.count(),
                     " ms for rank 0 to confirm the group's life ", life, " (store key '",
                     okKey(life), "')");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (store->check({kLifeKey})) {
        // Empty: rank 0 deleted the key between the check and the read
        // (it confirmed this life meanwhile: the next turn sees it).
        bytes = store->get(kLifeKey);
        const std::string now(bytes.begin(), bytes.end());
        if (!now.empty() && now != life) {
          life = now;
          break;
        }
      }
    }
  }
}

c10::intrusive_ptr<c10d::Store> storeOfLife(const c10::intrusive_ptr<c10d::Store>& store,
                                            const std::string& life) {
  return c10::make_intrusive<c10d::PrefixStore>("tpcomm-life-" + life, store);
}

}  // namespace tpcomm::coord
