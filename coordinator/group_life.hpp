#pragma once
// A group's life: what tells one making of a group from an earlier one made
// under the same name on the same store (a replica that rejoins, a second
// init_process_group on the same store object). Every store key tpcomm and
// its Gloo groups write lives under the life's prefix, so that nothing of
// an earlier life (fault lines, positions, Gloo's rendezvous records, which
// would connect a new group to an old one's listener) reaches a new one.
//
// The ranks agree on it through the group's store, before anything else of
// the group is made:
//   rank 0:   picks a random id, sets "tpcomm/life" to it, waits for
//             "tpcomm/life-done/<id>", sets "tpcomm-life-<id>/tpcomm/life-ok"
//             (under the life's prefix: removed when the life ends), then
//             sets "tpcomm/life" to "spent:<id>" (not deleted while a rank
//             may read it: once the making ended, rank 0 deletes it) and
//             deletes "-read/<id>" and "-done/<id>";
//   the rest: wait for "tpcomm/life" to hold an id not spent, read it, add 1 to
//             "tpcomm/life-read/<id>" (the last to read sets
//             "tpcomm/life-done/<id>"), and wait for its life-ok;
//             an id that "tpcomm/life" no longer holds meanwhile (one a rank
//             0 that died while making an earlier life left behind) is
//             dropped for the one it holds now.
// Rank 0 spends the id only after every rank read it, and before it makes
// the group's Gloo group, which no rank completes without it: so a rank
// that asks for the next life (after it made this one) never takes this
// life's id. Every wait is bounded by the group's timeout.
//
// A making ends together (finishMaking): no rank returns the group before
// every rank's part of it is made. Gloo's side that opens a connection is
// done once its bytes are sent, before the peer took the connection; a rank
// that destroys a group it just made (a group made and dropped at once, as
// vLLM's switch of routes does) would close connections a slower peer is
// still to take, and that peer's making fails ("Connection closed by peer")
// while the others have gone on. A rank whose part fails says why in the
// store, and every other rank past its Gloo rendezvous raises it at once
// instead of waiting out the timeout. Under the life's prefix:
//   each rank: adds 1 to "tpcomm/made-or-failed" and to "tpcomm/made" (the
//             last to "made" sets "tpcomm/made-all"), waits for
//             "tpcomm/made-all", then raises what "tpcomm/not-made" holds,
//             if anything; one whose wait runs out adds size + 1 to
//             "tpcomm/made": if that finds every rank made its part, it
//             goes on as made, else no rank can end the making as made any
//             more, and it appends "gave up" to "tpcomm/not-made" and sets
//             "tpcomm/made-all" (the others, later ones too, raise it);
//   a rank whose part failed: appends "rank <r>: <why>" to "tpcomm/not-made",
//             sets "tpcomm/made-all", adds 1 to "tpcomm/made-or-failed".
// When the making failed, a rank raises only once every rank ended it
// ("tpcomm/made-or-failed" at the group's size, within the timeout),
// keeping its Gloo group until then: no peer still in Gloo's rendezvous
// loses a connection under it. A making thus waits up to three timeouts
// (the life, Gloo's rendezvous, the end), each bounded.

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace tpcomm::coord {

// The life every rank of a group of `size` made through `store` agrees on
// (16 hex digits). Collective. Throws kTimeout when a rank does not take
// part within `timeout`.
std::string agreeOnLife(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                        std::chrono::milliseconds timeout);

// The end of a making, on the life's store (storeOfLife): returns once every
// rank of the group of `size` called it after making its part. Collective.
// Throws kPeerLost naming each rank whose part failed and why, kTimeout
// naming how many ranks finished when one did not come within `timeout`.
// With a `failure` (this rank's part failed) it says so to the others, waits
// (bounded) until every rank ended its making, and returns: the caller
// raises its own error, and keeps what it made of its part (its Gloo group)
// alive until then. Never throws then.
void finishMaking(const c10::intrusive_ptr<c10d::Store>& lifeStore, int rank, int size,
                  std::chrono::milliseconds timeout,
                  const std::optional<std::string>& failure = std::nullopt);

// Runs `make` (this rank's part of a group: its Gloo group, its coordinator)
// and ends the making together (finishMaking), reporting what `make` threw.
// `make` assigns its Gloo group to a variable of the caller's, so that the
// group outlives a throw until every rank ended the making.
template <typename Make>
auto makeTogether(const c10::intrusive_ptr<c10d::Store>& lifeStore, int rank, int size,
                  std::chrono::milliseconds timeout, Make&& make) -> decltype(make()) {
  auto made = [&] {
    try {
      return make();
    } catch (const std::exception& e) {
      finishMaking(lifeStore, rank, size, timeout, std::string(e.what()));
      throw;
    } catch (...) {
      finishMaking(lifeStore, rank, size, timeout,
                   std::string("an exception that is not a std::exception"));
      throw;
    }
  }();
  finishMaking(lifeStore, rank, size, timeout);
  return made;
}

// The end of a life: each rank calls it once, when it is done with the
// group (its shutdown, after its backends'; its abort, which torch uses to
// drop groups without a shutdown). The last of the group's `size`
// ranks to call it removes every key under the life's prefix (through the
// store's listKeys; only the keys tpcomm itself writes where the store cannot
// list them), so that a process that makes and drops groups for days does
// not grow its store: aborted and broken groups' too (their fault lines;
// a peer's watcher reads them without waiting, readWithoutWaiting). Kept:
// everything of a group a rank never left (one that lost a rank, or was
// shut down with calls in flight: GroupCoordinator::shutdown ends the life
// only when this rank has no call in flight, on a thread of its own that it
// waits for at most a second, so that a store that no longer answers never
// holds its way out). Returns whether this call removed them. Never throws.
// `ranks`: the ranks this call leaves for (its own; a shrink leaves for
// the ranks it excluded: GroupCoordinator::shrink), each counted once
// whoever says it leaves and how often ("tpcomm/left/<rank>"); nothing is
// counted once the keys are gone.
bool endLife(const c10::intrusive_ptr<c10d::Store>& lifeStore, int size,
             const std::vector<int>& ranks) noexcept;

// `key`'s value, or nothing when there is no such key, without waiting for
// it (a get waits for a missing key until the store's timeout): a key of a
// life may be removed between two reads once its last rank left
// (endLife). One compareSet whose expected value no key holds: it answers
// with the value and writes nothing.
std::optional<std::vector<uint8_t>> readWithoutWaiting(const c10::intrusive_ptr<c10d::Store>& store,
                                                       const std::string& key);

// 16 hex digits drawn at random (a life's id, a reconfigure handle's token).
std::string randomId();

// Every one of `size` members (this one is `member`) adds itself to
// `arrivedKey` and waits until all did, at most `timeout`. A member whose
// part failed says why under `refusedKey` (before it raises); so does one
// that gives up waiting, or whose `check` (run between polls) throws: every
// other member, and one that comes later, raises that at once (PeerLost)
// instead of waiting out the timeout. Polls back off from 1 to 10 ms. For
// the meetings of a reconfigure and of a window's registration.
void meetOnStore(c10d::Store& store, const std::string& arrivedKey,
                 const std::string& refusedKey, int member, int size,
                 std::chrono::milliseconds timeout, const std::string& what,
                 const std::function<void()>& check = {});

// `store` with every key under the life's prefix ("tpcomm-life-<life>/").
c10::intrusive_ptr<c10d::Store> storeOfLife(const c10::intrusive_ptr<c10d::Store>& store,
                                            const std::string& life);

}  // namespace tpcomm::coord
