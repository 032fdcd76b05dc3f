#include "coordinator/group_life.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <random>
#include <thread>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "common/error.hpp"

namespace tpcomm::coord {

namespace {

const std::string kLifeKey = "tpcomm/life";
// What "tpcomm/life" holds once its id was taken by every rank.
const std::string kSpent = "spent:";

std::string readKey(const std::string& life) { return "tpcomm/life-read/" + life; }
std::string doneKey(const std::string& life) { return "tpcomm/life-done/" + life; }
// The life's prefix (storeOfLife) and, under it, rank 0's confirmation:
// kept until the life ends (endLife), since a rank may still be about to
// read it.
std::string lifePrefix(const std::string& life) { return "tpcomm-life-" + life; }
const std::string kOk = "tpcomm/life-ok";  // under the life's prefix
std::string okKey(const std::string& life) { return lifePrefix(life) + "/" + kOk; }
// The end of a making, under the life's prefix (group_life.hpp).
const std::string kMadeCount = "tpcomm/made";
const std::string kMadeAll = "tpcomm/made-all";
const std::string kNotMade = "tpcomm/not-made";
const std::string kEnded = "tpcomm/made-or-failed";
// The end of a life (endLife), under its prefix: ranks that left it.
const std::string kLeft = "tpcomm/left";

using detail::bytesOf;
using detail::firstLine;

}  // namespace

std::string randomId() {
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

namespace {

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
    const std::string life = randomId();
    if (size == 1) return life;
    store->set(kLifeKey, bytesOf(life));
    waitFor(store, doneKey(life), timeout, timeout, rank,
            "every rank of the group to take part in making it");
    store->set(okKey(life), bytesOf("1"));
    // The id is spent before anything of this life is made (see the
    // header): overwritten, not deleted, while a rank may still read it
    // (finishMaking deletes it once every rank made its part).
    store->set(kLifeKey, bytesOf(kSpent + life));
    for (const auto& key : {readKey(life), doneKey(life)}) {
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
  auto expired = [&](const std::string& what) {
    if (std::chrono::steady_clock::now() >= deadline)
      TPCOMM_THROW(kTimeout, "rank ", rank, " waited ", timeout.count(), " ms for ", what,
                   " (store key '", kLifeKey, "')");
  };
  waitFor(store, kLifeKey, left(), timeout, rank, "rank 0 to make the group");
  // Read without waiting: rank 0 deletes the key once a making ended, so it
  // may be gone (an empty id: not set yet) between two reads.
  auto read = [&] {
    const auto bytes = readWithoutWaiting(store, kLifeKey);
    return bytes ? std::string(bytes->begin(), bytes->end()) : std::string();
  };
  std::string life = read();
  for (;;) {
    // No id, or a spent one (an earlier making's): rank 0 has not set this
    // one's yet.
    while (life.empty() || life.rfind(kSpent, 0) == 0) {
      expired("rank 0 to make the group");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      life = read();
    }
    if (store->add(readKey(life), 1) == size - 1) store->set(doneKey(life), bytesOf("1"));
    // Rank 0 confirms its id once every rank read it. An id a rank 0 that
    // died while making an earlier life left behind is never confirmed:
    // the current rank 0 replaces it, and its id is taken instead.
    std::string now;
    for (;;) {
      if (store->check({okKey(life)})) return life;
      expired(detail::concat("rank 0 to confirm the group's life ", life).c_str());
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      now = read();
      if (now != life && now != kSpent + life) break;
    }
    life = now;
  }
}

namespace {

// Waits, without raising, until every rank of the group ended its making
// (made its part or failed it) or `deadline` passes: a rank whose making
// failed keeps its part (its Gloo group) until then, so that a peer still
// in Gloo's rendezvous never finds a connection closed under it.
void waitUntilEveryRankEnded(const c10::intrusive_ptr<c10d::Store>& lifeStore, int size,
                             std::chrono::steady_clock::time_point deadline) {
  auto pause = std::chrono::milliseconds(1);
  try {
    while (lifeStore->add(kEnded, 0) < size && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(50));
    }
  } catch (const std::exception&) {
    // A store that went away: no rank can end through it any more.
  }
}

std::string joinedLines(const std::vector<uint8_t>& bytes) {
  std::string text;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (bytes[i] != '\n') {
      text += static_cast<char>(bytes[i]);
    } else if (i + 1 < bytes.size()) {
      text += "; ";
    }
  }
  return text;
}

}  // namespace

void finishMaking(const c10::intrusive_ptr<c10d::Store>& lifeStore, int rank, int size,
                  std::chrono::milliseconds timeout, const std::optional<std::string>& failure) {
  if (size <= 1) return;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  if (failure) {
    try {
      lifeStore->add(kEnded, 1);
    } catch (const std::exception&) {
    }
    try {
      const std::string why = failure->empty() ? "(an error without a message)" : *failure;
      lifeStore->append(kNotMade, bytesOf(detail::concat("rank ", rank, ": ", firstLine(why), "\n")));
      lifeStore->set(kMadeAll, bytesOf("0"));
    } catch (const std::exception&) {
      // A store that went away: the peers' wait ends at their timeout,
      // and this rank raises its own error.
      return;
    }
    waitUntilEveryRankEnded(lifeStore, size, deadline);
    return;
  }
  TPCOMM_CHECK(lifeStore, kInvalidUsage, "a group's making needs its store");
  lifeStore->add(kEnded, 1);
  if (lifeStore->add(kMadeCount, 1) == size) lifeStore->set(kMadeAll, bytesOf("1"));
  try {
    lifeStore->wait({kMadeAll}, timeout);
  } catch (const std::exception& e) {
    // Decided on the counter itself, atomically: adding more than the size
    // either finds every rank made its part (the making finished as the
    // wait ran out: go on as made) or makes the count unreachable, so that
    // no rank that comes later can end the making as made.
    int64_t before = -1;
    try {
      before = lifeStore->add(kMadeCount, size + 1) - (size + 1);
    } catch (const std::exception&) {
    }
    if (before != size) {
      try {
        // A rank that comes later raises this instead of returning a group
        // without this one; the others still waiting raise it at once.
        lifeStore->append(kNotMade, bytesOf(detail::concat("rank ", rank, ": gave up after ",
                                                           timeout.count(), " ms\n")));
        lifeStore->set(kMadeAll, bytesOf("0"));
      } catch (const std::exception&) {
      }
      // Each rank that gave up before added size + 1: what is left made its part.
      const std::string done = before < 0 ? std::string("?") : std::to_string(before % (size + 1));
      TPCOMM_THROW(kTimeout, "rank ", rank, " waited ", timeout.count(),
                   " ms for every rank to make its part of the group (", done, " of ", size,
                   " did; store key '", kMadeAll, "'): ", firstLine(e.what()));
    }
  }
  if (lifeStore->check({kNotMade})) {
    const std::string text = joinedLines(lifeStore->get(kNotMade));
    waitUntilEveryRankEnded(lifeStore, size, deadline);
    TPCOMM_THROW(kPeerLost, "rank ", rank, " made its part of the group, but not every rank did: ",
                 text);
  }
  // Made on every rank, so every rank is past agreeOnLife: rank 0, the
  // only one that writes the group's "tpcomm/life", removes it (a later
  // making under the same name waits for it to be set again).
  if (rank == 0) {
    if (auto* prefixed = dynamic_cast<c10d::PrefixStore*>(lifeStore.get())) {
      try {
        prefixed->getUnderlyingStore()->deleteKey(kLifeKey);
      } catch (const std::exception&) {
        // Left behind: one key per group name, harmless.
      }
    }
  }
}

bool endLife(const c10::intrusive_ptr<c10d::Store>& lifeStore, int size,
             const std::vector<int>& ranks) noexcept {
  if (!lifeStore) return false;
  try {
    if (size > 1) {
      // Removed already (every rank left): a count added now would stay.
      if (!readWithoutWaiting(lifeStore, kOk)) return false;
      // Each rank counts once, however often it is said to leave (its abort
      // and the survivors' shrink both may).
      int64_t left = 0;
      for (int r : ranks) {
        if (lifeStore->add(detail::concat(kLeft, "/", r), 1) == 1) left = lifeStore->add(kLeft, 1);
      }
      if (left < size) return false;
    }
    std::vector<std::string> keys;
    try {
      keys = lifeStore->listKeys();
    } catch (const std::exception&) {
      // A store that cannot list its keys: those tpcomm itself wrote.
      keys = {kMadeCount, kMadeAll, kEnded, kOk};
      for (int r = 0; r < size; ++r) keys.push_back(detail::concat(kLeft, "/", r));
    }
    for (const auto& key : keys) {
      // Every reader of a life's keys after its making reads without
      // waiting (readWithoutWaiting), so none is held by a key gone.
      if (key == kLeft) continue;
      try {
        lifeStore->deleteKey(key);
      } catch (const std::exception&) {
      }
    }
    lifeStore->deleteKey(kLeft);
    return true;
  } catch (const std::exception&) {
    // A store that went away: nothing is left to clean.
    return false;
  }
}

std::optional<std::vector<uint8_t>> readWithoutWaiting(const c10::intrusive_ptr<c10d::Store>& store,
                                                       const std::string& key) {
  // A value no key of tpcomm's ever holds (a store answers a compareSet on
  // a missing key with the expected value when that is not empty).
  static const std::vector<uint8_t> kAbsent = bytesOf(std::string("\x01" "tpcomm-absent"));
  std::vector<uint8_t> bytes;
  try {
    bytes = store->compareSet(key, kAbsent, kAbsent);
  } catch (const c10::Error&) {
    // A store without compareSet (one of the user's): check, then get.
    if (!store->check({key})) return std::nullopt;
    return store->get(key);
  }
  if (bytes == kAbsent) return std::nullopt;
  return bytes;
}

c10::intrusive_ptr<c10d::Store> storeOfLife(const c10::intrusive_ptr<c10d::Store>& store,
                                            const std::string& life) {
  return c10::make_intrusive<c10d::PrefixStore>(lifePrefix(life), store);
}

void meetOnStore(c10d::Store& store, const std::string& arrivedKey,
                 const std::string& refusedKey, int member, int size,
                 std::chrono::milliseconds timeout, const std::string& what,
                 const std::function<void()>& check) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::milliseconds(1);
  for (int64_t arrived = store.add(arrivedKey, 1); arrived < size;
       arrived = store.add(arrivedKey, 0)) {
    if (store.check({refusedKey})) {
      const auto why = store.get(refusedKey);
      TPCOMM_THROW(kPeerLost, what, ": ", std::string(why.begin(), why.end()));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      const std::string why = detail::concat("member ", member, " gave up after ", timeout.count(),
                                             " ms: ", arrived, " of the ", size, " members came");
      store.set(refusedKey, bytesOf(why));
      TPCOMM_THROW(kTimeout, what, ": ", why);
    }
    try {
      if (check) check();
    } catch (const std::exception& e) {
      store.set(refusedKey, bytesOf(detail::concat("member ", member, " stopped: ", e.what())));
      throw;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(10));
  }
}

}  // namespace tpcomm::coord
