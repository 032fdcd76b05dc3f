// mq::ShmWindow (message_queue/window/shm_window.hpp): two ranks, the
// second a forked child that maps the first's window through its name.
// Puts land where they are aimed, each signal is waited for once, a wait
// is bounded and names the silent peer, one on a peer that exited ends
// at once, and a put past the end is refused.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "message_queue/window/shm_window.hpp"

namespace tpcomm::mq {
namespace {

using std::chrono::milliseconds;

// A pipe the parent tells the child its region's name through, and one back.
struct Pipe {
  int fd[2];
  Pipe() { EXPECT_EQ(pipe(fd), 0); }
  void send(const std::string& text) {
    const uint32_t n = static_cast<uint32_t>(text.size());
    EXPECT_EQ(write(fd[1], &n, 4), 4);
    EXPECT_EQ(write(fd[1], text.data(), n), static_cast<ssize_t>(n));
  }
  std::string receive() {
    uint32_t n = 0;
    if (read(fd[0], &n, 4) != 4) return {};
    std::string text(n, '\0');
    size_t got = 0;
    while (got < n) {
      const ssize_t r = read(fd[0], text.data() + got, n - got);
      if (r <= 0) return {};
      got += static_cast<size_t>(r);
    }
    return text;
  }
};

std::string messageOf(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(ShmWindow, PutsSignalsAndWaitsBetweenTwoProcesses) {
  ShmWindow parent(0, 2, 64 * sizeof(int));
  Pipe down, up;
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int code = 0;
    try {
      ShmWindow mine(1, 2, 16 * sizeof(int));
      up.send(mine.name());
      mine.attach({down.receive(), ""});
      up.send("attached");  // the parent may close its descriptor now
      // Ten rounds: wait for the parent's put, answer with the sum.
      for (int round = 0; round < 10; ++round) {
        mine.waitSignal(0, milliseconds(10000));
        const int* in = reinterpret_cast<const int*>(mine.data(1));
        int sum = 0;
        for (int i = 0; i < 16; ++i) sum += in[i];
        mine.put(0, (32 + round) * sizeof(int), &sum, sizeof(int));
        mine.signal(0);
      }
      // Exits without the eleventh signal the parent waits for.
    } catch (const std::exception& e) {
      fprintf(stderr, "child: %s\n", e.what());
      code = 1;
    }
    _exit(code);
  }
  down.send(parent.name());
  parent.attach({"", up.receive()});
  ASSERT_EQ(up.receive(), "attached");
  parent.closeDescriptor();
  for (int round = 0; round < 10; ++round) {
    std::vector<int> values(16);
    for (int i = 0; i < 16; ++i) values[i] = round * 100 + i;
    parent.put(1, 0, values.data(), values.size() * sizeof(int));
    parent.signal(1);
    parent.waitSignal(1, milliseconds(10000));
  }
  const int* answers = reinterpret_cast<const int*>(parent.data(0)) + 32;
  for (int round = 0; round < 10; ++round) {
    EXPECT_EQ(answers[round], 1600 * round + 120) << round;
  }
  EXPECT_EQ(parent.signalsFrom(1), 10u);
  EXPECT_EQ(parent.consumedFrom(1), 10u);
  // Past the end of the child's 16 ints.
  int one = 1;
  const std::string past = messageOf([&] { parent.put(1, 15 * sizeof(int), &one, 8); });
  EXPECT_NE(past.find("put of 8 bytes at byte 60 of rank 1's window runs past its 64 bytes"),
            std::string::npos)
      << past;
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  // The child exited without signalling: the wait ends at once, naming it.
  const auto start = std::chrono::steady_clock::now();
  const std::string gone = messageOf([&] { parent.waitSignal(1, milliseconds(10000)); });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_NE(gone.find("rank 1 (pid " + std::to_string(child) + ") exited before it signalled"),
            std::string::npos)
      << gone;
}

TEST(ShmWindow, AWaitIsBoundedNamesTheSilentPeerAndEndsWhenTheCheckThrows) {
  ShmWindow a(0, 2, 8), b(1, 2, 8);  // both ranks in this process
  a.attach({"", b.name()});
  b.attach({a.name(), ""});
  const auto start = std::chrono::steady_clock::now();
  const std::string silent = messageOf([&] { a.waitSignal(1, milliseconds(200)); });
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(200));
  EXPECT_NE(silent.find("rank 1 sent no signal within 200 ms (signals from it: 0"),
            std::string::npos)
      << silent;
  const std::string broke = messageOf([&] {
    a.waitSignal(1, milliseconds(10000), [] { TPCOMM_THROW(kPeerLost, "the group broke"); });
  });
  EXPECT_NE(broke.find("the group broke"), std::string::npos) << broke;
  // Two signals, two waits; a third wait finds none.
  b.signal(0);
  b.signal(0);
  a.waitSignal(1, milliseconds(1000));
  a.waitSignal(1, milliseconds(1000));
  EXPECT_NE(messageOf([&] { a.waitSignal(1, milliseconds(50)); }).find("no signal within 50 ms"),
            std::string::npos);
  const std::string rank = messageOf([&] { a.signal(2); });
  EXPECT_NE(rank.find("rank 2 is not one of the 2 ranks of the window"), std::string::npos) << rank;
}

}  // namespace
}  // namespace tpcomm::mq
