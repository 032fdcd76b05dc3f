// Groups across hosts: which ranks share a host (coordinator/cpu/cpu_hier_path.hpp)
// and this process's host identity (common/settings.hpp).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/settings.hpp"
#include "coordinator/cpu/cpu_hier_path.hpp"

namespace tpcomm::coord {
namespace {

TEST(HostLayout, HostsInOrderOfTheirLowestRankAndRanksInGroupOrder) {
  // Ranks interleaved over three hosts, one of them with a single rank.
  const std::vector<std::string> ids = {"b#1@m", "a#2@m", "b#1@m", "c#3@n", "a#2@m"};
  const HostLayout l = HostLayout::of(ids, 4);
  ASSERT_EQ(l.hosts(), 3);
  EXPECT_EQ(l.names, (std::vector<std::string>{"b", "a", "c"}));
  EXPECT_EQ(l.ranksOn[0], (std::vector<int>{0, 2}));
  EXPECT_EQ(l.ranksOn[1], (std::vector<int>{1, 4}));
  EXPECT_EQ(l.ranksOn[2], (std::vector<int>{3}));
  EXPECT_EQ(l.hostOf, (std::vector<int>{0, 1, 0, 2, 1}));
  EXPECT_EQ(l.host(), 1);
  EXPECT_EQ(l.localRank(), 1);
  EXPECT_EQ(l.localSize(), 2);
  EXPECT_FALSE(l.even());
  EXPECT_EQ(l.describeHost(2), "host 'c' (rank 3)");
  EXPECT_EQ(l.describe(), "3 hosts: 'b' (ranks 0, 2), 'a' (ranks 1, 4), 'c' (rank 3)");
  EXPECT_TRUE(HostLayout::of({"x", "y", "x", "y"}, 0).even());
}

TEST(HostIdentity, NamesTheHostAndHashesTheKernelAndNamespaces) {
  if (!settings().hostId.empty()) {
    EXPECT_EQ(hostIdentity(), settings().hostId);  // TPCOMM_HOST_ID overrides
    return;
  }
  const std::string id = hostIdentity();
  const std::string name = hostName();
  ASSERT_EQ(id.substr(0, name.size() + 1), name + "#") << id;
  // "<name>#<16 hex>@<8 hex>", the same on every call.
  const std::string rest = id.substr(name.size() + 1);
  ASSERT_EQ(rest.size(), 16u + 1u + 8u) << id;
  EXPECT_EQ(rest[16], '@');
  EXPECT_EQ(rest.find_first_not_of("0123456789abcdef@"), std::string::npos) << id;
  EXPECT_EQ(hostIdentity(), id);
}

}  // namespace
}  // namespace tpcomm::coord
