#include <gtest/gtest.h>
#include <unistd.h>

#include <map>

#include "common/error.hpp"
#include "common/settings.hpp"
#include "coordinator/cpu/cpu_shm_path.hpp"

namespace tpcomm {
namespace {

Settings::Lookup fakeEnv(std::map<std::string, std::string> env) {
  return [env](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
}

// Each (variable, value) alone is refused as InvalidUsage naming the variable.
void expectEachRefused(const std::vector<std::pair<const char*, const char*>>& bad) {
  for (const auto& [name, value] : bad) {
    try {
      Settings::parse(fakeEnv({{name, value}}));
      ADD_FAILURE() << name << "=" << value << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  }
}

TEST(Settings, DefaultsWhenUnset) { EXPECT_FALSE(Settings::parse(fakeEnv({})).debug); }

TEST(Settings, BooleanSpellings) {
  for (const char* on : {"1", "true", "TRUE", "yes", "On"}) {
    EXPECT_TRUE(Settings::parse(fakeEnv({{"TPCOMM_DEBUG", on}})).debug) << on;
  }
  for (const char* off : {"0", "false", "no", "OFF", ""}) {
    EXPECT_FALSE(Settings::parse(fakeEnv({{"TPCOMM_DEBUG", off}})).debug) << off;
  }
}

TEST(Settings, MalformedValueNamesVariableAndValue) {
  try {
    Settings::parse(fakeEnv({{"TPCOMM_DEBUG", "maybe"}}));
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
    const std::string what = e.what();
    EXPECT_NE(what.find("TPCOMM_DEBUG='maybe'"), std::string::npos) << what;
  }
}

TEST(Settings, CustomAllreduceIntegers) {
  Settings d = Settings::parse(fakeEnv({}));
  EXPECT_EQ(d.carMaxBytes, 8 << 20);
  EXPECT_EQ(d.carTimeoutMs, 0);  // the group's timeout
  EXPECT_EQ(d.carBlocks, 0);
  Settings s = Settings::parse(fakeEnv({{"TPCOMM_CAR_MAX_BYTES", "1024"},
                                        {"TPCOMM_CAR_TIMEOUT_MS", "250"},
                                        {"TPCOMM_CAR_BLOCKS", "8"}}));
  EXPECT_EQ(s.carMaxBytes, 1024);
  EXPECT_EQ(s.carTimeoutMs, 250);
  EXPECT_EQ(s.carBlocks, 8);
  const std::vector<std::pair<const char*, const char*>> bad = {
      {"TPCOMM_CAR_MAX_BYTES", "12x"}, {"TPCOMM_CAR_MAX_BYTES", "1000"},
      {"TPCOMM_CAR_TIMEOUT_MS", "-1"}, {"TPCOMM_CAR_BLOCKS", "65"},
      {"TPCOMM_CAR_BLOCKS", ""},       {"TPCOMM_CAR_BLOCKS", "99999999999999999999"}};
  expectEachRefused(bad);
}

TEST(Settings, CpuSharedMemory) {
  Settings d = Settings::parse(fakeEnv({}));
  EXPECT_EQ(d.cpuShm, "auto");
  EXPECT_EQ(d.cpuShmBufferBytes, 0);  // the group's choice (coord::autoBufferBytes)
  EXPECT_EQ(d.cpuShmTwoPhaseBytes, 16 << 10);
  EXPECT_EQ(d.cpuShmSpinUs, -1);  // the group's policy (coord::spinPolicy)
  EXPECT_FALSE(d.cpuShmYield);
  EXPECT_TRUE(Settings::parse(fakeEnv({{"TPCOMM_CPU_SHM_YIELD", "1"}})).cpuShmYield);
  expectEachRefused({{"TPCOMM_CPU_SHM_YIELD", "often"}});
  EXPECT_EQ(d.cpuReduceIsa, "auto");
  EXPECT_EQ(d.cpuHierSliceBytes, 4 << 20);
  EXPECT_EQ(Settings::parse(fakeEnv({{"TPCOMM_CPU_HIER_SLICE_BYTES", "0"}})).cpuHierSliceBytes, 0);
  const std::vector<std::pair<const char*, const char*>> modes = {
      {"", "auto"}, {"AUTO", "auto"}, {"0", "0"}, {"1", "1"}, {"off", "0"}, {"true", "1"}};
  for (const auto& [value, mode] : modes) {
    EXPECT_EQ(Settings::parse(fakeEnv({{"TPCOMM_CPU_SHM", value}})).cpuShm, mode) << value;
  }
  Settings s = Settings::parse(fakeEnv({{"TPCOMM_CPU_SHM_BUFFER_BYTES", "8192"},
                                        {"TPCOMM_CPU_SHM_TWO_PHASE_BYTES", "0"},
                                        {"TPCOMM_CPU_SHM_SPIN_US", "0"}}));
  EXPECT_EQ(s.cpuShmBufferBytes, 8192);
  EXPECT_EQ(s.cpuShmTwoPhaseBytes, 0);
  EXPECT_EQ(s.cpuShmSpinUs, 0);
  const std::vector<std::pair<const char*, const char*>> bad = {
      {"TPCOMM_CPU_SHM", "sometimes"},
      {"TPCOMM_CPU_SHM_BUFFER_BYTES", "4100"},
      {"TPCOMM_CPU_SHM_BUFFER_BYTES", "1024"},
      {"TPCOMM_CPU_SHM_BUFFER_BYTES", "-64"},
      {"TPCOMM_CPU_SHM_TWO_PHASE_BYTES", "-1"},
      {"TPCOMM_CPU_SHM_SPIN_US", "2000000"},
      {"TPCOMM_CPU_SHM_SPIN_US", "-2"},
      {"TPCOMM_CPU_REDUCE_ISA", "sse9"},
      {"TPCOMM_CPU_HIER_SLICE_BYTES", "-1"},
      {"TPCOMM_CPU_SHM_CPUS", "0-"},
      {"TPCOMM_CPU_SHM_CPUS", "a"},
      {"TPCOMM_CPU_SHM_CPUS", "1,,2"}};
  expectEachRefused(bad);
  EXPECT_EQ(Settings::parse(fakeEnv({{"TPCOMM_CPU_SHM_CPUS", "0-7,16-23"}})).cpuShmCpus,
            "0-7,16-23");
  for (const char* level : {"avx512", "avx2", "portable", "auto"}) {
    EXPECT_EQ(Settings::parse(fakeEnv({{"TPCOMM_CPU_REDUCE_ISA", level}})).cpuReduceIsa, level);
  }
}

TEST(Settings, CpuSharedMemoryDefaultChunk) {
  // 1 MiB up to 8 ranks (the region's 16 MiB: two slots a rank), less
  // beyond, never below 256 KiB a thread.
  EXPECT_EQ(coord::autoBufferBytes(2, 1), 1 << 20);
  EXPECT_EQ(coord::autoBufferBytes(8, 1), 1 << 20);
  EXPECT_EQ(coord::autoBufferBytes(16, 1), 512 << 10);
  EXPECT_EQ(coord::autoBufferBytes(64, 1), 256 << 10);
  EXPECT_EQ(coord::autoBufferBytes(1024, 1), 256 << 10);
  EXPECT_EQ(coord::autoBufferBytes(2, 6), 6 * (256 << 10));
  EXPECT_EQ(coord::autoBufferBytes(64, 8), 8 * (256 << 10));
  EXPECT_EQ(coord::autoBufferBytes(24, 1) % 64, 0);
  EXPECT_EQ(coord::autoBufferBytes(24, 1), (16 << 20) / 48 / 64 * 64);
}

TEST(Settings, CpuSharedMemoryWaitingPolicy) {
  const int cpus = coord::usableCpus();
  EXPECT_GE(cpus, 1);
  // Ranks that fit the CPUs poll 1 ms, more ranks than CPUs a few polls
  // (spin 0) before the futex; no wait yields the core unless
  // TPCOMM_CPU_SHM_YIELD=1 asks, oversubscribed or not.
  const auto fits = coord::spinPolicy(-1, 1);
  EXPECT_EQ(fits.spin.count(), 1000);
  EXPECT_FALSE(fits.yield);
  EXPECT_TRUE(coord::spinPolicy(-1, 1, 0, true).yield);
  EXPECT_EQ(coord::spinPolicy(-1, 1, 0, true).spin.count(), 1000);
  const auto crowded = coord::spinPolicy(-1, static_cast<int>(cpus) + 1);
  EXPECT_EQ(crowded.spin.count(), 0);
  EXPECT_FALSE(crowded.yield);
  EXPECT_TRUE(coord::spinPolicy(-1, static_cast<int>(cpus) + 1, 0, true).yield);
  EXPECT_EQ(coord::spinPolicy(7, 1).spin.count(), 7);
  EXPECT_FALSE(coord::spinPolicy(7, 1).yield);
  EXPECT_TRUE(coord::spinPolicy(7, 1, 0, true).yield);
  EXPECT_EQ(coord::spinPolicy(7, static_cast<int>(cpus) + 1).spin.count(), 7);
  // The group's CPUs, when given (the union of its ranks' affinity masks),
  // decide instead of this process's: two ranks pinned to a core each fit.
  EXPECT_EQ(coord::spinPolicy(-1, 2, 2).spin.count(), 1000);
  EXPECT_EQ(coord::spinPolicy(-1, 3, 2).spin.count(), 0);
  // The group's CPUs: how many ranks can each have one of their own.
  EXPECT_EQ(coord::ranksWithOwnCpu({{0}, {1}}), 2);        // pinned apart
  EXPECT_EQ(coord::ranksWithOwnCpu({{0, 1}, {0, 1}}), 2);  // unpinned, enough CPUs
  EXPECT_EQ(coord::ranksWithOwnCpu({{0}, {0}}), 1);        // one core for both
  // Three CPUs in the union, but ranks 0 and 1 share core 0.
  EXPECT_EQ(coord::ranksWithOwnCpu({{0}, {0}, {1, 2}}), 2);
  // An augmenting path: rank 0 first takes CPU 0, then gives it up for 1.
  EXPECT_EQ(coord::ranksWithOwnCpu({{0, 1}, {0}}), 2);
  EXPECT_EQ(coord::ranksWithOwnCpu({{0, 1}, {0, 1}, {0, 1}}), 2);
}

TEST(Settings, MessageQueueSpin) {
  EXPECT_EQ(Settings::parse(fakeEnv({})).mqSpinUs, 200);
  EXPECT_EQ(Settings::parse(fakeEnv({{"TPCOMM_MQ_SPIN_US", "0"}})).mqSpinUs, 0);
  EXPECT_EQ(Settings::parse(fakeEnv({{"TPCOMM_MQ_SPIN_US", "5000"}})).mqSpinUs, 5000);
  expectEachRefused({{"TPCOMM_MQ_SPIN_US", "-1"}, {"TPCOMM_MQ_SPIN_US", "fast"}});
  EXPECT_TRUE(Settings::parse(fakeEnv({})).mqSpinAdapt);
  EXPECT_FALSE(Settings::parse(fakeEnv({{"TPCOMM_MQ_SPIN_ADAPT", "0"}})).mqSpinAdapt);
  expectEachRefused({{"TPCOMM_MQ_SPIN_ADAPT", "sometimes"}});
}

TEST(Settings, TableDocumentsEverySetting) {
  const auto& table = settingTable();
  ASSERT_FALSE(table.empty());
  for (const auto& s : table) {
    EXPECT_EQ(std::string(s.name).rfind("TPCOMM_", 0), 0u) << s.name;
    EXPECT_GT(std::string(s.doc).size(), 20u) << s.name;
    // Every declared default parses.
    EXPECT_NO_THROW(Settings::parse(fakeEnv({{s.name, s.defaultValue}}))) << s.name;
  }
}

}  // namespace
}  // namespace tpcomm
