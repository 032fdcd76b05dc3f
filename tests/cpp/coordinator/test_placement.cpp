// Where a shared-memory group's ranks run: CPU lists, each rank's share of
// the CPUs, its threads and node (coordinator/cpu/cpu_placement.hpp).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <set>

#include "common/error.hpp"
#include "coordinator/cpu/cpu_placement.hpp"

namespace tpcomm::coord {
namespace {

std::vector<int> range(int a, int b) {
  std::vector<int> out;
  for (int c = a; c <= b; ++c) out.push_back(c);
  return out;
}

TEST(Placement, CpuListsParseAndPrint) {
  EXPECT_EQ(parseCpuList("0", "x"), std::vector<int>{0});
  EXPECT_EQ(parseCpuList("1,0,0-1", "x"), (std::vector<int>{0, 1}));
  EXPECT_EQ(formatCpuList({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(formatCpuList({}), "");
  const long cpus = ::sysconf(_SC_NPROCESSORS_CONF);
  for (const char* bad : {"", "a", "1-", "-1", "3-1", "0,,1", "1.5", "99999"}) {
    try {
      parseCpuList(bad, "TPCOMM_CPU_SHM_CPUS");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
      EXPECT_NE(std::string(e.what()).find("TPCOMM_CPU_SHM_CPUS"), std::string::npos) << e.what();
    }
  }
  // A CPU this machine lacks is named with the CPUs it has.
  try {
    parseCpuList(std::to_string(cpus), "x");
    ADD_FAILURE() << "accepted a CPU past the machine's";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("this machine has CPUs 0-"), std::string::npos);
  }
}

// Shares are disjoint, inside each rank's list, and cover the lists' union
// (no CPU of the group left idle).
void expectPartition(const std::vector<std::vector<int>>& allowed,
                     const std::vector<RankPlace>& places) {
  std::set<int> seen, all;
  for (size_t r = 0; r < allowed.size(); ++r) {
    all.insert(allowed[r].begin(), allowed[r].end());
    for (int c : places[r].cpus) {
      EXPECT_TRUE(seen.insert(c).second) << "CPU " << c << " given twice";
      EXPECT_NE(std::find(allowed[r].begin(), allowed[r].end(), c), allowed[r].end())
          << "CPU " << c << " outside rank " << r << "'s list";
    }
  }
  EXPECT_EQ(seen, all);
}

TEST(Placement, UnpinnedRanksGetContiguousEqualBlocks) {
  // Two ranks unpinned on 16 CPUs: 0-7 and 8-15, 8 threads each.
  const std::vector<std::vector<int>> two = {range(0, 15), range(0, 15)};
  const auto places = placeRanks(two, {0, 0}, {0, 0});
  expectPartition(two, places);
  EXPECT_EQ(places[0].cpus, range(0, 7));
  EXPECT_EQ(places[1].cpus, range(8, 15));
  EXPECT_EQ(places[0].threads, 8);
  EXPECT_EQ(places[1].threads, 8);
  // Eight ranks on 16: two each; three on 16: 6, 5, 5 (the leftover CPU to
  // the rank holding fewest, the lowest first).
  const std::vector<std::vector<int>> eight(8, range(0, 15));
  const auto e = placeRanks(eight, std::vector<int64_t>(8, 0), std::vector<int>(8, 0));
  expectPartition(eight, e);
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(e[r].cpus, range(2 * r, 2 * r + 1));
    EXPECT_EQ(e[r].threads, 2);
  }
  const std::vector<std::vector<int>> three(3, range(0, 15));
  const auto t = placeRanks(three, {0, 0, 0}, {0, 0, 0});
  expectPartition(three, t);
  EXPECT_EQ(t[0].cpus, range(0, 5));
  EXPECT_EQ(t[1].cpus, range(6, 10));
  EXPECT_EQ(t[2].cpus, range(11, 15));
  // More than 8 CPUs a rank: 8 threads at most.
  const auto one = placeRanks({range(0, 31)}, {0}, {0});
  EXPECT_EQ(one[0].threads, 8);
}

TEST(Placement, PinnedRanksKeepTheirOwnCpus) {
  // vLLM's layout: each rank pinned to a block of its own.
  const std::vector<std::vector<int>> pinned = {range(0, 3), range(4, 7)};
  const auto places = placeRanks(pinned, {0, 0}, {0, 0});
  EXPECT_EQ(places[0].cpus, range(0, 3));
  EXPECT_EQ(places[1].cpus, range(4, 7));
  EXPECT_EQ(places[0].threads, 4);
  // Overlapping lists: each keeps what is its alone; the shared CPU goes to
  // rank 1 (fair shares 2.5 and 1.5: the leftover CPU to the rank with fewer).
  const std::vector<std::vector<int>> overlap = {{0, 1, 2}, {2, 3}};
  const auto o = placeRanks(overlap, {0, 0}, {0, 0});
  expectPartition(overlap, o);
  EXPECT_EQ(o[0].cpus, (std::vector<int>{0, 1}));
  EXPECT_EQ(o[1].cpus, (std::vector<int>{2, 3}));
  // Three CPUs shared by two ranks that each have one of their own (fair
  // shares 2.5, targets 3 and 2): rank 0 takes 2 and 3, rank 1 takes 4.
  const std::vector<std::vector<int>> wide = {{0, 2, 3, 4}, {1, 2, 3, 4}};
  const auto w = placeRanks(wide, {0, 0}, {0, 0});
  expectPartition(wide, w);
  EXPECT_EQ(w[0].cpus, (std::vector<int>{0, 2, 3}));
  EXPECT_EQ(w[1].cpus, (std::vector<int>{1, 4}));
  // Two ranks on one CPU: one has it, the other none; both run one thread.
  const auto crowded = placeRanks({{0}, {0}}, {0, 0}, {0, 0});
  EXPECT_EQ(crowded[0].cpus.size() + crowded[1].cpus.size(), 1u);
  EXPECT_EQ(crowded[0].threads, 1);
  EXPECT_EQ(crowded[1].threads, 1);
}

TEST(Placement, SettingsAndQuotasDecideThreads) {
  const std::vector<std::vector<int>> two = {range(0, 15), range(0, 15)};
  // An explicit TPCOMM_CPU_SHM_THREADS wins, per rank.
  const auto set = placeRanks(two, {3, 0}, {0, 0});
  EXPECT_EQ(set[0].threads, 3);
  EXPECT_EQ(set[1].threads, 8);
  // A cgroup quota of 4 CPUs is divided among the 2 ranks.
  const auto quota = placeRanks(two, {0, 0}, {4, 4});
  EXPECT_EQ(quota[0].threads, 2);
  EXPECT_EQ(quota[1].threads, 2);
}

TEST(Placement, WorkersAvoidTheCpuTheRankItselfRunsOn) {
  RankPlace p;
  p.cpus = range(4, 7);
  p.threads = 4;
  // The rank's thread pinned to 4 (an OpenMP runtime's first place): the
  // workers take 5, 6, 7.
  EXPECT_EQ(workerCpus(p, {4}), (std::vector<int>{5, 6, 7}));
  // Not pinned: the first CPU of the share is left to it.
  EXPECT_EQ(workerCpus(p, range(0, 15)), (std::vector<int>{5, 6, 7}));
  p.threads = 2;
  EXPECT_EQ(workerCpus(p, {6}), std::vector<int>{4});
  // More threads than the share holds: none pinned.
  p.threads = 6;
  EXPECT_TRUE(workerCpus(p, {4}).empty());
  p.threads = 1;
  EXPECT_TRUE(workerCpus(p, {4}).empty());
}

TEST(Placement, NodesComeFromSys) {
  // Every CPU this process may use is on a node of this machine.
  const int nodes = numaNodes();
  EXPECT_GE(nodes, 1);
  for (int cpu : threadCpus()) {
    EXPECT_GE(numaNodeOf(cpu), 0);
  }
  // A rank's node is the one most of its share lies on.
  const auto places = placeRanks({threadCpus()}, {0}, {0});
  std::map<int, int> onNode;
  for (int cpu : places[0].cpus) ++onNode[numaNodeOf(cpu)];
  int most = -1, node = -1;
  for (const auto& [n, count] : onNode) {
    if (count > most) most = count, node = n;
  }
  EXPECT_EQ(places[0].node, node);
  // Declared lists are cut to the CPUs the cgroup allows; none left is an
  // error naming both lists.
  const auto usable = containerCpus();
  ASSERT_FALSE(usable.empty());
  setProcessCpus({usable.front(), 1023});
  EXPECT_EQ(rankCpus(), std::vector<int>{usable.front()});
  setProcessCpus({1023});
  try {
    rankCpus();
    ADD_FAILURE() << "a list of CPUs outside the cgroup was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("none of which this process may use"), std::string::npos)
        << e.what();
  }
  setProcessCpus({});
  EXPECT_EQ(rankCpus(), threadCpus());
}

}  // namespace
}  // namespace tpcomm::coord
