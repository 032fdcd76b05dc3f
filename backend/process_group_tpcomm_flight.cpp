// ProcessGroupTpcomm's entries in torch's flight recorder: the group's
// identity (registered on its first call), its sequence numbers, and one
// entry per call (backend/flight_record.hpp).
#include "backend/flight_record.hpp"
#include "backend/process_group_tpcomm.hpp"
#include "common/error.hpp"

namespace tpcomm::backend {

void ProcessGroupTpcomm::recordGroupOnce(const std::string& uid) {
  // Once per membership: again after a reconfigure changed the ranks.
  if (flightGroupRecorded_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(flightGroupMutex_);
  if (flightGroupRecorded_.load(std::memory_order_relaxed)) return;
  FlightRecord& fr = FlightRecord::get();
  std::vector<uint64_t> ranks = globalRanks_;
  if (ranks.size() != static_cast<size_t>(size_)) {
    ranks.clear();
    for (int r = 0; r < size_; ++r) ranks.push_back(static_cast<uint64_t>(r));
  }
  fr.recordGroup(uid, getGroupDesc(), ranks);
  // After a reconfigure the group's ranks are no longer the process's
  // global ones: the recorder keeps the rank it has.
  if (!reconfigured_) fr.setRank(static_cast<int>(ranks[rank_]));
  // The Gloo group inside records its own calls (tpcomm's set-up
  // exchanges, the Gloo route's transfers): under a name that says so.
  auto cpu = co().cpuBackend();
  cpu->setGroupUid(uid + ":tpcomm-internal");
  cpu->setGroupDesc("tpcomm's own Gloo group inside group " + uid);
  fr.recordGroup(cpu->getGroupUid(), cpu->getGroupDesc(), ranks);
  flightGroupRecorded_.store(true, std::memory_order_release);
}

FlightCall ProcessGroupTpcomm::recordCall(bool p2p, bool send, const char* op,
                                          c10::ArrayRef<at::Tensor> inputs,
                                          c10::ArrayRef<at::Tensor> outputs, int peer,
                                          uint64_t seq) {
  FlightRecord& fr = FlightRecord::get();
  const std::string& uid =
      getGroupUid().empty() ? co().options().groupName : getGroupUid();
  recordGroupOnce(uid);
  FlightCall call;
  call.p2p = p2p;
  call.name = std::string("nccl:") + flightOpName(op);
  if (peer >= 0) {
    call.name +=
        send ? detail::concat(" ", rank_, "->", peer) : detail::concat(" ", rank_, "<-", peer);
  }
  // The other sequence's number as it stands (torch records both).
  const uint64_t collective = p2p ? collectiveSeq_.load() : seq;
  const uint64_t pointToPoint = p2p ? seq : p2pSeq_.load();
  call.id = fr.record(flightPgId_, uid, getGroupDesc(), collective, pointToPoint, call.name, inputs,
                      outputs, co().options().timeout, p2p);
  return call;
}

}  // namespace tpcomm::backend
