#pragma once
// tpcomm::mq::ShmWindow — one-sided access among the processes of one host
// (torch's c10d::Window on tpcomm: backend/window/). Each rank owns one
// region, its window, which every peer maps: a put is a copy into the
// target's bytes, a signal an atomic add in the target's control block, a
// wait for a signal a bounded wait on one's own. Plain C++ (no torch).
//
// Region of rank r (a SharedRegion r created; offsets from its base()):
//
//   +-----------------------------+ 0
//   | Header                      |  magic, size, the owner's pid, data bytes;
//   |                             |  futex word + sleeper count (wait_signal)
//   +-----------------------------+ kSignalsOffset
//   | signals[size]               |  one cache line per peer p: signals p
//   |                             |  sent r (u64, only p adds to it)
//   +-----------------------------+ dataOffset (page aligned)
//   | data                        |  the bytes r registered
//   +-----------------------------+
//
// Ordering: a put's copy happens before the signal that follows it (the
// add is a release), and a wait that counted that signal (an acquire load)
// sees the copy: put, then signal, then the peer's wait_signal, then its
// reads, is the pattern. Puts without a signal between them are unordered
// with the target's reads. Each signal is matched by one wait_signal, in
// order (a count, never reset: the waiter keeps how many it consumed).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace tpcomm::mq {

class SharedRegion;
class PeerProcess;

class ShmWindow {
 public:
  // Creates this rank's region with room for `dataBytes` (0 allowed).
  // Throws System.
  ShmWindow(int rank, int size, size_t dataBytes);
  ~ShmWindow();
  ShmWindow(const ShmWindow&) = delete;
  ShmWindow& operator=(const ShmWindow&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The name peers attach this rank's region by (SharedRegion::name()).
  std::string name() const;
  // Maps every peer's region from its name (`names[rank()]` is skipped, as
  // is an empty name: a peer on another host, whose puts and signals reach
  // this rank through deliver()/deliverSignal() instead).
  // Throws InvalidUsage naming the rank whose name is not a region name or
  // whose region is not a window of this size, System when it cannot be
  // mapped (the creator exited, another host).
  void attach(const std::vector<std::string>& names);
  // Closes this rank's descriptor once every peer attached: no process
  // can map the region any more, the mappings stay.
  void closeDescriptor();

  // Rank r's data (this rank's too) and its size; the region stays mapped
  // as long as a holder of `keep(r)` lives.
  char* data(int r) const;
  size_t dataBytes(int r) const;
  std::shared_ptr<void> keep(int r) const;

  // Copies `bytes` from `src` into rank `dst`'s data at `offset` (they may
  // overlap: a put into this rank's own window from a view of it). Throws
  // InvalidUsage when that runs past its end.
  void put(int dst, size_t offset, const void* src, size_t bytes);
  // One signal to rank `dst` (a release: what this rank wrote before is
  // seen by the wait that counts it).
  void signal(int dst);
  // Waits for the next signal of rank `src`, at most `timeout`; waits on
  // one source from several threads take its signals one each, in turn. `check`
  // runs every millisecond or so while waiting (it throws to end the wait:
  // the group broke). Throws PeerLost naming `src` when its process exited
  // before signalling, Timeout naming it and the counts when none came.
  void waitSignal(int src, std::chrono::milliseconds timeout,
                  const std::function<void()>& check = {});
  // What a peer on another host sent this rank, applied by the thread that
  // receives it (backend/window/remote_window.hpp): bytes into this rank's
  // data (InvalidUsage past its end), one signal of `src`.
  void deliver(size_t offset, const void* src, size_t bytes) { put(rank_, offset, src, bytes); }
  void deliverSignal(int src);
  // Whether rank r's region is mapped here (this rank's, one of its host).
  bool mapped(int r) const { return r >= 0 && r < size_ && regions_[r] != nullptr; }
  // Signals rank `src` sent this rank so far, and how many a wait took.
  uint64_t signalsFrom(int src) const;
  uint64_t consumedFrom(int src) const { return consumed_.at(src); }

 private:
  struct Header;
  Header* header(int r) const;
  void checkRank(int r, const char* what) const;

  int rank_;
  int size_;
  std::vector<std::shared_ptr<SharedRegion>> regions_;  // [r]: rank r's
  std::vector<std::unique_ptr<PeerProcess>> peers_;     // [r]: rank r's process
  std::vector<uint64_t> consumed_;                      // [r]: signals of r waited for
  std::unique_ptr<std::mutex[]> waiting_;               // [r]: one wait on r at a time
};

}  // namespace tpcomm::mq
