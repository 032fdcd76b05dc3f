// The shared-memory ring: ordering and no loss across forked readers, message
// sizes around the chunk size, reads in place, timeouts, killed and zombie
// peers, bounds checks, and nothing ever in /dev/shm (SIGKILL at each step of
// the creation included).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <thread>

#include "common/error.hpp"
#include "message_queue/ring/ring.hpp"
#include "message_queue/ring/segment.hpp"

namespace tpcomm::mq {
namespace {

using namespace std::chrono_literals;

// Entries of /dev/shm whose name starts with "tpcomm" (the ring never makes
// one: its memory is anonymous).
int devShmEntries() {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    n += e.path().filename().string().rfind("tpcomm", 0) == 0 ? 1 : 0;
  }
  return n;
}

// The writer's pid in a ring's name ("memfd:<pid>:<fd>:<bytes>").
pid_t writerPidOf(const std::string& name) {
  int pid = 0;
  EXPECT_EQ(std::sscanf(name.c_str(), "memfd:%d:", &pid), 1) << name;
  return pid;
}

// Message k: length k % 193 (0 included), byte i = (k + i) & 0xff.
std::vector<char> messageFor(uint64_t k) {
  std::vector<char> m(k % 193);
  for (size_t i = 0; i < m.size(); ++i) m[i] = static_cast<char>((k + i) & 0xff);
  return m;
}

Geometry small(uint32_t readers) {
  Geometry g;
  g.numReaders = readers;
  g.numChunks = 16;
  g.chunkBytes = 64;  // most messages span several chunks, and the ring wraps constantly
  return g;
}

// Forks a process that creates a writer of geometry `g`, hands its name to
// this process, then runs `then` and exits without tearing the writer down
// (as a crash would).
struct ForkedWriter {
  pid_t pid;
  std::string name;
};
ForkedWriter forkWriter(const Geometry& g, const std::function<void(Writer&)>& then) {
  int fds[2];
  if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    Writer writer(g);
    char name[64] = {};
    std::strncpy(name, writer.name().c_str(), sizeof(name) - 1);
    (void)!::write(fds[1], name, sizeof(name));
    then(writer);
    ::_exit(0);
  }
  char name[64] = {};
  const ssize_t got = ::read(fds[0], name, sizeof(name));
  ::close(fds[0]);
  ::close(fds[1]);
  if (got != static_cast<ssize_t>(sizeof(name)))
    throw std::runtime_error("no name from the writer");
  return {pid, name};
}

template <typename F>
ErrorCode codeOf(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.code();
  }
  ADD_FAILURE() << "no tpcomm::Error thrown";
  return ErrorCode::kSystem;
}

TEST(Ring, SizesAroundTheChunkSizeRoundTrip) {
  Writer writer(small(1));
  Reader reader(writer.name(), 0);
  writer.waitForReaders(5s);
  const std::vector<size_t> sizes = {0, 1, 63, 64, 65, 128, 64 * 16, 64 * 16 + 1, 64 * 100 + 7};
  std::thread consumer([&] {
    for (size_t n : sizes) {
      auto m = reader.read(10s);
      ASSERT_EQ(m.size(), n);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(m[i], static_cast<char>(i * 7));
    }
  });
  for (size_t n : sizes) {
    std::vector<char> m(n);
    for (size_t i = 0; i < n; ++i) m[i] = static_cast<char>(i * 7);
    writer.write(m.data(), m.size(), 10s);
  }
  consumer.join();
}

TEST(Ring, MessagePartsAreWrittenBackToBack) {
  Writer writer(small(1));
  Reader reader(writer.name(), 0);
  writer.waitForReaders(5s);
  std::string a(100, 'a'), b, c(30, 'c'), d(64, 'd');
  writer.write({{a.data(), a.size()}, {b.data(), 0}, {c.data(), c.size()}, {d.data(), d.size()}},
               5s);
  auto m = reader.read(5s);
  EXPECT_EQ(std::string(m.begin(), m.end()), a + c + d);
  writer.write(std::vector<Writer::Part>{}, 5s);
  EXPECT_TRUE(reader.read(5s).empty());
}

TEST(Ring, SegmentIsAnonymousOwnerOnlyAndClosedOnceReadersAttached) {
  const int before = devShmEntries();
  Writer writer(small(2));
  const std::string name = writer.name();
  int pid = 0, fd = -1;
  ASSERT_EQ(std::sscanf(name.c_str(), "memfd:%d:%d:", &pid, &fd), 2) << name;
  EXPECT_EQ(pid, ::getpid());
  struct stat st;
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(devShmEntries(), before) << "a name in /dev/shm";
  Reader a(name, 0);
  Reader b(name, 1);
  writer.waitForReaders(5s);
  // Closed for attaching: a late reader gets a clear error.
  try {
    Reader late(name, 0);
    FAIL() << "attached after the writer closed its descriptor";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("closes its descriptor once every reader attached"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(codeOf([] { Reader bad("/tpcomm-mq-0123", 0); }), ErrorCode::kInvalidUsage);
}

// A stale name never attaches to another ring, even when the next ring got
// the same descriptor number, nor to a file that is not a ring.
TEST(Ring, AStaleNameNeverAttachesToAnotherRing) {
  std::string stale;
  {
    Writer first(small(1));
    stale = first.name();
  }
  Writer second(small(1));  // most likely the same descriptor number
  try {
    Reader late(stale, 0);
    FAIL() << "attached to another ring through a stale name";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kSystem);
  }
  Reader real(second.name(), 0);  // the slot was not taken by the stale reader
  second.waitForReaders(5s);
  const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  const std::string notARing = "memfd:" + std::to_string(::getpid()) + ":" + std::to_string(fd) +
                               ":" + std::to_string(segmentBytes(small(1))) + ":" +
                               std::string(32, '0');
  try {
    Reader bad(notARing, 0);
    FAIL() << "attached to /dev/null";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not a tpcomm shared region"), std::string::npos)
        << e.what();
  }
  ::close(fd);
}

TEST(Ring, ReaderIndexIsCheckedAndTakenOnce) {
  Writer writer(small(2));
  Reader a(writer.name(), 0);
  EXPECT_EQ(codeOf([&] { Reader again(writer.name(), 0); }), ErrorCode::kInvalidUsage);
  EXPECT_EQ(codeOf([&] { Reader outside(writer.name(), 2); }), ErrorCode::kInvalidUsage);
}

TEST(Ring, BadGeometryIsRefused) {
  Geometry g = small(1);
  g.numReaders = 0;
  EXPECT_EQ(codeOf([&] { Writer w(g); }), ErrorCode::kInvalidUsage);
  g = small(1);
  g.chunkBytes = 8;
  EXPECT_EQ(codeOf([&] { Writer w(g); }), ErrorCode::kInvalidUsage);
}

TEST(Ring, MissingReadersTimeOutNamingThem) {
  Writer writer(small(3));
  Reader r1(writer.name(), 1);
  try {
    writer.waitForReaders(200ms);
    FAIL() << "no timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_NE(std::string(e.what()).find("readers not attached: 0,2"), std::string::npos)
        << e.what();
  }
}

TEST(Ring, EmptyReadTimesOutOnTime) {
  Writer writer(small(1));
  Reader reader(writer.name(), 0);
  writer.waitForReaders(5s);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(codeOf([&] { reader.read(300ms); }), ErrorCode::kTimeout);
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited, 290ms);
  EXPECT_LT(waited, 2s);
}

TEST(Ring, FullRingTimesOutForTheWriter) {
  Writer writer(small(1));
  Reader reader(writer.name(), 0);
  writer.waitForReaders(5s);
  std::vector<char> chunk(64, 'x');
  for (int i = 0; i < 16; ++i) writer.write(chunk.data(), chunk.size(), 1s);
  EXPECT_EQ(codeOf([&] { writer.write(chunk.data(), chunk.size(), 200ms); }), ErrorCode::kTimeout);
}

TEST(Ring, ShutdownWakesABlockedReader) {
  Writer writer(small(1));
  Reader reader(writer.name(), 0);
  writer.waitForReaders(5s);
  ErrorCode code = ErrorCode::kSystem;
  auto start = std::chrono::steady_clock::now();
  std::thread blocked([&] { code = codeOf([&] { reader.read(30s); }); });
  std::this_thread::sleep_for(100ms);
  writer.shutdown();
  blocked.join();
  EXPECT_EQ(code, ErrorCode::kPeerLost);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

// The writer publishes and shuts down at once while the reader polls: the
// message is read, not lost to the shutdown (the reader checks for what was
// published after it sees the shutdown).
TEST(Ring, AMessagePublishedJustBeforeShutdownIsStillRead) {
  for (int round = 0; round < 300; ++round) {
    Writer writer(small(1));
    Reader reader(writer.name(), 0);
    writer.waitForReaders(5s);
    std::atomic<bool> waiting{false};
    size_t got = 0;
    std::string error;
    std::thread blocked([&] {
      waiting = true;
      try {
        got = reader.read(10s).size();
      } catch (const std::exception& e) {
        error = e.what();
      }
    });
    while (!waiting) std::this_thread::yield();
    std::vector<char> m(64, 'x');
    writer.write(m.data(), m.size(), 5s);
    writer.shutdown();
    blocked.join();
    ASSERT_EQ(error, "") << "round " << round;
    ASSERT_EQ(got, 64u) << "round " << round;
  }
}

// A ring holding one 10-byte message, with a second mapping to corrupt it.
class TamperedRing : public ::testing::Test {
 protected:
  void SetUp() override {
    writer.waitForReaders(5s);
    std::vector<char> m(10, 'a');
    writer.write(m.data(), m.size(), 1s);
  }
  Writer writer{small(1)};
  Reader reader{writer.name(), 0};
  std::unique_ptr<Segment> tamper = Segment::attach(writer.name());
};

TEST_F(TamperedRing, CorruptChunkHeaderIsRejected) {
  tamper->chunkHeader(0).bytes = 1000;  // larger than a chunk
  try {
    reader.read(1s);
    FAIL() << "corrupt header accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kSystem);
    EXPECT_NE(std::string(e.what()).find("corrupt chunk header"), std::string::npos);
  }
}

TEST_F(TamperedRing, LengthBeyondTheMessageIsRejected) {
  tamper->chunkHeader(0).messageBytes = 5;  // the chunk carries 10
  EXPECT_EQ(codeOf([&] { reader.read(1s); }), ErrorCode::kSystem);
}

class ForkedReaders : public ::testing::TestWithParam<int> {};

TEST_P(ForkedReaders, OrderingAndNoLossOver100kMessages) {
  const int readers = GetParam();
  const uint64_t kMessages = 100000;
  Writer writer(small(readers));
  const std::string name = writer.name();
  std::vector<pid_t> children;
  for (int r = 0; r < readers; ++r) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int status = 0;
      try {
        Reader reader(name, r);
        for (uint64_t k = 0; k < kMessages; ++k) {
          if (reader.read(60s) != messageFor(k)) {
            status = 2;
            break;
          }
        }
      } catch (...) {
        status = 3;
      }
      ::_exit(status);
    }
    children.push_back(pid);
  }
  writer.waitForReaders(30s);
  for (uint64_t k = 0; k < kMessages; ++k) {
    auto m = messageFor(k);
    writer.write(m.data(), m.size(), 60s);
  }
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "reader exit status " << status;
  }
}

INSTANTIATE_TEST_SUITE_P(Readers, ForkedReaders, ::testing::Range(1, 8));

TEST(RingFaults, KilledWriterMakesTheReaderRaise) {
  const ForkedWriter forked = forkWriter(small(1), [](Writer& writer) {
    writer.waitForReaders(30s);
    std::vector<char> m(100, 'w');
    writer.write(m.data(), m.size(), 30s);
    ::pause();  // killed here, mid-stream from the reader's point of view
  });
  const pid_t writerPid = forked.pid;
  const std::string& name = forked.name;
  Reader reader(name, 0);
  EXPECT_EQ(reader.read(30s).size(), 100u);
  ::kill(writerPid, SIGKILL);
  int status = 0;
  ::waitpid(writerPid, &status, 0);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(codeOf([&] { reader.read(30s); }), ErrorCode::kPeerLost);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(RingFaults, KilledReaderMakesTheWriterRaise) {
  Writer writer(small(2));
  const std::string name = writer.name();
  pid_t readerPid = ::fork();
  ASSERT_GE(readerPid, 0);
  if (readerPid == 0) {
    Reader reader(name, 1);
    reader.read(30s);
    ::pause();
    ::_exit(0);
  }
  Reader local(name, 0);
  writer.waitForReaders(30s);
  std::vector<char> m(64, 'x');
  writer.write(m.data(), m.size(), 5s);
  ::kill(readerPid, SIGKILL);
  int status = 0;
  ::waitpid(readerPid, &status, 0);
  // The local reader keeps up; the dead one holds chunks until the writer notices.
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(codeOf([&] {
              for (int i = 0; i < 64; ++i) {
                writer.write(m.data(), m.size(), 30s);
                local.read(5s);
              }
            }),
            ErrorCode::kPeerLost);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

// A message read in place is the message, whether it lies in one stretch of
// the ring or wraps (then copied), up to larger than the ring; with the old
// fixed polling (spin 0) too. The writer stays ahead of the reader.
TEST(Ring, ReadsInPlaceSeeEveryMessageWrappedOrNot) {
  for (auto spin : {0us, 200us}) {
    Writer writer(small(1));  // 16 chunks of 64 bytes
    writer.setSpin(spin);
    const std::string name = writer.name();
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      int status = 0;
      try {
        Reader reader(name, 0);
        reader.setSpin(spin);
        for (uint64_t k = 0; k < 3000 && status == 0; ++k) {
          std::vector<char> want = messageFor(k * 7);
          if (k % 100 == 99) want.assign(2000 + k % 5, static_cast<char>(k));  // > the ring
          reader.readInPlace(30s, [&](const char* data, uint64_t bytes) {
            if (bytes != want.size() || std::memcmp(data, want.data(), bytes) != 0) status = 2;
          });
        }
      } catch (...) {
        status = 3;
      }
      ::_exit(status);
    }
    writer.waitForReaders(30s);
    for (uint64_t k = 0; k < 3000; ++k) {
      std::vector<char> m = messageFor(k * 7);
      if (k % 100 == 99) m.assign(2000 + k % 5, static_cast<char>(k));
      writer.write(m.data(), m.size(), 30s);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "spin " << spin.count() << " us: reader exit status " << status;
  }
}

// An exception in the reader's use of a message still consumes it: the next
// read gets the next message.
TEST(Ring, AFailedInPlaceUseStillConsumesTheMessage) {
  Writer writer(small(1));
  Reader reader(writer.name(), 0);
  writer.waitForReaders(5s);
  std::vector<char> a(100, 'a'), b(10, 'b');
  writer.write(a.data(), a.size(), 1s);
  writer.write(b.data(), b.size(), 1s);
  EXPECT_THROW(reader.readInPlace(1s, [](const char*, uint64_t) { throw std::runtime_error("x"); }),
               std::runtime_error);
  std::string got;
  reader.readInPlace(1s, [&](const char* data, uint64_t bytes) { got.assign(data, bytes); });
  EXPECT_EQ(got, std::string(10, 'b'));
}

// A peer that died but was not reaped (a zombie: kill(pid, 0) still says it
// exists) is lost, not waited for until the timeout.
TEST(RingFaults, ZombieWriterMakesTheReaderRaise) {
  // No shutdown; the parent does not reap the writer until the end.
  const ForkedWriter forked = forkWriter(small(1), [](Writer& writer) {
    writer.waitForReaders(30s);
    std::vector<char> m(10, 'z');
    writer.write(m.data(), m.size(), 30s);
  });
  const pid_t writerPid = forked.pid;
  const std::string& name = forked.name;
  Reader reader(name, 0);
  EXPECT_EQ(reader.read(30s).size(), 10u);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(codeOf([&] { reader.read(60s); }), ErrorCode::kPeerLost);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  int status = 0;
  ::waitpid(writerPid, &status, 0);
}

TEST(RingFaults, ZombieReaderMakesTheWriterRaise) {
  Writer writer(small(1));
  const std::string name = writer.name();
  const pid_t readerPid = ::fork();
  ASSERT_GE(readerPid, 0);
  if (readerPid == 0) {
    Reader reader(name, 0);
    ::_exit(0);  // never reads, never detaches; a zombie until reaped
  }
  writer.waitForReaders(30s);
  std::vector<char> m(64, 'x');
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(codeOf([&] {
              for (int i = 0; i < 64; ++i) writer.write(m.data(), m.size(), 60s);
            }),
            ErrorCode::kPeerLost);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  int status = 0;
  ::waitpid(readerPid, &status, 0);
}

// SIGKILL of the writer at each step of the creation: before any reader
// attached, with one of two attached, with both attached but before it
// closed its descriptor. Nothing appears in /dev/shm at any point, attached
// readers raise PeerLost, and a reader that comes later gets a clear error.
TEST(RingFaults, WriterKilledAtEachStepOfCreationLeavesNothing) {
  const int before = devShmEntries();
  for (int attachedBeforeKill : {0, 1, 2}) {
    const ForkedWriter forked = forkWriter(small(2), [](Writer&) { ::pause(); });  // killed here
    const pid_t writerPid = forked.pid;
    const std::string& name = forked.name;
    std::vector<std::unique_ptr<Reader>> readers;
    for (int r = 0; r < attachedBeforeKill; ++r)
      readers.push_back(std::make_unique<Reader>(name, r));
    EXPECT_EQ(devShmEntries(), before);
    ::kill(writerPid, SIGKILL);
    int status = 0;
    ::waitpid(writerPid, &status, 0);
    for (auto& reader : readers) {
      EXPECT_EQ(codeOf([&] { reader->read(30s); }), ErrorCode::kPeerLost) << attachedBeforeKill;
    }
    if (attachedBeforeKill < 2) {
      EXPECT_EQ(codeOf([&] { Reader late(name, attachedBeforeKill); }), ErrorCode::kSystem);
    }
    EXPECT_EQ(devShmEntries(), before)
        << "after killing the writer with " << attachedBeforeKill << " readers attached";
  }
}

}  // namespace
}  // namespace tpcomm::mq
