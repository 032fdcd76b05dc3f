// The shared-memory collectives' life around the calls, with a forked process
// per rank: worker threads splitting large calls (the bits of one thread),
// the call signature's eps and coalesced position, a peer whose main thread
// ended, a rank that destroys its group, and calls in a forked child.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#include "common/error.hpp"
#include "message_queue/collectives/shm_group.hpp"
#include "message_queue/collectives/worker_pool.hpp"
#include "shm_group_support.hpp"

namespace tpcomm::mq {
namespace {

using namespace std::chrono_literals;

// Large calls split among worker threads give the bits of one thread: the
// rank-order reference for allreduce and reduce-scatter, the inputs for
// all-gather and broadcast, one- and two-phase, in and out of place.
TEST(ShmGroup, WorkerThreadsGiveTheBitsOfOneThread) {
  for (int threads : {1, 3}) {
    for (uint64_t twoPhase : {uint64_t{1} << 40, uint64_t{16} << 10}) {
      ShmGroupOptions o;
      o.timeout = 60s;
      o.threads = threads;
      o.twoPhaseMinBytes = twoPhase;
      const auto body = [threads](ShmGroup& g) {
        const int n = g.options().size;
        const int me = g.options().rank;
        CHILD_CHECK(g.threads() == threads, "threads %d", g.threads());
        for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kInt64}) {
          const size_t count = (5u << 20) / dtypeBytes(d) / 2 + 7;  // 2.5 MiB: three chunks
          ReduceSpec sum;
          std::vector<char> in, want;
          std::vector<double> exact;
          makeInput(d, me, count, in, false);
          reference(d, sum, n, count, false, want, exact);
          std::vector<char> out(in.size());
          g.allreduce(in.data(), out.data(), count, d, sum);
          CHILD_CHECK(std::memcmp(out.data(), want.data(), want.size()) == 0, "allreduce %s",
                      dtypeName(d));
          g.allreduce(in.data(), in.data(), count, d, sum);  // in place
          CHILD_CHECK(std::memcmp(in.data(), want.data(), want.size()) == 0,
                      "in-place allreduce %s", dtypeName(d));
          // Reduce-scatter: rank r's input holds n slices; slice j of every
          // rank is reduced into rank j's output.
          std::vector<std::vector<char>> slices(n), wants(n);
          std::vector<const void*> ins;
          for (int j = 0; j < n; ++j) makeInput(d, me + 7 * j, count / n, slices[j], false);
          for (int j = 0; j < n; ++j) ins.push_back(slices[j].data());
          std::vector<char> scattered(count / n * dtypeBytes(d));
          g.reduceScatter(ins, scattered.data(), count / n, d, sum);
          // The reference of slice `me`: every rank r contributed makeInput(r + 7 me).
          std::vector<std::vector<char>> theirs(n);
          std::vector<const void*> srcs;
          for (int r = 0; r < n; ++r) {
            makeInput(d, r + 7 * me, count / n, theirs[r], false);
            srcs.push_back(theirs[r].data());
          }
          std::vector<char> expected(scattered.size());
          reduceIntoWith(ReduceIsa::kPortable, expected.data(), srcs.data(), n, count / n, d, sum);
          CHILD_CHECK(std::memcmp(scattered.data(), expected.data(), expected.size()) == 0,
                      "reduce_scatter %s", dtypeName(d));
        }
        const size_t bytes = (3u << 20) + 100;
        std::vector<char> mine(bytes), all(bytes * n);
        for (size_t i = 0; i < bytes; ++i) mine[i] = static_cast<char>(i * 31 + me * 7);
        std::vector<void*> outs;
        for (int r = 0; r < n; ++r) outs.push_back(all.data() + r * bytes);
        g.allgather(mine.data(), bytes, outs);
        for (int r = 0; r < n; ++r) {
          for (size_t i = 0; i < bytes; i += 4099) {
            CHILD_CHECK(all[r * bytes + i] == static_cast<char>(i * 31 + r * 7), "all_gather");
          }
        }
        g.allgather(all.data() + me * bytes, bytes, outs);  // in place
        CHILD_CHECK(all[me * bytes + 5] == static_cast<char>(5 * 31 + me * 7), "in place");
        g.broadcast(mine.data(), bytes, 1);
        for (size_t i = 0; i < bytes; i += 4099) {
          CHILD_CHECK(mine[i] == static_cast<char>(i * 31 + 7), "broadcast");
        }
        return 0;
      };
      for (int code : runRanks(3, o, body)) EXPECT_EQ(code, 0) << threads << " threads";
    }
  }
}

TEST(WorkerPool, RunsEveryPartOnceAndRethrowsAPartsError) {
  // Sleeping workers, and workers that poll for the next task (as those
  // pinned to CPUs of their own do), with runs back to back and apart.
  for (const auto spin : {std::chrono::microseconds(0), std::chrono::microseconds(200)}) {
    WorkerPool pool(4, {}, spin);
    EXPECT_EQ(pool.threads(), 4);
    for (int round = 0; round < 200; ++round) {
      std::vector<std::atomic<int>> hits(1 + round % 9);
      pool.run(hits.size(), [&](size_t p) { hits[p].fetch_add(1); });
      for (auto& h : hits) ASSERT_EQ(h.load(), 1) << round << " spin " << spin.count();
      if (round % 50 == 0) std::this_thread::sleep_for(std::chrono::microseconds(300));
    }
    EXPECT_THROW(pool.run(6,
                          [](size_t p) {
                            if (p == 4) throw std::runtime_error("part 4");
                          }),
                 std::runtime_error);
    std::atomic<int> after{0};
    pool.run(5, [&](size_t) { after.fetch_add(1); });
    EXPECT_EQ(after.load(), 5);
  }
  // Destroyed while its workers poll: they end at once.
  const auto start = std::chrono::steady_clock::now();
  {
    WorkerPool polling(3, {}, std::chrono::microseconds(100000));
    polling.run(3, [](size_t) {});
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(90));
}

TEST(WorkerPool, PinsEachWorkerToItsCpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(::sched_getaffinity(0, sizeof(set), &set), 0);
  int cpu = -1;
  for (int c = CPU_SETSIZE - 1; c >= 0 && cpu < 0; --c) cpu = CPU_ISSET(c, &set) ? c : -1;
  WorkerPool pool(2, {cpu});
  EXPECT_EQ(pool.pinned(), 1);
  // Part 1 runs on the worker (the caller takes part 0, sleeps in it, then
  // waits), which runs on its CPU and nowhere else.
  const auto caller = std::this_thread::get_id();
  int byWorkerRounds = 0;
  for (int round = 0; round < 20; ++round) {
    std::atomic<int> where{-1};
    std::atomic<bool> byWorker{false};
    pool.run(2, [&](size_t p) {
      if (p == 1) {
        where = ::sched_getcpu();
        byWorker = std::this_thread::get_id() != caller;
      }
      if (p == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    });
    if (byWorker.load()) {
      ++byWorkerRounds;
      EXPECT_EQ(where.load(), cpu) << "round " << round;
    }
  }
  // The check above needs the worker to have run: with the caller asleep
  // 2 ms in part 0 it takes part 1 in (nearly) every round.
  EXPECT_GT(byWorkerRounds, 0) << "the worker took no part in 20 rounds: nothing was checked";
  // A CPU the kernel refuses leaves the worker unpinned.
  WorkerPool refused(2, {CPU_SETSIZE - 1});
  EXPECT_EQ(refused.pinned(), CPU_ISSET(CPU_SETSIZE - 1, &set) ? 1 : 0);
}

TEST(ShmGroup, CoalescedPositionsAndTheFusedEpsArePartOfTheSignature) {
  const auto body = [](ShmGroup& g) {
    const int me = g.options().rank;
    // Rank 1's coalesced list is one tensor longer: its first tensor pairs
    // with rank 0's first only by size, which is not enough.
    std::vector<float> x(16, 1.0f);
    try {
      g.allreduce(x.data(), x.data(), x.size(), DType::kFloat32, ReduceSpec{},
                  ShmPart{0, me == 1 ? 3u : 2u});
      return 2;
    } catch (const Error& e) {
      CHILD_CHECK(e.code() == ErrorCode::kInvalidUsage, "code");
      const std::string what = e.what();
      CHILD_CHECK(what.find("tensor 1 of a coalesced list of 3") != std::string::npos &&
                      what.find("tensor 1 of a coalesced list of 2") != std::string::npos,
                  "message: %s", what.c_str());
    }
    std::vector<float> gathered(32);
    try {
      g.allgather(x.data(), 64, {gathered.data(), gathered.data() + 16},
                  ShmPart{me == 0 ? 1u : 0u, 2});
      return 3;
    } catch (const Error& e) {
      CHILD_CHECK(std::string(e.what()).find("tensor 2 of a coalesced list") != std::string::npos,
                  "message: %s", e.what());
    }
    // The fused call with another eps on rank 1.
    const size_t hidden = 8;
    std::vector<float> in(hidden, 1.0f), residual(hidden, 0.5f), weight(hidden, 1.0f);
    std::vector<float> normed(hidden), residualOut(hidden);
    NormRows norm;
    norm.residual = residual.data();
    norm.residualOut = residualOut.data();
    norm.weight = weight.data();
    norm.normed = normed.data();
    norm.hidden = hidden;
    norm.eps = me == 1 ? 1e-5 : 1e-6;
    try {
      g.allreduceAddRmsNorm(in.data(), 1, DType::kFloat32, norm);
      return 4;
    } catch (const Error& e) {
      const std::string what = e.what();
      CHILD_CHECK(what.find("eps 1e-05") != std::string::npos &&
                      what.find("eps 1e-06") != std::string::npos,
                  "message: %s", what.c_str());
    }
    // Equal places and eps: served, and the group stays usable.
    std::vector<float> y(16, static_cast<float>(me + 1));
    g.allreduce(y.data(), y.data(), y.size(), DType::kFloat32, ReduceSpec{}, ShmPart{1, 2});
    CHILD_CHECK(y[0] == 3.0f, "after the mismatches: %g", y[0]);
    norm.eps = 1e-6;
    g.allreduceAddRmsNorm(in.data(), 1, DType::kFloat32, norm);
    CHILD_CHECK(residualOut[0] == 2.5f, "fused after the mismatches: %g", residualOut[0]);
    return 0;
  };
  for (int code : runRanks(2, smallBuffers(1ull << 40), body)) EXPECT_EQ(code, 0);
}

// An abort's text reaches the peers' errors (a hierarchical group's leader
// aborts its host's group with what failed between hosts).
TEST(ShmGroup, APeersAbortReasonIsInTheErrorsOfTheOthers) {
  ShmGroupOptions o = smallBuffers(1ull << 40);
  o.timeout = 60s;
  const auto body = [](ShmGroup& g) {
    if (g.options().rank == 0) {
      g.abort("host 'b' (ranks 2, 3) went away");
      return 0;
    }
    float x = 1.0f;
    try {
      g.broadcast(&x, sizeof(x), 0);
    } catch (const Error& e) {
      const std::string what = e.what();
      CHILD_CHECK(e.code() == ErrorCode::kPeerLost, "code %d", static_cast<int>(e.code()));
      CHILD_CHECK(what.find("rank 0 of the group aborted: host 'b' (ranks 2, 3) went away") !=
                      std::string::npos,
                  "message: %s", what.c_str());
      return 0;
    }
    CHILD_CHECK(false, "the broadcast returned after the root aborted");
    return 0;
  };
  for (int code : runRanks(2, o, body)) EXPECT_EQ(code, 0);
}

TEST(ShmGroup, APeerWhoseMainThreadEndedWhileAnotherThreadRunsIsAlive) {
  ShmGroupOptions o = smallBuffers(1ull << 40);
  o.timeout = 60s;
  const auto body = [](ShmGroup& g) {
    if (g.options().rank == 0) {
      std::thread([&g] {
        std::this_thread::sleep_for(300ms);  // the peer sleeps, checking liveness meanwhile
        float x = 1.0f;
        try {
          g.allreduce(&x, &x, 1, DType::kFloat32, ReduceSpec{});
        } catch (const std::exception& e) {
          std::fprintf(stderr, "rank 0's thread: %s\n", e.what());
          ::_exit(3);
        }
        ::_exit(x == 3.0f ? 0 : 4);
      }).detach();
      ::syscall(SYS_exit, 0);  // ends this thread only (no unwinding, no exit_group)
    }
    float x = 2.0f;
    g.allreduce(&x, &x, 1, DType::kFloat32, ReduceSpec{});
    CHILD_CHECK(x == 3.0f, "sum %g", x);
    return 0;
  };
  for (int code : runRanks(2, o, body)) EXPECT_EQ(code, 0);
}

TEST(ShmGroup, ARankThatDestroysItsGroupIsNamedByItsPeersAtOnce) {
  ShmGroupOptions o = smallBuffers(1ull << 40);
  o.timeout = 60s;  // far longer than the test may take
  const size_t bytes = ShmGroup::regionBytes(3, o.bufferBytes);
  auto region = SharedRegion::create(bytes);
  ShmGroup::initRegion(region->base(), 3, o.bufferBytes, o.twoPhaseMinBytes);
  const pid_t parent = ::getpid();
  std::vector<pid_t> pids;
  for (int r = 0; r < 3; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      int status = 0;
      try {
        ShmGroupOptions options = o;
        options.rank = r;
        options.size = 3;
        auto group = std::make_unique<ShmGroup>(
            SharedRegion::attach(parent, region->fd(), bytes, region->nonce()), options,
            std::vector<int32_t>(3, 0));
        float x = 1.0f;
        group->allreduce(&x, &x, 1, DType::kFloat32, ReduceSpec{});
        if (r == 2) {
          group.reset();  // leaves, and stays alive
          std::this_thread::sleep_for(3s);
          ::_exit(0);
        }
        const auto start = std::chrono::steady_clock::now();
        try {
          group->allreduce(&x, &x, 1, DType::kFloat32, ReduceSpec{});
          status = 10;
        } catch (const Error& e) {
          const double s =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          const std::string what = e.what();
          if (e.code() != ErrorCode::kPeerLost ||
              what.find("rank 2 left the group") == std::string::npos) {
            std::fprintf(stderr, "rank %d: %s\n", r, what.c_str());
            status = 11;
          } else if (s > 1.0) {
            std::fprintf(stderr, "rank %d raised after %.2f s\n", r, s);
            status = 12;
          }
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        status = 13;
      }
      ::_exit(status);
    }
    pids.push_back(pid);
  }
  for (pid_t p : pids) {
    int status = 0;
    ::waitpid(p, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
}

TEST(ShmGroup, CallsInAForkedChildRaiseEvenWhileTheParentHoldsTheLock) {
  ShmGroupOptions o = smallBuffers(1ull << 40);
  o.timeout = 60s;
  const auto body = [](ShmGroup& g) {
    const int me = g.options().rank;
    float x = 1.0f;
    g.allreduce(&x, &x, 1, DType::kFloat32, ReduceSpec{});
    if (me == 1) std::this_thread::sleep_for(500ms);  // rank 0's call waits, holding its lock
    std::thread waiting;
    if (me == 0) {
      waiting = std::thread([&g] {
        float y = 1.0f;
        g.allreduce(&y, &y, 1, DType::kFloat32, ReduceSpec{});
      });
      std::this_thread::sleep_for(100ms);
      const pid_t child = ::fork();
      if (child == 0) {
        float z = 5.0f;
        try {
          g.allreduce(&z, &z, 1, DType::kFloat32, ReduceSpec{});
          ::_exit(20);
        } catch (const Error& e) {
          const bool named = e.code() == ErrorCode::kInvalidUsage &&
                             std::string(e.what()).find("forked") != std::string::npos;
          ::_exit(named && z == 5.0f ? 0 : 21);
        }
      }
      int status = 0;
      ::waitpid(child, &status, 0);
      CHILD_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "forked child: %d", status);
      waiting.join();
    } else {
      float y = 1.0f;
      g.allreduce(&y, &y, 1, DType::kFloat32, ReduceSpec{});
    }
    // The child's attempt changed nothing: the group goes on.
    float w = static_cast<float>(me + 1);
    g.allreduce(&w, &w, 1, DType::kFloat32, ReduceSpec{});
    CHILD_CHECK(w == 3.0f, "after the fork: %g", w);
    return 0;
  };
  for (int code : runRanks(2, o, body)) EXPECT_EQ(code, 0);
}

}  // namespace
}  // namespace tpcomm::mq
