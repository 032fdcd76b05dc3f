// The message queue's arena: first-fit placement and reuse, blocks held by
// readers' views never reused, a full arena's Timeout naming who holds it, a
// dead reader's PeerLost, attach checks, and a forked reader that sees the
// writer's bytes and releases its hold.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>

#include "common/error.hpp"
#include "message_queue/arena/arena.hpp"

namespace tpcomm::mq {
namespace {

using namespace std::chrono_literals;

template <typename F>
std::string errorOf(F&& f, ErrorCode want) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(want)) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no tpcomm::Error thrown";
  return "";
}

const auto kAlive = [] { return true; };

TEST(Arena, PlacesFirstFitAndReusesReleasedBlocks) {
  auto arena = Arena::create(1 << 12);  // 4 KiB
  ASSERT_EQ(arena->capacity(), 4096u);
  const Arena::Block a = arena->allocate(1000, 1s, kAlive);  // rounded up to 1024
  const Arena::Block b = arena->allocate(1, 1s, kAlive);     // 64
  const Arena::Block c = arena->allocate(3008, 1s, kAlive);  // the rest, exactly
  EXPECT_EQ(a.offset, 0u);
  EXPECT_EQ(a.bytes, 1024u);
  EXPECT_EQ(b.offset, 1024u);
  EXPECT_EQ(b.bytes, 64u);
  EXPECT_EQ(c.offset, 1088u);
  EXPECT_NE(a.slot, b.slot);
  errorOf([&] { arena->allocate(64, 20ms, kAlive); }, ErrorCode::kTimeout);
  arena->releaseOwner(a.slot);
  const Arena::Block d = arena->allocate(512, 1s, kAlive);  // into a's gap
  EXPECT_EQ(d.offset, 0u);
  const Arena::Block e = arena->allocate(512, 1s, kAlive);
  EXPECT_EQ(e.offset, 512u);
  // find(): a range inside a live block maps to that block's slot.
  Arena::Block found;
  ASSERT_TRUE(arena->find(arena->data() + 1088 + 100, 200, &found));
  EXPECT_EQ(found.slot, c.slot);
  EXPECT_EQ(found.offset, 1188u);
  EXPECT_FALSE(arena->find(arena->data() + 1088 + 3000, 64, &found));  // past c's end
  int outside = 0;
  EXPECT_FALSE(arena->find(&outside, sizeof(outside), &found));
}

TEST(Arena, HeldBlocksAreNeverReusedAndAFullArenaSaysWhoHoldsIt) {
  auto arena = Arena::create(1024);
  const Arena::Block a = arena->allocate(1024, 1s, kAlive);
  arena->hold(a.slot, 2);  // a message to two readers
  arena->releaseOwner(a.slot);
  const std::string what = errorOf([&] { arena->allocate(64, 30ms, kAlive); }, ErrorCode::kTimeout);
  EXPECT_NE(what.find("1024 bytes held by readers' views"), std::string::npos) << what;
  EXPECT_NE(what.find("arena_bytes"), std::string::npos) << what;
  arena->release(a.slot);
  errorOf([&] { arena->allocate(64, 30ms, kAlive); }, ErrorCode::kTimeout);
  arena->release(a.slot);  // the last view died
  EXPECT_EQ(arena->allocate(1024, 1s, kAlive).offset, 0u);
  // A message that was never published gives its holds back.
  auto other = Arena::create(128);
  const Arena::Block b = other->allocate(128, 1s, kAlive);
  other->hold(b.slot, 3);
  other->unhold(b.slot, 3);
  other->releaseOwner(b.slot);
  EXPECT_EQ(other->allocate(128, 1s, kAlive).offset, 0u);
}

TEST(Arena, BadSizesAndADeadReaderRaise) {
  errorOf([] { Arena::create(0); }, ErrorCode::kInvalidUsage);
  errorOf([] { Arena::create((64ull << 30) + 1); }, ErrorCode::kInvalidUsage);
  auto arena = Arena::create(256);
  errorOf([&] { arena->allocate(257, 1s, kAlive); }, ErrorCode::kInvalidUsage);
  errorOf([&] { arena->allocate(0, 1s, kAlive); }, ErrorCode::kInvalidUsage);
  arena->allocate(256, 1s, kAlive);
  const std::string what =
      errorOf([&] { arena->allocate(64, 5s, [] { return false; }); }, ErrorCode::kPeerLost);
  EXPECT_NE(what.find("reader"), std::string::npos) << what;
}

TEST(Arena, RunsOutOfSlotsBeforeBytesGracefully) {
  auto arena = Arena::create(64ull * (Arena::kSlots + 1));
  for (uint32_t i = 0; i < Arena::kSlots; ++i) arena->allocate(64, 1s, kAlive);
  errorOf([&] { arena->allocate(64, 20ms, kAlive); }, ErrorCode::kTimeout);
}

TEST(Arena, AttachChecksTheNameAndRanges) {
  errorOf([] { Arena::attach("not a name"); }, ErrorCode::kInvalidUsage);
  errorOf([] { Arena::attach("memfd:1:2:3"); }, ErrorCode::kInvalidUsage);
  auto arena = Arena::create(4096);
  auto reader = Arena::attach(arena->name());  // this process's own descriptor
  EXPECT_EQ(reader->capacity(), 4096u);
  EXPECT_TRUE(reader->validRange(0, 0, 4096));
  EXPECT_TRUE(reader->validRange(Arena::kSlots - 1, 4032, 64));
  EXPECT_FALSE(reader->validRange(Arena::kSlots, 0, 64));
  EXPECT_FALSE(reader->validRange(0, 4032, 65));
  EXPECT_FALSE(reader->validRange(0, ~0ull, 2));
  // Another region's nonce: the same pid and descriptor, but not this arena.
  std::string forged = arena->name();
  forged[forged.size() - 1] = forged.back() == '0' ? '1' : '0';
  errorOf([&] { Arena::attach(forged); }, ErrorCode::kSystem);
}

TEST(Arena, AForkedReaderSeesTheBytesAndReleasesItsHold) {
  auto arena = Arena::create(1 << 16);
  const Arena::Block a = arena->allocate(4096, 1s, kAlive);
  for (int i = 0; i < 4096; ++i) arena->data()[a.offset + i] = static_cast<char>(i * 7);
  arena->hold(a.slot, 1);
  arena->releaseOwner(a.slot);
  const std::string name = arena->name();
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int status = 0;
    try {
      auto reader = Arena::attach(name);
      for (int i = 0; i < 4096; ++i) {
        if (reader->data()[a.offset + i] != static_cast<char>(i * 7)) status = 2;
      }
      reader->release(a.slot);
    } catch (...) {
      status = 3;
    }
    ::_exit(status);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  // The reader's release freed the block: the whole arena is one block again.
  EXPECT_EQ(arena->allocate(1 << 16, 1s, kAlive).offset, 0u);
}

}  // namespace
}  // namespace tpcomm::mq
