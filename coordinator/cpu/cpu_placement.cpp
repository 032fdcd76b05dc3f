#include "coordinator/cpu/cpu_placement.hpp"

#include <dirent.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>

#include "common/error.hpp"
#include "common/settings.hpp"

namespace tpcomm::coord {

namespace {

constexpr int kMaxThreads = 8;

std::mutex gProcessCpusMutex;
std::vector<int> gProcessCpus;  // guarded by gProcessCpusMutex

std::string readLine(const std::string& path) {
  std::string line;
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    char buffer[4096];
    if (std::fgets(buffer, sizeof(buffer), f) != nullptr) line = buffer;
    std::fclose(f);
  }
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
  return line;
}

// "a,b,c" -> {"a", "b", "c"} ("" -> {""}).
std::vector<std::string> splitCommas(const std::string& text) {
  std::vector<std::string> items;
  size_t from = 0;
  while (true) {
    const size_t comma = text.find(',', from);
    items.push_back(
        text.substr(from, comma == std::string::npos ? std::string::npos : comma - from));
    if (comma == std::string::npos) return items;
    from = comma + 1;
  }
}

// A list as /sys writes it ("0-3,8"), without checks: empty when unreadable.
std::vector<int> sysList(const std::string& path) {
  std::vector<int> out;
  const std::string line = readLine(path);
  if (line.empty()) return out;
  for (const auto& item : splitCommas(line)) {
    int a = 0, b = 0;
    if (std::sscanf(item.c_str(), "%d-%d", &a, &b) == 2) {
      for (int c = a; c <= b; ++c) out.push_back(c);
    } else if (std::sscanf(item.c_str(), "%d", &a) == 1) {
      out.push_back(a);
    }
  }
  return out;
}

// CPU -> node, from /sys/devices/system/node/node<N>/cpulist (read once).
const std::map<int, int>& cpuNodes() {
  static const std::map<int, int> nodes = [] {
    std::map<int, int> m;
    if (DIR* d = ::opendir("/sys/devices/system/node")) {
      while (const dirent* e = ::readdir(d)) {
        int node = -1;
        if (std::sscanf(e->d_name, "node%d", &node) != 1 || node < 0) continue;
        for (int cpu : sysList(detail::concat("/sys/devices/system/node/", e->d_name, "/cpulist")))
          m[cpu] = node;
      }
      ::closedir(d);
    }
    return m;
  }();
  return nodes;
}

}  // namespace

std::vector<int> parseCpuList(const std::string& text, const char* what) {
  std::vector<int> out;
  const auto bad = [&](const std::string& why) {
    TPCOMM_THROW(kInvalidUsage, what, "='", text, "' is not a CPU list such as 0-3,8 (", why, ")");
  };
  for (const auto& item : text.empty() ? std::vector<std::string>{} : splitCommas(text)) {
    const auto dash = item.find('-');
    const std::string first = item.substr(0, dash);
    const std::string last = dash == std::string::npos ? first : item.substr(dash + 1);
    const auto number = [&](const std::string& s) {
      if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos || s.size() > 5)
        bad(detail::concat("'", item, "'"));
      return std::atoi(s.c_str());
    };
    const int a = number(first), b = number(last);
    if (b < a) bad(detail::concat("'", item, "' runs backwards"));
    if (b >= CPU_SETSIZE) bad(detail::concat("CPU ", b, " is past ", CPU_SETSIZE - 1));
    for (int c = a; c <= b; ++c) out.push_back(c);
  }
  if (out.empty()) bad("no CPU");
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  const long online = ::sysconf(_SC_NPROCESSORS_CONF);
  if (online > 0 && out.back() >= online)
    bad(detail::concat("this machine has CPUs 0-", online - 1));
  return out;
}

std::string formatCpuList(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    out += detail::concat(out.empty() ? "" : ",", cpus[i]);
    if (j > i) out += detail::concat("-", cpus[j]);
    i = j + 1;
  }
  return out;
}

void setProcessCpus(std::vector<int> cpus) {
  std::lock_guard<std::mutex> lock(gProcessCpusMutex);
  gProcessCpus = std::move(cpus);
}

std::vector<int> threadCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
    }
  }
  if (cpus.empty()) {
    const long online = std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN));
    for (long c = 0; c < online && c < CPU_SETSIZE; ++c) cpus.push_back(static_cast<int>(c));
  }
  return cpus;
}

std::vector<int> containerCpus() {
  std::vector<int> cpus = sysList("/sys/fs/cgroup/cpuset.cpus.effective");
  if (cpus.empty()) cpus = sysList("/sys/devices/system/cpu/online");
  return cpus;
}

std::vector<int> rankCpus() {
  std::vector<int> declared;
  const char* from = "tpcomm.set_cpu_shm_cpus";
  {
    std::lock_guard<std::mutex> lock(gProcessCpusMutex);
    declared = gProcessCpus;
  }
  if (declared.empty() && !settings().cpuShmCpus.empty()) {
    declared = parseCpuList(settings().cpuShmCpus, "TPCOMM_CPU_SHM_CPUS");
    from = "TPCOMM_CPU_SHM_CPUS";
  }
  if (declared.empty()) return threadCpus();
  // A declared list counts only the CPUs this process's cgroup lets it use.
  const std::vector<int> usable = containerCpus();
  if (usable.empty()) return declared;
  std::vector<int> kept;
  std::set_intersection(declared.begin(), declared.end(), usable.begin(), usable.end(),
                        std::back_inserter(kept));
  TPCOMM_CHECK(!kept.empty(), kInvalidUsage, from, " gives CPUs ", formatCpuList(declared),
               ", none of which this process may use (", formatCpuList(usable), ")");
  return kept;
}

int quotaCpus() {
  int cpus = 0;
  // "max 100000" (none) or "<quota> <period>".
  if (FILE* f = std::fopen("/sys/fs/cgroup/cpu.max", "r")) {
    char quota[32] = {};
    long long period = 0;
    if (std::fscanf(f, "%31s %lld", quota, &period) == 2 && std::strcmp(quota, "max") != 0 &&
        period > 0) {
      const long long q = std::atoll(quota);
      if (q > 0) cpus = static_cast<int>(std::max<long long>(1, q / period));
    }
    std::fclose(f);
  }
  return cpus;
}

int usableCpus() {
  const int cpus = static_cast<int>(threadCpus().size());
  const int quota = quotaCpus();
  return quota > 0 ? std::min(cpus, quota) : cpus;
}

int ranksWithOwnCpu(const std::vector<std::vector<int>>& allowed) {
  std::vector<int> holder(CPU_SETSIZE, -1);  // CPU -> the rank it is given to
  std::vector<char> seen;
  // Kuhn's augmenting paths: at most ranks x (ranks x CPUs) steps.
  std::function<bool(int)> place = [&](int rank) {
    for (int cpu : allowed[rank]) {
      if (cpu < 0 || cpu >= CPU_SETSIZE || seen[cpu]) continue;
      seen[cpu] = 1;
      if (holder[cpu] < 0 || place(holder[cpu])) {
        holder[cpu] = rank;
        return true;
      }
    }
    return false;
  };
  int placed = 0;
  for (size_t r = 0; r < allowed.size(); ++r) {
    seen.assign(CPU_SETSIZE, 0);
    placed += place(static_cast<int>(r)) ? 1 : 0;
  }
  return placed;
}

int numaNodeOf(int cpu) {
  const auto& nodes = cpuNodes();
  if (nodes.empty()) return 0;
  const auto it = nodes.find(cpu);
  return it == nodes.end() ? -1 : it->second;
}

int numaNodes() {
  const auto nodes = sysList("/sys/devices/system/node/has_memory");
  return std::max<int>(1, static_cast<int>(nodes.size()));
}

std::vector<RankPlace> placeRanks(const std::vector<std::vector<int>>& allowed,
                                  const std::vector<int64_t>& threadSettings,
                                  const std::vector<int>& quotas) {
  const int size = static_cast<int>(allowed.size());
  std::map<int, std::vector<int>> owners;  // CPU -> the ranks that list it, ascending
  for (int r = 0; r < size; ++r) {
    for (int cpu : allowed[r]) owners[cpu].push_back(r);
  }
  // Each rank's fair share: every CPU split equally among its owners; then
  // whole targets, the leftover CPUs one each to the ranks with the largest
  // remainders (then the fewest CPUs, then the lowest rank first), so that handing the shared CPUs
  // out in ascending order gives unpinned ranks contiguous blocks.
  std::vector<double> fair(size, 0.0);
  for (const auto& [cpu, ranks] : owners) {
    for (int r : ranks) fair[r] += 1.0 / static_cast<double>(ranks.size());
  }
  std::vector<size_t> target(size, 0);
  size_t given = 0;
  for (int r = 0; r < size; ++r) {
    target[r] = static_cast<size_t>(fair[r] + 1e-9);
    given += target[r];
  }
  std::vector<int> byRemainder(size);
  for (int r = 0; r < size; ++r) byRemainder[r] = r;
  std::stable_sort(byRemainder.begin(), byRemainder.end(), [&](int a, int b) {
    const double ra = fair[a] - static_cast<double>(target[a]);
    const double rb = fair[b] - static_cast<double>(target[b]);
    if (ra > rb + 1e-9 || rb > ra + 1e-9) return ra > rb;
    return target[a] < target[b];  // equal remainders: the rank with fewer first
  });
  for (size_t i = 0; given < owners.size() && i < byRemainder.size(); ++i, ++given)
    ++target[byRemainder[i]];
  std::vector<RankPlace> places(size);
  for (const auto& [cpu, ranks] : owners) {
    if (ranks.size() == 1) places[ranks[0]].cpus.push_back(cpu);
  }
  for (const auto& [cpu, ranks] : owners) {
    if (ranks.size() == 1) continue;
    int chosen = -1;
    for (int r : ranks) {
      if (places[r].cpus.size() < target[r]) {
        chosen = r;
        break;
      }
    }
    if (chosen < 0) {
      chosen = ranks[0];
      for (int r : ranks) {
        if (places[r].cpus.size() < places[chosen].cpus.size()) chosen = r;
      }
    }
    places[chosen].cpus.push_back(cpu);
  }
  for (int r = 0; r < size; ++r) {
    RankPlace& p = places[r];
    std::sort(p.cpus.begin(), p.cpus.end());
    std::map<int, int> onNode;
    for (int cpu : p.cpus) ++onNode[numaNodeOf(cpu)];
    p.node = allowed[r].empty() ? 0 : numaNodeOf(allowed[r][0]);
    int most = 0;
    for (const auto& [node, count] : onNode) {
      if (count > most && node >= 0) {
        most = count;
        p.node = node;
      }
    }
    if (p.node < 0) p.node = 0;
    const int64_t setting = r < static_cast<int>(threadSettings.size()) ? threadSettings[r] : 0;
    if (setting > 0) {
      p.threads = static_cast<int>(setting);
      continue;
    }
    int threads = std::clamp(static_cast<int>(p.cpus.size()), 1, kMaxThreads);
    const int quota = r < static_cast<int>(quotas.size()) ? quotas[r] : 0;
    if (quota > 0) threads = std::min(threads, std::max(1, quota / std::max(1, size)));
    p.threads = threads;
  }
  return places;
}

std::vector<int> workerCpus(const RankPlace& place, const std::vector<int>& own) {
  std::vector<int> cpus = place.cpus;
  const bool pinnedInShare =
      own.size() == 1 && std::find(cpus.begin(), cpus.end(), own[0]) != cpus.end();
  if (pinnedInShare) {
    cpus.erase(std::find(cpus.begin(), cpus.end(), own[0]));
  } else if (!cpus.empty()) {
    cpus.erase(cpus.begin());
  }
  if (static_cast<int>(cpus.size()) < place.threads - 1) return {};
  cpus.resize(std::max(0, place.threads - 1));
  return cpus;
}

}  // namespace tpcomm::coord
