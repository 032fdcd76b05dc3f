#include "coordinator/debug/debug_p2p.hpp"

#include <atomic>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <tuple>

#include "common/error.hpp"
#include "coordinator/debug/debug_check.hpp"

namespace tpcomm::coord {

namespace {

enum class Side { kSend, kRecv };

const char* nameOf(Side side) { return side == Side::kSend ? "send" : "recv"; }
Side other(Side side) { return side == Side::kSend ? Side::kRecv : Side::kSend; }

// "1st", "2nd", "3rd", "4th", ..., "11th", "21st".
std::string ordinal(uint64_t n) {
  const uint64_t tens = n % 100;
  const char* suffix = "th";
  if (tens < 11 || tens > 13) {
    if (n % 10 == 1) suffix = "st";
    if (n % 10 == 2) suffix = "nd";
    if (n % 10 == 3) suffix = "rd";
  }
  return std::to_string(n) + suffix;
}

// What one side's header says: "float32|8|send float32[2, 4] to rank 1".
struct Header {
  std::string dtype;
  std::string numel;
  std::string call;
};

std::string encode(const at::Tensor& tensor, const std::string& call) {
  return dtypeName(tensor.scalar_type()) + "|" + std::to_string(tensor.numel()) + "|" + call;
}

Header decode(const std::vector<uint8_t>& raw) {
  std::string text(raw.begin(), raw.end());
  for (char& c : text) {
    if (c < 0x20 || c > 0x7e) c = '?';  // whatever else is under the key
  }
  Header h;
  const size_t a = text.find('|');
  const size_t b = a == std::string::npos ? a : text.find('|', a + 1);
  if (b == std::string::npos) {
    h.call = "an unreadable header (\"" + text + "\")";
    return h;
  }
  h.dtype = text.substr(0, a);
  h.numel = text.substr(a + 1, b - a - 1);
  h.call = text.substr(b + 1);
  return h;
}

std::vector<uint8_t> storeBytes(const std::string& text) { return {text.begin(), text.end()}; }

// What a header's key holds once one side has settled it (compareSet, so
// that exactly one of "the peer took it" and "its writer gave up" happens).
const std::vector<uint8_t> kTaken = storeBytes("taken");
const std::vector<uint8_t> kAbandoned = storeBytes("abandoned");

// One checked call's progress, shared by its Work and its helper thread.
struct State {
  enum class Phase { kChecking, kPosted, kFailed };
  std::mutex mutex;
  std::condition_variable changed;
  Phase phase = Phase::kChecking;
  c10::intrusive_ptr<c10d::Work> inner;  // once kPosted
  std::exception_ptr error;              // once kFailed
  int source = -1;                       // the peer, once known
  bool aborted = false;                  // abort() before the post: never post

  void posted(c10::intrusive_ptr<c10d::Work> work) {
    std::lock_guard<std::mutex> lock(mutex);
    inner = std::move(work);
    phase = Phase::kPosted;
    changed.notify_all();
  }
  void failed(std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mutex);
    error = std::move(e);
    phase = Phase::kFailed;
    changed.notify_all();
  }
};

class CheckedWork : public c10d::Work {
 public:
  // `bound`: how long wait() without a timeout waits for the check to end
  // (the helper thread ends it within that).
  CheckedWork(int rank, c10d::OpType type, std::shared_ptr<State> state,
              std::chrono::milliseconds bound, at::Tensor tensor)
      : c10d::Work(rank, type),
        state_(std::move(state)),
        bound_(bound),
        tensor_(std::move(tensor)) {}

  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->phase == State::Phase::kFailed) return true;
    return state_->phase == State::Phase::kPosted && state_->inner->isCompleted();
  }

  bool isSuccess() const override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->phase == State::Phase::kPosted && state_->inner->isSuccess();
  }

  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->phase == State::Phase::kFailed) return state_->error;
    return state_->phase == State::Phase::kPosted ? state_->inner->exception() : nullptr;
  }

  int sourceRank() const override {
    TORCH_CHECK(retrieveOpType() != c10d::OpType::SEND, "a send's Work has no source rank");
    std::lock_guard<std::mutex> lock(state_->mutex);
    TORCH_CHECK(state_->source >= 0,
                "the source rank of a recv from any source is known once it has been waited for");
    return state_->source;
  }

  std::vector<at::Tensor> result() override { return {tensor_}; }

  bool wait(std::chrono::milliseconds timeout) override {
    const auto start = std::chrono::steady_clock::now();
    c10::intrusive_ptr<c10d::Work> inner;
    {
      std::unique_lock<std::mutex> lock(state_->mutex);
      const auto limit = timeout == kNoTimeout ? bound_ : timeout;
      if (!state_->changed.wait_for(lock, limit,
                                    [&] { return state_->phase != State::Phase::kChecking; })) {
        TPCOMM_THROW(kTimeout, "TPCOMM_DEBUG: the check of this ",
                     c10d::opTypeToString(retrieveOpType()), " with its peer did not end within ",
                     limit.count(), " ms");
      }
      if (state_->phase == State::Phase::kFailed) std::rethrow_exception(state_->error);
      inner = state_->inner;
    }
    if (timeout == kNoTimeout) return inner->wait(timeout);
    const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - start);
    return inner->wait(std::max(timeout - spent, std::chrono::milliseconds(1)));
  }

  void abort() override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->aborted = true;
    if (state_->inner) state_->inner->abort();
  }

 private:
  std::shared_ptr<State> state_;
  std::chrono::milliseconds bound_;
  at::Tensor tensor_;
};

std::string callOf(Side side, const at::Tensor& tensor, const std::string& peer) {
  return std::string(nameOf(side)) + " " + describeTensor(tensor) +
         (side == Side::kSend ? " to " : " from ") + peer;
}

// wait() without a timeout: the header wait, the previous call's, and slack.
std::chrono::milliseconds boundOf(std::chrono::milliseconds timeout) {
  return 3 * timeout + std::chrono::seconds(5);
}

}  // namespace

struct P2pChecker::Shared {
  c10::intrusive_ptr<c10d::Store> store;
  std::string prefix;  // "tpcomm/p2p/<group>/"
  std::string groupName;
  int rank;
  int size;
  std::atomic<int64_t> timeoutMs;

  // A lane is (peer, side, tag): Gloo matches a lane's calls in the order
  // they were posted, so a lane posts in issue order.
  struct Lane {
    uint64_t next = 0;                // the number of the lane's next call
    std::shared_future<void> posted;  // the lane's last call has been posted or failed
  };
  std::mutex mutex;
  std::map<std::tuple<int, Side, int>, Lane> lanes;

  // One call's place on its lane.
  struct Turn {
    uint64_t number = 0;
    std::shared_future<void> previous;
    std::shared_ptr<std::promise<void>> mine;
  };

  Turn take(Lane& lane) {  // under mutex
    Turn turn;
    turn.number = lane.next++;
    turn.previous = lane.posted;
    turn.mine = std::make_shared<std::promise<void>>();
    lane.posted = turn.mine->get_future().share();
    return turn;
  }

  std::chrono::milliseconds timeout() const { return std::chrono::milliseconds(timeoutMs.load()); }

  // Until `ready()` or the group's timeout; false on the timeout. Polls with
  // short store calls: a store client serves one call at a time, so a
  // blocking wait here would hold up this rank's other calls' headers.
  template <typename Ready>
  bool poll(Ready&& ready) const {
    const auto deadline = std::chrono::steady_clock::now() + timeout();
    auto pause = std::chrono::microseconds(100);
    while (!ready()) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(2 * pause, std::chrono::milliseconds(5));
    }
    return true;
  }

  std::string key(int src, int dst, int tag, uint64_t number, Side side) const {
    return prefix + std::to_string(src) + ">" + std::to_string(dst) + "/" + std::to_string(tag) +
           "/" + std::to_string(number) + "/" + nameOf(side);
  }

  // The helper thread of one call: wait for the peer's header, compare,
  // wait for the lane's previous call, post.
  // `writeMine`: this call's own header is not in the store yet (a recv
  // from any source writes it once it has taken a peer).
  void check(const std::shared_ptr<State>& state, Side side, int peer, int tag, const Turn& turn,
             const std::string& mine, const Post& post, bool writeMine) {
    struct Release {  // the lane's next call may go once this one is done
      std::promise<void>& promise;
      ~Release() { promise.set_value(); }
    } release{*turn.mine};
    try {
      const int src = side == Side::kSend ? rank : peer;
      const int dst = side == Side::kSend ? peer : rank;
      if (writeMine) store->set(key(src, dst, tag, turn.number, side), storeBytes(mine));
      const std::string lane = "tag " + std::to_string(tag) + ", the " + ordinal(turn.number + 1) +
                               " message from rank " + std::to_string(src) + " to rank " +
                               std::to_string(dst) + " on that tag";
      const Header me = decode(storeBytes(mine));
      const std::string mineKey = key(src, dst, tag, turn.number, side);
      const std::string theirsKey = key(src, dst, tag, turn.number, other(side));
      const auto stoppedWaiting = [&] {
        TPCOMM_THROW(kTimeout, "TPCOMM_DEBUG: rank ", rank, " called ", me.call, " (", lane,
                     ") on group '", groupName, "', but rank ", peer,
                     " had stopped waiting for it (its ", nameOf(other(side)),
                     " reached the group's timeout of ", timeout().count(),
                     " ms first); nothing was ", side == Side::kSend ? "sent" : "received");
      };
      if (!poll([&] { return store->check({theirsKey}); })) {
        // Give up, unless the peer took this call's header meanwhile (it
        // then posts, and its own header is in the store already).
        if (store->compareSet(mineKey, storeBytes(mine), kAbandoned) == kAbandoned) {
          TPCOMM_THROW(kTimeout, "TPCOMM_DEBUG: rank ", rank, " called ", me.call, " (", lane,
                       ") on group '", groupName, "', but rank ", peer, " has not called the ",
                       nameOf(other(side)), " that meets it within the group's timeout (",
                       timeout().count(), " ms) of this call; nothing was ",
                       side == Side::kSend ? "sent" : "received");
        }
      }
      const std::vector<uint8_t> raw = store->get(theirsKey);
      // Take the peer's header, unless the peer gave up on it first.
      const bool took = raw != kAbandoned && store->compareSet(theirsKey, raw, kTaken) == kTaken;
      store->deleteKey(theirsKey);
      if (!took) stoppedWaiting();
      const Header theirs = decode(raw);
      if (theirs.dtype != me.dtype || theirs.numel != me.numel) {
        const std::string sendCall = side == Side::kSend ? me.call : theirs.call;
        const std::string recvCall = side == Side::kSend ? theirs.call : me.call;
        TPCOMM_THROW(kInvalidUsage, "TPCOMM_DEBUG: send/recv mismatch on group '", groupName,
                     "': rank ", src, " called ", sendCall, " and rank ", dst, " called ", recvCall,
                     " (", lane,
                     "); a send and its recv must agree on dtype and element count. Nothing "
                     "was sent; the calls that follow on this tag still pair up.");
      }
      if (turn.previous.valid() &&
          turn.previous.wait_for(2 * timeout()) != std::future_status::ready) {
        TPCOMM_THROW(kTimeout, "TPCOMM_DEBUG: ", me.call, " (", lane,
                     "): the previous call on that tag is still being checked");
      }
      {
        std::lock_guard<std::mutex> lock(state->mutex);
        TPCOMM_CHECK(!state->aborted, kPeerLost, "TPCOMM_DEBUG: ", me.call, " (", lane,
                     ") was aborted before it was posted");
      }
      state->posted(post(peer));
    } catch (...) {
      state->failed(std::current_exception());
    }
  }

  static c10::intrusive_ptr<c10d::Work> start(const std::shared_ptr<Shared>& self, Side side,
                                              const at::Tensor& tensor, int peer, int tag,
                                              Post post);
  static c10::intrusive_ptr<c10d::Work> startAnysource(const std::shared_ptr<Shared>& self,
                                                       const at::Tensor& tensor, int tag,
                                                       Post post);
  // A recv from any source: the first peer (in rank order) whose next send
  // header on `tag` is in the store, with that lane's turn taken.
  std::pair<int, Turn> takeAnySender(int tag, const std::string& call);
};

P2pChecker::P2pChecker(c10::intrusive_ptr<c10d::Store> store, std::string groupName, int rank,
                       int size, std::chrono::milliseconds timeout)
    : shared_(std::make_shared<Shared>()) {
  shared_->store = std::move(store);
  shared_->prefix = "tpcomm/p2p/" + groupName + "/";
  shared_->groupName = std::move(groupName);
  shared_->rank = rank;
  shared_->size = size;
  shared_->timeoutMs = timeout.count();
}

void P2pChecker::setTimeout(std::chrono::milliseconds timeout) {
  shared_->timeoutMs = timeout.count();
}

c10::intrusive_ptr<c10d::Work> P2pChecker::Shared::start(const std::shared_ptr<Shared>& self,
                                                         Side side, const at::Tensor& tensor,
                                                         int peer, int tag, Post post) {
  const std::string call = callOf(side, tensor, "rank " + std::to_string(peer));
  const std::string mine = encode(tensor, call);
  const int src = side == Side::kSend ? self->rank : peer;
  const int dst = side == Side::kSend ? peer : self->rank;
  auto state = std::make_shared<State>();
  state->source = peer;
  {
    // The header is written now, at issue time: the peer's check waits only
    // for this rank having made the call, never for its progress. The lane's
    // number is taken once the write succeeded (under the lock, so calls on
    // one lane from several threads stay in order): a failed write leaves
    // both sides in step.
    std::lock_guard<std::mutex> lock(self->mutex);
    Shared::Lane& lane = self->lanes[{peer, side, tag}];
    const std::string mineKey = self->key(src, dst, tag, lane.next, side);
    self->store->set(mineKey, storeBytes(mine));
    const Turn turn = self->take(lane);
    try {
      std::thread([self, state, side, peer, tag, turn, mine, post = std::move(post)] {
        self->check(state, side, peer, tag, turn, mine, post, false);
      }).detach();
    } catch (const std::system_error& e) {
      // The peer's call fails too, unless it took the header already.
      turn.mine->set_value();
      self->store->compareSet(mineKey, storeBytes(mine), kAbandoned);
      TPCOMM_THROW(kSystem, "TPCOMM_DEBUG: could not start the check of ", call, ": ", e.what());
    }
  }
  return c10::make_intrusive<CheckedWork>(
      self->rank, side == Side::kSend ? c10d::OpType::SEND : c10d::OpType::RECV, state,
      boundOf(self->timeout()), tensor);
}

std::pair<int, P2pChecker::Shared::Turn> P2pChecker::Shared::takeAnySender(
    int tag, const std::string& call) {
  int found = -1;
  Turn turn;
  const bool taken = poll([&] {
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      uint64_t number;
      {
        std::lock_guard<std::mutex> lock(mutex);
        number = lanes[{peer, Side::kRecv, tag}].next;
      }
      if (!store->check({key(peer, rank, tag, number, Side::kSend)})) continue;
      std::lock_guard<std::mutex> lock(mutex);
      Lane& lane = lanes[{peer, Side::kRecv, tag}];
      // A recv naming this peer may have taken that message meanwhile.
      if (lane.next != number) continue;
      found = peer;
      turn = take(lane);
      return true;
    }
    return false;
  });
  if (!taken) {
    TPCOMM_THROW(kTimeout, "TPCOMM_DEBUG: rank ", rank, " called ", call, " (tag ", tag,
                 ") on group '", groupName, "', but no rank has called a send to it within ",
                 "the group's timeout (", timeout().count(), " ms); nothing was received");
  }
  return {found, turn};
}

c10::intrusive_ptr<c10d::Work> P2pChecker::Shared::startAnysource(
    const std::shared_ptr<Shared>& self, const at::Tensor& tensor, int tag, Post post) {
  const std::string call = callOf(Side::kRecv, tensor, "any source");
  const std::string mine = encode(tensor, call);
  auto state = std::make_shared<State>();
  auto body = [self, state, tag, call, mine, post = std::move(post)] {
    std::pair<int, Turn> taken;
    try {
      taken = self->takeAnySender(tag, call);
    } catch (...) {
      state->failed(std::current_exception());
      return;
    }
    {
      std::lock_guard<std::mutex> lock(state->mutex);
      state->source = taken.first;
    }
    const std::string named = mine + " (took rank " + std::to_string(taken.first) + "'s message)";
    self->check(state, Side::kRecv, taken.first, tag, taken.second, named, post, true);
  };
  try {
    std::thread(std::move(body)).detach();
  } catch (const std::system_error& e) {
    TPCOMM_THROW(kSystem, "TPCOMM_DEBUG: could not start the check of ", call, ": ", e.what());
  }
  return c10::make_intrusive<CheckedWork>(self->rank, c10d::OpType::RECVANYSOURCE, state,
                                          boundOf(self->timeout()) + self->timeout(), tensor);
}

c10::intrusive_ptr<c10d::Work> P2pChecker::send(const at::Tensor& tensor, int dst, int tag,
                                                Post post) {
  return Shared::start(shared_, Side::kSend, tensor, dst, tag, std::move(post));
}

c10::intrusive_ptr<c10d::Work> P2pChecker::recv(const at::Tensor& tensor, int src, int tag,
                                                Post post) {
  return Shared::start(shared_, Side::kRecv, tensor, src, tag, std::move(post));
}

c10::intrusive_ptr<c10d::Work> P2pChecker::recvAnysource(const at::Tensor& tensor, int tag,
                                                         Post post) {
  return Shared::startAnysource(shared_, tensor, tag, std::move(post));
}

}  // namespace tpcomm::coord
