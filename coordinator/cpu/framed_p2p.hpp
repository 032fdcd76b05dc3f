#pragma once
// Point-to-point on the CPU route (Gloo), framed, so that a send and a recv
// that differ raise instead of killing the receiving process (a larger
// send: Gloo's size check aborts it) or filling part of its tensor silently
// (a smaller one).
//
// A send of n bytes is one Gloo message of a 40-byte header (magic, bytes,
// dtype, elements, number) and the first min(n, kFramedFirstPart) bytes,
// on the call's tag; past that, a second message with the rest, on a rest
// tag of its own: kFramedRestTagBit | (number % kFramedRestWindow) << 20 |
// tag, where the number counts the group's messages with a rest from this
// rank to that one on that tag. A recv posts at once a recv of the largest
// first part into a staging buffer (a smaller message fills part of it, a
// larger one cannot come), checks the header when it has come, copies the
// bytes out and only then posts the rest's recv, of the size the header
// announced, on the rest tag the header names. Up to kFramedFirstPart a
// call costs what Gloo's own does, plus one copy per side; past it the
// rest's recv waits for the header.
//
// So each rest lands in its own message's recv, in whatever order the
// recvs of one tag are waited on, and whichever recv (from that rank or
// from any rank) Gloo handed the first part to. More than
// kFramedRestWindow messages with a rest in flight from one rank on one tag
// (a header read while the rest of the message kFramedRestWindow before it
// has not come) break the group, naming it, instead of mixing them up.
//
// A mismatch (bytes or dtype) breaks the group (`breakGroup`) with a reason
// naming both sides, before the rest is read: the receiving rank's recv
// raises it, and the sending rank's send is released with it (or, if it
// already completed, its next call on the group raises it).
//
// Every framed work completes once: by the first thread that waits on it,
// or, when nobody waits on it within about a millisecond, by a progress
// thread (one per peer, tag and direction with such work; Gloo's works
// complete only inside a wait), without a deadline of its own (a waiter's
// wait is bounded by its timeout, the group's when none; a break ends it). So an irecv nobody waits
// on still completes, as Gloo's own does (two ranks that each leave an irecv pending and block in a
// send to the other are never stuck), isCompleted() turns true without a wait, and what whenDone()
// registered (the flight recorder's retirement) runs when the call completes, waited on or not.
//
// `python -m tpcomm.bench p2p` times it against a plain Gloo group.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace tpcomm::coord {

// The bytes a send carries in its first message (with the header).
constexpr int64_t kFramedFirstPart = int64_t{256} << 10;
// Rest tags (see above). A message past the first part takes tags below
// kFramedLargeTagLimit; one within it, any tag.
constexpr int kFramedRestTagBit = 1 << 30;
constexpr int kFramedLargeTagLimit = 1 << 20;
// Tags from here to kFramedRestTagBit carry one-sided windows' messages
// between hosts (backend/window/remote_window.hpp): no caller's send or
// recv takes them.
constexpr int kFramedWindowTagBit = 1 << 29;
constexpr uint64_t kFramedRestWindow = 1024;

// A framed send or recv's Work.
class FramedWork : public c10d::Work {
 public:
  // `groupTimeout`: bounds a wait without a timeout of its own.
  FramedWork(int rank, c10d::OpType type, std::chrono::milliseconds groupTimeout);
  ~FramedWork() override;

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  // The first waiter completes the work in its own thread (Gloo's waits,
  // with `timeout`); a later one, or one after a progress thread took it,
  // waits for it up to `timeout` (the group's when none), then raises.
  // False when the work was aborted.
  bool wait(std::chrono::milliseconds timeout) override;
  // Runs `fn` once the work succeeded, on the thread that completed it (at
  // once when it had). Dropped, never run, when the work failed or was
  // aborted.
  void whenDone(std::function<void()> fn);

 protected:
  // The Gloo waits of the work: true when it completed, false when
  // aborted; throws Gloo's error or a mismatch.
  virtual bool run(std::chrono::milliseconds timeout) = 0;

 private:
  friend class FramedProgress;
  // Whether this caller is the one to run().
  bool claim();
  void complete(std::chrono::milliseconds timeout);
  static void runDone(const std::function<void()>& fn);

  const std::chrono::milliseconds groupTimeout_;

  // In FramedProgress's list of works nobody claimed yet (by its mutex;
  // the list holds a reference while `queued`).
  struct Queued {
    FramedWork* prev = nullptr;
    FramedWork* next = nullptr;
    bool queued = false;
    std::tuple<const void*, bool, int, int> lane;  // group, send, peer, tag
    std::chrono::steady_clock::time_point due;
  } queued_;

  mutable std::mutex mutex_;
  std::condition_variable settledCv_;
  bool claimed_ = false;                       // by mutex_
  bool settled_ = false;                       // by mutex_: run() returned or threw
  bool ok_ = false;                            // by mutex_: run() returned true
  std::exception_ptr failure_;                 // by mutex_
  std::vector<std::function<void()>> onDone_;  // by mutex_, until settled
};

// Hands a new work to the progress thread (framed_work.cpp), which
// completes it when nobody claims it; `group`, `send`, `peer`, `tag`: its
// lane.
void trackFramedWork(const c10::intrusive_ptr<FramedWork>& work, const void* group, bool send,
                     int peer, int tag);

// A group's numbering of its messages with a rest: one per group.
class FramedRests;
std::shared_ptr<FramedRests> makeFramedRests();

// `tensor`: contiguous; its bytes are sent as they are, whatever its dtype.
// `timeout`: the group's (FramedWork).
c10::intrusive_ptr<c10d::Work> framedSend(const c10::intrusive_ptr<c10d::Backend>& cpu,
                                          const at::Tensor& tensor, int dstRank, int tag,
                                          const std::shared_ptr<FramedRests>& rests,
                                          std::chrono::milliseconds timeout);

// `srcRank` -1: from any rank (recvAnysource). `rank`: this rank, for the
// mismatch's reason.
c10::intrusive_ptr<c10d::Work> framedRecv(const c10::intrusive_ptr<c10d::Backend>& cpu,
                                          const at::Tensor& tensor, int srcRank, int tag, int rank,
                                          std::function<void(const std::string&)> breakGroup,
                                          const std::shared_ptr<FramedRests>& rests,
                                          std::chrono::milliseconds timeout);

}  // namespace tpcomm::coord
