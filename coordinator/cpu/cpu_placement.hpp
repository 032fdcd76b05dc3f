#pragma once
// Where the ranks of a shared-memory group run and keep their memory: the
// CPUs each rank may use, a share of them of its own for its worker threads,
// its NUMA node, and the CPU facts those come from (affinity masks, a cgroup
// quota, /sys's NUMA nodes). Internal to coordinator/; cpu_shm_path.cpp uses
// it at set-up.
//
// The placement is computed from every rank's CPU list, exchanged at set-up,
// so every rank computes the same table for the whole group:
//   1. a CPU in one rank's list only is that rank's;
//   2. a CPU in several lists goes, in ascending order, to the lowest rank
//      among them still below its target (its fair share, each CPU split
//      equally among the ranks that list it, rounded to whole CPUs: the
//      leftovers to the largest remainders, then the fewest), else to the
//      one holding fewest; so ranks that share a machine unpinned get
//      contiguous blocks (0-7 and 8-15 of 16; 0-5, 6-10, 11-15 for 3), which
//      keep each rank inside one NUMA node where the nodes are blocks;
//   3. a rank's threads: its share (1 to 8), capped by its cgroup quota
//      divided among the group's ranks; its worker threads are pinned each to
//      a CPU of its share (none to the CPU its own thread is pinned to), so
//      no worker polls on another rank's CPU;
//   4. its node: the node most of its share lies on (its list's first CPU's
//      when its share is empty); its slots of the region are bound there.

#include <cstdint>
#include <string>
#include <vector>

namespace tpcomm::coord {

// "0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11} (sorted, unique). Throws
// InvalidUsage naming the text when it is not such a list or names a CPU
// this machine does not have.
std::vector<int> parseCpuList(const std::string& text, const char* what);
// The inverse: ascending CPUs as ranges ("" for none).
std::string formatCpuList(const std::vector<int>& cpus);

// The CPUs this process's shared-memory groups may use from now on, instead
// of the calling thread's affinity mask (tpcomm.set_cpu_shm_cpus, the vLLM
// plugin; empty: back to TPCOMM_CPU_SHM_CPUS or the mask). Any thread.
void setProcessCpus(std::vector<int> cpus);
// The CPUs a rank set up now may use: setProcessCpus's, else
// TPCOMM_CPU_SHM_CPUS (either less the CPUs outside this process's cgroup
// cpuset; InvalidUsage naming both lists when none is left), else the
// calling thread's affinity mask (every online CPU when it cannot be read).
std::vector<int> rankCpus();
// The CPUs this process's cgroup lets it use (cpuset.cpus.effective, else
// every online CPU).
std::vector<int> containerCpus();
// The calling thread's affinity mask.
std::vector<int> threadCpus();

// A cgroup (v2) CPU quota in whole CPUs, at least 1; 0 when there is none.
int quotaCpus();
// The CPUs this process may use: its affinity mask, capped by the quota.
int usableCpus();

// How many ranks can each have a CPU of their own, rank r among the CPUs
// `allowed[r]` (a maximum matching of ranks to CPUs): all of them when each
// is pinned to cores of its own, or none is pinned and the CPUs are enough;
// fewer when masks overlap ({0}, {0}, {1, 2} give 2).
int ranksWithOwnCpu(const std::vector<std::vector<int>>& allowed);

// The NUMA node of `cpu` (0 on a machine without /sys's nodes; -1 for a
// CPU no node lists), and the nodes that have memory.
int numaNodeOf(int cpu);
int numaNodes();

// One rank's place (see the top of this file).
struct RankPlace {
  std::vector<int> cpus;  // its share: disjoint from every other rank's
  int node = 0;
  int threads = 1;
};
// Every rank's place from their CPU lists (`allowed`), their
// TPCOMM_CPU_SHM_THREADS (0: from the share) and their quotas (0: none).
std::vector<RankPlace> placeRanks(const std::vector<std::vector<int>>& allowed,
                                  const std::vector<int64_t>& threadSettings,
                                  const std::vector<int>& quotas);
// The CPUs a rank's worker threads are pinned to, one each, in order: its
// share less the CPU its own thread is pinned to (`own`: the calling
// thread's mask), or less its first CPU when that thread is not pinned to
// one of them. Empty when the share cannot hold every thread.
std::vector<int> workerCpus(const RankPlace& place, const std::vector<int>& own);

}  // namespace tpcomm::coord
