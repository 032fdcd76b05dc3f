// ProcessGroupTpcomm's reconfigure (torch 2.15's dist._get_reconfigure_handle
// and dist._reconfigure): the group re-formed with a new set of members, in
// place, as docs/torch_capabilities.md describes.
//
// A handle is one line of six fields separated by ';':
//   tpcomm1;<token>;<store>;<life>;<rank>;<size>
// token: 16 hex digits this backend drew when it was made (a member's
// identity); store: the store its members meet on ("tcp:<host>:<port>" for a
// TCPStore, "file:<path>" for a FileStore, "-" where it cannot tell); life,
// rank, size: the group it serves now (its life, group_life.hpp; "-", its
// nominal rank and size before it was ever formed). Forming runs on
// "tpcomm-reconfigure-<uuid>/" of the store the group was made on.
#include <algorithm>
#include <functional>
#include <numeric>
#include <tuple>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "backend/boundary.hpp"
#include "backend/process_group_tpcomm.hpp"
#include "common/error.hpp"
#include "coordinator/group_life.hpp"

namespace tpcomm::backend {

#if defined(TPCOMM_RECONFIGURE)

namespace {

const char* const kVersion = "tpcomm1";

struct Handle {
  std::string text, token, store, life;
  int rank = -1, size = 0;
};

// The store under its prefixes, named so that two processes on one store
// say the same; "-" for a kind of store that cannot tell.
std::string storeName(c10::intrusive_ptr<c10d::Store> store) {
  for (int depth = 0; depth < 64; ++depth) {
    auto* prefix = dynamic_cast<c10d::PrefixStore*>(store.get());
    if (!prefix) break;
    store = prefix->getUnderlyingStore();
  }
  if (auto* tcp = dynamic_cast<c10d::TCPStore*>(store.get())) {
    return detail::concat("tcp:", tcp->getHost(), ":", tcp->getPort());
  }
  if (auto* file = dynamic_cast<c10d::FileStore*>(store.get())) {
    std::string path = file->getPath();
    std::replace_if(path.begin(), path.end(), [](char c) { return c == ';' || c == '\n'; }, '_');
    return "file:" + path;
  }
  return "-";
}

// What two handles' stores must share: a TCPStore's port (its host may be
// named differently on each member: an address, a name, localhost), a
// FileStore's path; nothing where a member cannot tell.
std::string storeKey(const std::string& name) {
  if (name.rfind("tcp:", 0) == 0) return "tcp:" + name.substr(name.rfind(':') + 1);
  return name;
}

bool parseInt(const std::string& text, int& out) {
  if (text.empty() || text.size() > 9) return false;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
  }
  out = std::stoi(text);
  return true;
}

// `text` as a handle; raises naming its position and what is wrong.
Handle parse(const std::string& text, size_t position, const std::string& group) {
  const std::vector<std::string> fields = detail::splitAt(text, ';');
  const std::string shown = text.size() > 120 ? text.substr(0, 120) + "..." : text;
  TPCOMM_CHECK(fields.size() == 6 && fields[0] == kVersion, kInvalidUsage, "reconfigure of group '",
               group, "': handle ", position, " ('", shown,
               "') is not a tpcomm handle (one from _get_reconfigure_handle on a tpcomm group)");
  Handle h;
  h.text = text;
  h.token = fields[1];
  h.store = fields[2];
  h.life = fields[3];
  TPCOMM_CHECK(h.token.size() == 16 && parseInt(fields[4], h.rank) && parseInt(fields[5], h.size) &&
                   h.rank < h.size,
               kInvalidUsage, "reconfigure of group '", group, "': handle ", position, " ('",
               shown, "') is damaged");
  return h;
}

// The handles in rank order: a list's as given; a set's by the group each
// member served (its life), its rank there, then its token, so that the
// members of one earlier group keep their order (and the ranks of a host
// stay together where they were). Every member sorts alike.
std::vector<std::string> ordered(const c10d::ReconfigureOptions& opts, const std::string& group) {
  if (const auto* list = std::get_if<std::vector<c10d::ReconfigureHandle>>(&opts.handles)) {
    return *list;
  }
  const auto& set = std::get<std::unordered_set<c10d::ReconfigureHandle>>(opts.handles);
  std::vector<Handle> handles;
  for (const auto& text : set) handles.push_back(parse(text, handles.size(), group));
  std::sort(handles.begin(), handles.end(), [](const Handle& a, const Handle& b) {
    return std::tie(a.life, a.rank, a.token) < std::tie(b.life, b.rank, b.token);
  });
  std::vector<std::string> out;
  for (const auto& h : handles) out.push_back(h.text);
  return out;
}

// Keys of a reconfigure's agreement on its handles, under its prefix.
const char* const kHandlesKey = "tpcomm/handles";   // the first member's handles
const char* const kArrivedKey = "tpcomm/arrived";   // members that found the same
const char* const kRefusedKey = "tpcomm/refused";   // why a member's differed

std::string joined(const std::vector<Handle>& members) {
  std::string out;
  for (const auto& h : members) out += h.text + "\n";
  return out;
}

// Every member passed the same handles: the first to come writes them, the
// others compare, then all meet (coord::meetOnStore). A member whose
// handles differ says so and raises; the others raise it at once.
void agreeOnHandles(c10d::Store& store, const std::string& ours, int rank, int size,
                    std::chrono::milliseconds timeout, const std::string& what,
                    const std::function<void()>& check) {
  const auto found = store.compareSet(kHandlesKey, {}, detail::bytesOf(ours));
  if (found != detail::bytesOf(ours)) {
    const std::string why = detail::concat(
        "member ", rank, " passed other handles than the first one:\n", ours,
        "where the first passed:\n", std::string(found.begin(), found.end()));
    store.set(kRefusedKey, detail::bytesOf(why));
    TPCOMM_THROW(kInvalidUsage, what, ": ", why);
  }
  coord::meetOnStore(store, kArrivedKey, kRefusedKey, rank, size, timeout, what, check);
}

// The group a reconfigure replaced, on this member: its ranks that are not
// among the new members count as having left it, said by the first member
// that served it (its keys go once the others retired it too); then this
// member aborts it when it lost ranks or broke (a peer may be gone without
// a call having noticed), else shuts it down. Best effort: the new group
// is in force already.
void retire(coord::GroupCoordinator& old, const std::vector<Handle>& members,
            const std::string& myToken) {
  const std::string& life = old.options().life;
  std::vector<bool> stays(old.size(), false);
  for (const auto& h : members) {
    if (!life.empty() && h.life == life && h.rank < old.size()) stays[h.rank] = true;
  }
  std::vector<int> out;
  for (int r = 0; r < old.size(); ++r) {
    if (!stays[r]) out.push_back(r);
  }
  const auto first = std::find_if(members.begin(), members.end(),
                                  [&](const Handle& h) { return h.life == life; });
  try {
    if (!life.empty() && first != members.end() && first->token == myToken && !out.empty()) {
      old.countAsLeft(out);
    }
    if (!out.empty() || !old.fault().usable()) {
      old.abort();
    } else {
      old.shutdown();
    }
  } catch (const std::exception& e) {
    TORCH_WARN("tpcomm: retiring group '", old.options().groupName,
               "' after a reconfigure: ", e.what());
  }
}

}  // namespace

c10d::ReconfigureHandle ProcessGroupTpcomm::get_reconfigure_handle() const {
  return translateErrors([&] {
    std::call_once(tokenDrawn_, [&] { token_ = coord::randomId(); });
    const auto store = reconfigureBase_ ? reconfigureBase_
                       : coordinator_   ? coordinator_->baseStore()
                                        : unformed_->store;
    const std::string life =
        coordinator_ && !coordinator_->options().life.empty() ? coordinator_->options().life : "-";
    return detail::concat(kVersion, ";", token_, ";", storeName(store), ";", life, ";", rank_, ";",
                          size_);
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTpcomm::reconfigure(
    const c10d::ReconfigureOptions& opts) {
  return translateErrors([&]() -> c10::intrusive_ptr<c10d::Work> {
    const std::string group = groupName();
    TPCOMM_CHECK(!coalescing_.open(), kInvalidUsage, "reconfigure of group '", group,
                 "' inside a coalescing block");
    if (!opts.hints.empty()) {
      TPCOMM_THROW(kInvalidUsage, "reconfigure of group '", group, "': hint '",
                   opts.hints.begin()->first, "' is not one tpcomm knows (it takes none)");
    }
    const uint64_t abortsBefore = aborts_.load();
    auto checkAbort = [&] {
      TPCOMM_CHECK(aborts_.load() == abortsBefore, kPeerLost, "reconfigure of group '", group,
                   "': the group was aborted meanwhile");
    };
    const std::vector<std::string> texts = ordered(opts, group);
    TPCOMM_CHECK(!texts.empty(), kInvalidUsage, "reconfigure of group '", group,
                 "': no handle (one per member, this rank's own among them)");
    const Handle mine = parse(get_reconfigure_handle(), 0, group);
    std::vector<Handle> members;
    int newRank = -1;
    for (size_t i = 0; i < texts.size(); ++i) {
      Handle h = parse(texts[i], i, group);
      for (const Handle& seen : members) {
        TPCOMM_CHECK(seen.token != h.token, kInvalidUsage, "reconfigure of group '", group,
                     "': handles ", &seen - members.data(), " and ", i,
                     " name the same member (token ", h.token, ")");
      }
      TPCOMM_CHECK(storeKey(h.store) == storeKey(mine.store) || h.store == "-" ||
                       mine.store == "-",
                   kInvalidUsage,
                   "reconfigure of group '", group, "': handle ", i, " names store '", h.store,
                   "', this rank's group meets on '", mine.store,
                   "': every member must share one store");
      if (h.token == mine.token) newRank = static_cast<int>(i);
      members.push_back(std::move(h));
    }
    TPCOMM_CHECK(newRank >= 0, kInvalidUsage, "reconfigure of group '", group,
                 "': this rank's own handle is not among the ", texts.size(),
                 " handles (every member passes every member's handle, its own included)");
    TPCOMM_CHECK(texts[newRank] == mine.text, kInvalidUsage, "reconfigure of group '", group,
                 "': this rank's handle ", newRank,
                 " is one it gave before the group changed (take a fresh handle from "
                 "_get_reconfigure_handle after each reconfigure)");
    TPCOMM_CHECK(uuids_.insert(opts.uuid).second, kInvalidUsage, "reconfigure of group '", group,
                 "': uuid ", opts.uuid, " was used before on this group (a fresh one each time)");

    coord::GroupOptions options = coordinator_ ? coordinator_->options() : unformed_->options;
    // The options' timeout bounds the forming; the group keeps its own.
    const auto groupTimeout = options.timeout;
    if (opts.timeout) options.timeout = *opts.timeout;
    options.rank = newRank;
    options.size = static_cast<int>(members.size());
    // The store the group was first made on: the same for every member,
    // whichever forming it had last.
    if (!reconfigureBase_) {
      reconfigureBase_ = coordinator_ ? coordinator_->baseStore() : unformed_->store;
    }
    auto store = c10::make_intrusive<c10d::PrefixStore>(
        detail::concat("tpcomm-reconfigure-", opts.uuid), reconfigureBase_);
    agreeOnHandles(*store, joined(members), newRank, options.size, options.timeout,
                   detail::concat("reconfigure of group '", group, "' (uuid ", opts.uuid, ")"),
                   checkAbort);
    auto formed = coord::GroupCoordinator::form(
        store, options,
        coordinator_ ? coordinator_->cpuBackendFactory() : unformed_->cpuFactory,
        coordinator_ ? coordinator_->deviceBackendFactory() : unformed_->deviceFactory);
    if (opts.timeout) formed->setTimeout(groupTimeout);
    // Every member compared (the making ended together): the handles go.
    if (newRank == 0) {
      try {
        for (const char* key : {kHandlesKey, kArrivedKey}) store->deleteKey(key);
      } catch (const std::exception&) {
      }
    }
    try {
      checkAbort();
    } catch (...) {
      formed->abort();
      throw;
    }
    std::shared_ptr<coord::GroupCoordinator> old;
    {
      std::lock_guard<std::mutex> lock(swapMutex_);
      old = std::exchange(coordinator_, formed);
      unformed_.reset();
      rank_ = options.rank;
      size_ = options.size;
    }
    collectiveSeq_ = 0;
    p2pSeq_ = 0;
    globalRanks_.clear();
    reconfigured_ = true;
    flightPgId_ = nextFlightPgId();  // a new membership, numbered from 0 again
    flightGroupRecorded_ = false;
    {
      std::lock_guard<std::mutex> lock(splitMutex_);
      splits_.clear();  // the old group's
    }
    if (old) retire(*old, members, mine.token);
    return coord::completedWork({});
  });
}

#endif

}  // namespace tpcomm::backend
