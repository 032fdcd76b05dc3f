// A group's life (coordinator/group_life.hpp): the ranks of one making of a
// group agree on one id, every making gets another, and an id a dead rank 0
// left behind is dropped. Ranks are threads over one in-memory store.
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <set>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/group_life.hpp"

namespace tpcomm {
namespace {

using namespace std::chrono_literals;

// Every rank's id for one making of a group of `size` on `store`.
std::vector<std::string> agree(const c10::intrusive_ptr<c10d::Store>& store, int size) {
  std::vector<std::string> ids(size);
  std::vector<std::thread> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.emplace_back([&, r] { ids[r] = coord::agreeOnLife(store, r, size, 20s); });
  }
  for (auto& t : ranks) t.join();
  return ids;
}

TEST(GroupLife, EveryRankOfAMakingAgreesAndEveryMakingDiffers) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::set<std::string> seen;
  for (int size : {1, 2, 3, 5, 8}) {
    for (int making = 0; making < 40; ++making) {
      const auto ids = agree(store, size);
      for (const auto& id : ids) ASSERT_EQ(id, ids[0]) << "size " << size;
      ASSERT_EQ(ids[0].size(), 16u);
      ASSERT_TRUE(seen.insert(ids[0]).second) << "an id came twice: " << ids[0];
    }
  }
  // A finished making leaves its id spent, for no next one to take.
  const auto left = store->get("tpcomm/life");
  EXPECT_EQ(std::string(left.begin(), left.end()).rfind("spent:", 0), 0u);
}

TEST(GroupLife, AnIdADeadRankZeroLeftBehindIsDropped) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const std::string stale = "00000000deadbeef";
  store->set("tpcomm/life", std::vector<uint8_t>(stale.begin(), stale.end()));
  // The followers may read the stale id before rank 0 replaces it.
  std::vector<std::string> ids(3);
  std::vector<std::thread> ranks;
  for (int r = 1; r < 3; ++r) {
    ranks.emplace_back([&, r] { ids[r] = coord::agreeOnLife(store, r, 3, 20s); });
  }
  std::this_thread::sleep_for(50ms);
  ids[0] = coord::agreeOnLife(store, 0, 3, 20s);
  for (auto& t : ranks) t.join();
  EXPECT_NE(ids[0], stale);
  EXPECT_EQ(ids[1], ids[0]);
  EXPECT_EQ(ids[2], ids[0]);
}

TEST(GroupLife, ARankZeroThatNeverComesIsATimeoutNamingIt) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  try {
    coord::agreeOnLife(store, 1, 2, 200ms);
    FAIL() << "no timeout";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 waited 200 ms for rank 0 to make the group"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace tpcomm
