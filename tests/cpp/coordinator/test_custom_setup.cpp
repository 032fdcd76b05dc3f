// The custom-allreduce set-up protocol (coordinator/cuda/custom_setup.*) with a
// fake GPU side: every rank must reach the same verdict, and a failure on
// one rank must be named on all of them, never leave a rank waiting.
// Longer than 600 lines because every case drives the fake GPU side and
// the verdict collection at its top (FakeDevice, Verdicts).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "common/error.hpp"
#include "coordinator/cuda/custom_path.hpp"
#include "coordinator/cuda/custom_setup.hpp"
#include "custom_allreduce/signal.hpp"
#include "group_fixture.hpp"

namespace tpcomm::testing {
namespace {

using coord::CustomDevice;

// Buffers of every fake rank, reachable by handle (what IPC does).
struct FakeWorld {
  std::mutex mutex;
  std::map<std::string, uint32_t*> byHandle;
};

struct FakeSpec {
  std::string uuid = "gpu-0";
  std::string failAllocate;           // non-empty: allocate() throws this
  std::string failOpen;               // non-empty: open() throws this
  bool dropWrites = false;            // probe writes from this rank vanish
  std::set<std::string> unreachable;  // UUIDs this GPU has no P2P to
  std::set<std::string> invisible;    // UUIDs this process's CUDA does not see
  std::set<std::string> pcie;         // UUIDs linked to this GPU without NVLink
};

// What fake ranks did, in order, for the teardown and reset tests.
struct FakeLog {
  std::mutex mutex;
  std::vector<std::string> events;
  std::atomic<int> synchronized{0};
  std::atomic<int> zeroed{0};
  void add(const std::string& e) {
    std::lock_guard<std::mutex> lock(mutex);
    events.push_back(e);
  }
};

class FakeDevice : public CustomDevice {
 public:
  FakeDevice(std::shared_ptr<FakeWorld> world, int rank, FakeSpec spec)
      : world_(std::move(world)), rank_(rank), spec_(std::move(spec)) {}
  std::string gpuUuid() override { return spec_.uuid; }
  std::string allocate(size_t) override {
    if (!spec_.failAllocate.empty()) throw std::runtime_error(spec_.failAllocate);
    const std::string handle = "handle-of-rank-" + std::to_string(rank_);
    std::lock_guard<std::mutex> lock(world_->mutex);
    world_->byHandle[handle] = probes_;
    return handle;
  }
  void* ownBase() override { return probes_; }
  char peerAccess(const std::string& uuid) override {
    if (spec_.invisible.count(uuid)) return '?';
    return spec_.unreachable.count(uuid) == 0 ? 'y' : 'x';
  }
  char linkTo(const std::string& uuid) override { return spec_.pcie.count(uuid) ? 'p' : 'n'; }
  // Launches are never made here; the order's synchronize() is what
  // teardown and the reset wait on.
  class LoggingOrder : public car::LaunchOrder {
   public:
    LoggingOrder(std::shared_ptr<FakeLog> log, int rank) : log_(std::move(log)), rank_(rank) {}
    void before(cudaStream_t) override {}
    void after(cudaStream_t) override {}
    void synchronize() override {
      if (!log_) return;
      log_->add("rank " + std::to_string(rank_) + " synchronize");
      ++log_->synchronized;
    }

   private:
    std::shared_ptr<FakeLog> log_;
    int rank_;
  };
  std::unique_ptr<car::LaunchOrder> makeLaunchOrder() override {
    return std::make_unique<LoggingOrder>(log, rank_);
  }
  void zeroSignals() override {
    if (log) {
      // Every rank's kernels had ended before any rank zeroes (the reset's
      // first barrier).
      EXPECT_EQ(log->synchronized.load(), expectedRanks) << "rank " << rank_ << " zeroed early";
      log->add("rank " + std::to_string(rank_) + " zero");
      ++log->zeroed;
    }
    std::memset(probes_, 0, sizeof(probes_));
  }
  ~FakeDevice() override {
    if (log) log->add("rank " + std::to_string(rank_) + " unmap peers");
  }
  std::shared_ptr<FakeLog> log;
  int expectedRanks = 0;
  void* open(const std::string& handle) override {
    if (!spec_.failOpen.empty()) throw std::runtime_error(spec_.failOpen);
    // The exchange pads handles to a fixed width.
    const std::string key = handle.substr(0, handle.find('\0'));
    std::lock_guard<std::mutex> lock(world_->mutex);
    return world_->byHandle.at(key);
  }
  void writeProbe(void* peer, int fromRank, uint32_t value) override {
    if (!spec_.dropWrites) static_cast<uint32_t*>(peer)[fromRank] = value;
  }
  std::vector<uint32_t> readProbes(int n) override { return {probes_, probes_ + n}; }
  uint32_t* errorHost() override { return &error_; }
  uint32_t* errorDevice() override { return &error_; }

  // Zero-copy: a host "device table"; a pointer's "allocation" is its 4 KiB
  // page, and a mapping lands at the same address.
  // Each chunk of the table a vector of its own (its address never moves).
  car::RegisteredInputs* allocateTable(size_t slots) override {
    tables.emplace_back(slots, car::RegisteredInputs{});
    return tables.back().data();
  }
  void freeTable(car::RegisteredInputs*) override {
    ++freed;
    if (log) log->add("rank " + std::to_string(rank_) + " free table");
  }
  // Slot i over the chunks.
  car::RegisteredInputs& slot(size_t i) {
    return tables.at(i / coord::kTableChunk).at(i % coord::kTableChunk);
  }
  car::ExportedPointer exportPointer(const void* ptr) override {
    if (unexportable.count(ptr)) {
      throw std::runtime_error("cudaIpcGetMemHandle: invalid argument (expandable segments)");
    }
    const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
    return {"page:" + std::to_string(p & ~uintptr_t{0xfff}), p & 0xfff};
  }
  void* openRegistered(const std::string& handle) override {
    const std::string text = handle.substr(0, handle.find('\0'));
    EXPECT_EQ(text.rfind("page:", 0), 0u) << text;
    return reinterpret_cast<void*>(std::stoull(text.substr(5)));
  }
  void fillTable(car::RegisteredInputs* t, const std::vector<int64_t>& slots,
                 const std::vector<car::RegisteredInputs>& entries) override {
    for (auto& chunk : tables) {
      if (chunk.data() != t) continue;
      for (size_t i = 0; i < slots.size(); ++i) chunk.at(slots[i]) = entries[i];
      return;
    }
    ADD_FAILURE() << "fillTable of a table never allocated";
  }
  std::deque<std::vector<car::RegisteredInputs>> tables;
  std::set<const void*> unexportable;
  int freed = 0;

 private:
  std::shared_ptr<FakeWorld> world_;
  int rank_;
  FakeSpec spec_;
  uint32_t probes_[car::kMaxRanks] = {};
  uint32_t error_ = 0;
};

struct Verdicts {
  std::vector<coord::CustomSetupResult> results;
  // Every rank reached the same verdict; returns it.
  const coord::CustomSetupResult& agreed() const {
    for (const auto& r : results) {
      EXPECT_EQ(r.available, results[0].available);
      EXPECT_EQ(r.reason, results[0].reason);
    }
    return results[0];
  }
};

Verdicts setUp(int size, const std::function<FakeSpec(int)>& spec,
               const std::function<std::string(int)>& host = {},
               const std::function<coord::LaunchSettings(int)>& launch = {}) {
  ThreadGroup group(size);
  auto world = std::make_shared<FakeWorld>();
  std::vector<std::unique_ptr<FakeDevice>> devices;
  for (int r = 0; r < size; ++r) devices.push_back(std::make_unique<FakeDevice>(world, r, spec(r)));
  Verdicts v;
  v.results.resize(size);
  runRanks(size, [&](int r) {
    v.results[r] = coord::setUpCustomAllreduce(*group.cpu[r], r, size, *devices[r],
                                               host ? host(r) : "node-a", 1 << 20,
                                               launch ? launch(r) : coord::LaunchSettings{});
  });
  return v;
}

TEST(CustomSetup, OneHostWithP2PIsAvailableAndEveryRankMapsEveryBuffer) {
  for (int n : {2, 3, 8}) {
    const Verdicts v = setUp(n, [](int r) { return FakeSpec{"gpu-" + std::to_string(r)}; });
    EXPECT_TRUE(v.agreed().available) << v.agreed().reason;
    // Rank r's view of rank q's buffer is rank q's own buffer.
    for (int r = 0; r < n; ++r) {
      ASSERT_EQ(v.results[r].bases.size(), static_cast<size_t>(n));
      for (int q = 0; q < n; ++q) EXPECT_EQ(v.results[r].bases[q], v.results[q].bases[q]);
      EXPECT_EQ(v.results[r].devices, v.results[0].devices);
    }
  }
}

TEST(CustomSetup, RanksSharingAGpuNeedNoP2PAndShareItsIndex) {
  const Verdicts v = setUp(4, [](int) {
    FakeSpec s;
    s.uuid = "the-one-gpu";
    s.unreachable = {"the-one-gpu"};  // a GPU reaches itself without P2P
    return s;
  });
  EXPECT_TRUE(v.agreed().available) << v.agreed().reason;
  EXPECT_EQ(v.results[2].devices, (std::vector<int>{0, 0, 0, 0}));
}

TEST(CustomSetup, AFailedAllocationIsNamedOnEveryRank) {
  const Verdicts v = setUp(3, [](int r) {
    FakeSpec s{"gpu-" + std::to_string(r)};
    if (r == 2) s.failAllocate = "out of memory";
    return s;
  });
  EXPECT_FALSE(v.agreed().available);
  EXPECT_EQ(v.agreed().reason,
            "rank 2: could not allocate its custom-allreduce buffer: out of memory");
}

TEST(CustomSetup, RanksOnTwoHostsAreRefusedBeforeAnyOpen) {
  const Verdicts v = setUp(
      4,
      [](int r) {
        FakeSpec s{"gpu-" + std::to_string(r)};
        s.failOpen = "must not be called";
        return s;
      },
      [](int r) { return r < 2 ? "node-a" : "node-b"; });
  EXPECT_FALSE(v.agreed().available);
  EXPECT_EQ(v.agreed().reason, "ranks 0 and 2 are on different hosts ('node-a' and 'node-b')");
}

TEST(CustomSetup, AMissingP2PLinkIsNamed) {
  const Verdicts v = setUp(3, [](int r) {
    FakeSpec s{"gpu-" + std::to_string(r)};
    if (r == 1) s.unreachable = {"gpu-2"};
    return s;
  });
  EXPECT_FALSE(v.agreed().available);
  EXPECT_EQ(v.agreed().reason, "no P2P access from rank 1 (GPU 1) to rank 2 (GPU 2)");
}

TEST(CustomSetup, AFailedOpenIsNamedOnEveryRank) {
  const Verdicts v = setUp(4, [](int r) {
    FakeSpec s{"gpu-" + std::to_string(r)};
    if (r == 3) s.failOpen = "cudaIpcOpenMemHandle failed: invalid argument";
    return s;
  });
  EXPECT_FALSE(v.agreed().available);
  EXPECT_EQ(v.agreed().reason,
            "rank 3: could not open or write to a peer's buffer: cudaIpcOpenMemHandle failed: "
            "invalid argument");
}

TEST(CustomSetup, LostProbeWritesFailTheProbeNamingWhoMissedWhom) {
  const Verdicts v = setUp(3, [](int r) {
    FakeSpec s{"gpu-" + std::to_string(r)};
    s.dropWrites = r == 1;
    return s;
  });
  EXPECT_FALSE(v.agreed().available);
  EXPECT_EQ(v.agreed().reason,
            "the IPC write probe failed: rank 0 saw no write from rank 1; rank 2 saw no write "
            "from rank 1");
}

TEST(CustomSetup, WorldSizesOutsideTwoToEightNeedNoExchange) {
  for (int n : {1, 9}) {
    const Verdicts v = setUp(n, [](int) { return FakeSpec{}; });
    EXPECT_FALSE(v.agreed().available);
    EXPECT_EQ(v.agreed().reason, "world size " + std::to_string(n) + " is outside 2..8");
  }
}

// Through the coordinator: eager connect sets the kernel up, the routing
// table follows the verdict, and a call on another GPU is refused.
TEST(CustomSetup, EagerConnectSetsUpTheCoordinatorsRouting) {
  auto world = std::make_shared<FakeWorld>();
  ThreadGroup group(3, false, [world](int rank) -> coord::CustomDeviceFactory {
    return [world, rank](int device) -> std::unique_ptr<CustomDevice> {
      EXPECT_EQ(device, 0);
      return std::make_unique<FakeDevice>(world, rank, FakeSpec{"gpu-" + std::to_string(rank)});
    };
  });
  for (auto& c : group.coordinators) {
    EXPECT_FALSE(c->routing().customAvailable());
    EXPECT_EQ(c->routing().customReason(), "not set up yet (at the group's first CUDA allreduce)");
  }
  runRanks(3, [&](int r) { group.coordinators[r]->eagerConnect(at::Device(at::kCUDA, 0)); });
  for (auto& c : group.coordinators) {
    EXPECT_TRUE(c->routing().customAvailable()) << c->routing().customReason();
    EXPECT_EQ(c->cudaDevice(), at::Device(at::kCUDA, 0));
    EXPECT_EQ(c->routing().decide(c10d::ReduceOp::SUM, at::kHalf, 4096).route,
              coord::DeviceRoute::kCustomOneShot);
    ASSERT_NE(c->customPath(), nullptr);
    EXPECT_TRUE(c->customPath()->available());
  }
  EXPECT_EQ(*group.deviceFactoryCalls, 3);
  try {
    group.coordinators[1]->eagerConnect(at::Device(at::kCUDA, 1));
    FAIL() << "a second GPU was accepted";
  } catch (const tpcomm::Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
    EXPECT_NE(std::string(e.what()).find("a call on cuda:1, but this rank's CUDA calls on the "
                                         "group use cuda:0"),
              std::string::npos)
        << e.what();
  }
}

// graph_capture()'s registration over fake ranks: which address every
// rank's kernel reads each peer's input from once the context exits.
struct ZeroCopyGroup {
  static constexpr size_t kMax = 1 << 20;
  ThreadGroup group;
  std::vector<std::unique_ptr<coord::CustomPath>> paths;
  std::vector<FakeDevice*> fakes;
  std::vector<void*> bases;  // each rank's buffer

  explicit ZeroCopyGroup(int n, std::shared_ptr<FakeLog> log = nullptr)
      : group(n), paths(n), fakes(n), bases(n) {
    auto world = std::make_shared<FakeWorld>();
    runRanks(n, [&](int r) {
      auto fake = std::make_unique<FakeDevice>(world, r, FakeSpec{"gpu-" + std::to_string(r)});
      fake->log = log;
      fake->expectedRanks = n;
      fakes[r] = fake.get();
      paths[r] = std::make_unique<coord::CustomPath>(*group.cpu[r], r, n, at::Device(at::kCUDA, 0),
                                                     std::move(fake), kMax,
                                                     std::chrono::milliseconds(1000), "zc");
      bases[r] = fakes[r]->ownBase();
    });
  }
  const void* staging(int r) const {
    return static_cast<const char*>(bases[r]) + car::BufferLayout::forMaxBytes(kMax).stagingOffset;
  }
  // Where out-of-place calls write (never read by the registration).
  static const void* output() { return reinterpret_cast<const void*>(0x7e0000000000ull); }
  // Rank r's input of captured call i (16-byte aligned, a page per rank and call).
  static const void* input(int r, int i) {
    return reinterpret_cast<const void*>(0x7f0000000000ull + (r * 16 + i) * 0x1000 + 0x40);
  }
};

TEST(CustomZeroCopy, ExitFillsEveryRanksTableWithItsPeersInputsOrStagings) {
  ZeroCopyGroup z(3);
  const auto one = car::Algorithm::kOneShot, two = car::Algorithm::kTwoShot;
  std::vector<std::vector<bool>> staged(3);
  std::vector<std::string> afterCall2(3);
  runRanks(3, [&](int r) {
    auto& path = *z.paths[r];
    if (r == 2) z.fakes[r]->unexportable.insert(ZeroCopyGroup::input(r, 2));
    bool stage = false;
    // Call 0: out of place, one-shot -> read in place. Call 1: in place,
    // one-shot -> staged (peers would read while it writes). Call 2: in
    // place, two-shot -> read in place, except rank 2's (not exportable).
    std::vector<const car::RegisteredInputs*> slots;
    constexpr size_t kBytes = 256;
    slots.push_back(path.registerCapturedCall(ZeroCopyGroup::input(r, 0), ZeroCopyGroup::output(),
                                              kBytes, one, &stage));
    staged[r].push_back(stage);
    slots.push_back(path.registerCapturedCall(ZeroCopyGroup::input(r, 1),
                                              ZeroCopyGroup::input(r, 1), kBytes, one, &stage));
    staged[r].push_back(stage);
    slots.push_back(path.registerCapturedCall(ZeroCopyGroup::input(r, 2),
                                              ZeroCopyGroup::input(r, 2), kBytes, two, &stage));
    staged[r].push_back(stage);
    afterCall2[r] = path.zeroCopyStats().lastStagedReason;
    // Call 3: one-shot into a distinct view that overlaps the input (64
    // bytes further on) -> staged, as in place.
    const void* in3 = ZeroCopyGroup::input(r, 3);
    slots.push_back(path.registerCapturedCall(in3, static_cast<const char*>(in3) + 64, kBytes, one,
                                              &stage));
    staged[r].push_back(stage);
    // One slot per call, in capture order: what each captured kernel reads.
    for (int i = 0; i < 4; ++i) EXPECT_EQ(slots[i], &z.fakes[r]->slot(i));
    // Before the exit no slot is ready: a replay now stops with an error.
    for (int i = 0; i < 4; ++i) EXPECT_EQ(z.fakes[r]->slot(i).ready, 0u);
    path.finishGraphRegistration(*z.group.cpu[r]);
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(staged[r], (std::vector<bool>{false, true, r == 2, true})) << "rank " << r;
    for (int i = 0; i < 4; ++i) {
      const car::RegisteredInputs& e = z.fakes[r]->slot(i);
      EXPECT_EQ(e.ready, 1u);
      for (int q = 0; q < 3; ++q) {
        const bool qStaged = i == 1 || i == 3 || (i == 2 && q == 2);
        EXPECT_EQ(e.input[q], qStaged ? z.staging(q) : ZeroCopyGroup::input(q, i))
            << "rank " << r << " call " << i << " peer " << q;
      }
    }
    const coord::ZeroCopyStats stats = z.paths[r]->zeroCopyStats();
    EXPECT_EQ(stats.registered, r == 2 ? 1 : 2);
    EXPECT_EQ(stats.staged, r == 2 ? 3 : 2);
    EXPECT_EQ(stats.tableSlots, 4);
    EXPECT_EQ(stats.tableCapacity, coord::kTableCapacity);
    EXPECT_FALSE(stats.tableFull);
  }
  EXPECT_NE(afterCall2[2].find("expandable"), std::string::npos) << afterCall2[2];
  EXPECT_EQ(afterCall2[0],
            "a one-shot call whose output overlaps its input (peers would read while it writes)");
  EXPECT_EQ(z.paths[2]->zeroCopyStats().lastStagedReason,
            "a one-shot call whose output overlaps its input (peers would read while it writes)");
}

TEST(CustomZeroCopy, DifferentCaptureCountsRaiseOnEveryRankAndFillNothing) {
  ZeroCopyGroup z(3);
  std::vector<std::string> errors(3);
  runRanks(3, [&](int r) {
    bool stage = false;
    for (int i = 0; i < (r == 0 ? 2 : 1); ++i) {
      z.paths[r]->registerCapturedCall(ZeroCopyGroup::input(r, i), ZeroCopyGroup::output(), 256,
                                       car::Algorithm::kOneShot, &stage);
    }
    try {
      z.paths[r]->finishGraphRegistration(*z.group.cpu[r]);
    } catch (const tpcomm::Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidUsage);
      errors[r] = e.what();
    }
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("ranks captured different numbers of custom allreduces (rank 0: 2, "
                             "rank 1: 1, rank 2: 1)"),
              std::string::npos)
        << errors[r];
    for (const auto& slot : z.fakes[r]->tables.at(0)) EXPECT_EQ(slot.ready, 0u);
  }
  // The next context starts afresh: one call each registers and fills.
  runRanks(3, [&](int r) {
    bool stage = false;
    z.paths[r]->registerCapturedCall(ZeroCopyGroup::input(r, 5), ZeroCopyGroup::output(), 256,
                                     car::Algorithm::kOneShot, &stage);
    z.paths[r]->finishGraphRegistration(*z.group.cpu[r]);
  });
  for (int r = 0; r < 3; ++r) EXPECT_EQ(z.fakes[r]->slot(r == 0 ? 2 : 1).ready, 1u);
}

// The table grows a chunk at a time past kTableChunk captured calls (a
// server capturing 67 batch sizes x 64 allreduces needs 4,288), every slot
// keeps its address, and once kTableCapacity calls are registered later ones
// stage and the stats say the table is full.
TEST(CustomZeroCopy, TheTableGrowsByChunksAndSaysWhenFull) {
  ZeroCopyGroup z(2);
  const int64_t calls = coord::kTableChunk + 192;
  runRanks(2, [&](int r) {
    bool stage = true;
    for (int64_t i = 0; i < calls; ++i) {
      const auto* slot = z.paths[r]->registerCapturedCall(
          ZeroCopyGroup::input(r, static_cast<int>(i % 8)), ZeroCopyGroup::output(), 256,
          car::Algorithm::kTwoShot, &stage);
      ASSERT_FALSE(stage) << "call " << i << " staged";
      ASSERT_EQ(slot, &z.fakes[r]->slot(static_cast<size_t>(i)));
    }
    z.paths[r]->finishGraphRegistration(*z.group.cpu[r]);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(z.fakes[r]->tables.size(), 2u);
    EXPECT_EQ(z.fakes[r]->slot(0).ready, 1u);
    EXPECT_EQ(z.fakes[r]->slot(static_cast<size_t>(calls - 1)).ready, 1u);
    EXPECT_EQ(z.fakes[r]->slot(static_cast<size_t>(calls - 1)).input[1 - r],
              ZeroCopyGroup::input(1 - r, static_cast<int>((calls - 1) % 8)));
    const coord::ZeroCopyStats stats = z.paths[r]->zeroCopyStats();
    EXPECT_EQ(stats.registered, calls);
    EXPECT_EQ(stats.tableSlots, calls);
    EXPECT_FALSE(stats.tableFull);
  }
  // Fill it up on one rank (no exchange needed to take slots).
  auto& path = *z.paths[0];
  bool stage = false;
  for (int64_t i = calls; i < coord::kTableCapacity; ++i) {
    ASSERT_NE(path.registerCapturedCall(ZeroCopyGroup::input(0, 0), ZeroCopyGroup::output(), 256,
                                        car::Algorithm::kTwoShot, &stage),
              nullptr);
  }
  EXPECT_EQ(path.registerCapturedCall(ZeroCopyGroup::input(0, 0), ZeroCopyGroup::output(), 256,
                                      car::Algorithm::kTwoShot, &stage),
            nullptr);
  EXPECT_TRUE(stage);
  const coord::ZeroCopyStats stats = path.zeroCopyStats();
  EXPECT_TRUE(stats.tableFull);
  EXPECT_EQ(stats.tableSlots, coord::kTableCapacity);
  EXPECT_EQ(stats.lastStagedReason, "the zero-copy table is full (65536 captured calls)");
  EXPECT_EQ(z.fakes[0]->tables.size(),
            static_cast<size_t>(coord::kTableCapacity / coord::kTableChunk));
}

// Teardown waits for the rank's kernels before the table is freed and the
// peers' buffers are unmapped (a kernel in flight would touch unmapped memory).
TEST(CustomTeardown, SynchronisesBeforeFreeingAndUnmapping) {
  auto log = std::make_shared<FakeLog>();
  {
    ZeroCopyGroup z(2, log);
    runRanks(2, [&](int r) {
      bool stage = false;
      z.paths[r]->registerCapturedCall(ZeroCopyGroup::input(r, 0), ZeroCopyGroup::output(), 256,
                                       car::Algorithm::kTwoShot, &stage);
    });
  }
  for (int r = 0; r < 2; ++r) {
    const std::string rank = "rank " + std::to_string(r) + " ";
    std::vector<std::string> mine;
    for (const auto& e : log->events) {
      if (e.rfind(rank, 0) == 0) mine.push_back(e.substr(rank.size()));
    }
    EXPECT_EQ(mine, (std::vector<std::string>{"synchronize", "free table", "unmap peers"}))
        << rank;
  }
}

// The collective reset: no rank zeroes before every rank's kernels ended (its
// synchronize), and none returns (and launches again) before every rank
// zeroed; the error words and signal areas are clear afterwards.
TEST(CustomReset, EveryRankSynchronisesBeforeAnyZeroesAndZeroesBeforeAnyLeaves) {
  auto log = std::make_shared<FakeLog>();
  ZeroCopyGroup z(3, log);
  for (int r = 0; r < 3; ++r) {
    *z.fakes[r]->errorHost() = car::errorCode(1, car::kStart, 0);
    static_cast<uint32_t*>(z.fakes[r]->ownBase())[0] = 7;
  }
  runRanks(3, [&](int r) {
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));  // a slow rank
    z.paths[r]->reset(*z.group.cpu[r]);
    EXPECT_EQ(log->zeroed.load(), 3) << "rank " << r << " left the reset before every rank zeroed";
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(*z.fakes[r]->errorHost(), 0u);
    EXPECT_EQ(static_cast<uint32_t*>(z.fakes[r]->ownBase())[0], 0u);
    EXPECT_NO_THROW(z.paths[r]->checkError());
  }
}

// Settings that shape a launch must agree: a mismatch refuses the group on
// every rank, naming the setting and every rank's value, before anything is
// allocated.
TEST(CustomSetup, RanksThatDisagreeOnALaunchSettingAreRefusedNamingIt) {
  const Verdicts v = setUp(
      3,
      [](int r) {
        FakeSpec s{"gpu-" + std::to_string(r)};
        s.failAllocate = "must not be called";
        return s;
      },
      {},
      [](int r) {
        return coord::LaunchSettings{{"TPCOMM_CAR_BLOCKS", r == 2 ? "8" : "0"}};
      });
  EXPECT_FALSE(v.agreed().available);
  EXPECT_EQ(v.agreed().reason,
            "ranks disagree on TPCOMM_CAR_BLOCKS (rank 0: 0, rank 1: 0, rank 2: 8); every rank "
            "of a group must use the same value");
}

// TPCOMM_ROUTE=nccl turns the kernel off; the ranks learn they agree before
// anyone allocates, and a rank that disagrees is named instead of leaving the
// others waiting in the set-up.
TEST(CustomSetup, RouteNcclSkipsTheSetUpOnlyWhenEveryRankSaysSo) {
  for (bool everyRank : {true, false}) {
    ThreadGroup group(2);
    auto world = std::make_shared<FakeWorld>();
    std::vector<coord::CustomSetupResult> results(2);
    runRanks(2, [&](int r) {
      FakeSpec spec{"gpu-" + std::to_string(r)};
      spec.failAllocate = everyRank ? "must not be called" : "";
      FakeDevice device(world, r, spec);
      const std::string mode = everyRank || r == 0 ? "nccl" : "auto";
      results[r] = coord::setUpCustomAllreduce(*group.cpu[r], r, 2, device, "node-a", 1 << 20,
                                               {{"TPCOMM_ROUTE", mode}},
                                               mode == "nccl" ? "TPCOMM_ROUTE=nccl" : "");
    });
    for (const auto& result : results) {
      EXPECT_FALSE(result.available);
      EXPECT_EQ(result.reason, everyRank ? "TPCOMM_ROUTE=nccl"
                                         : "ranks disagree on TPCOMM_ROUTE (rank 0: nccl, rank 1: "
                                           "auto); every rank of a group must use the same value");
    }
  }
}

// One CUDA-visible GPU per process: peers' GPUs are unknown to CUDA there,
// but IPC works; the write probe decides.
TEST(CustomSetup, PeersInvisibleToCudaAreJudgedByTheProbe) {
  const Verdicts ok = setUp(4, [](int r) {
    FakeSpec s{"gpu-" + std::to_string(r)};
    for (int q = 0; q < 4; ++q) {
      if (q != r) s.invisible.insert("gpu-" + std::to_string(q));
    }
    return s;
  });
  EXPECT_TRUE(ok.agreed().available) << ok.agreed().reason;
  const Verdicts lost = setUp(2, [](int r) {
    FakeSpec s{"gpu-" + std::to_string(r)};
    s.invisible.insert("gpu-" + std::to_string(1 - r));
    s.dropWrites = r == 0;
    return s;
  });
  EXPECT_FALSE(lost.agreed().available);
  EXPECT_EQ(lost.agreed().reason, "the IPC write probe failed: rank 1 saw no write from rank 0");
}

// Past 2 GPUs every pair must be NVLink; at 2 GPUs PCIe is accepted.
TEST(CustomSetup, PcieLinksAreRefusedPastTwoGpus) {
  const auto pcie = [](int r) {
    FakeSpec s{"gpu-" + std::to_string(r)};
    for (int q = 0; q < 8; ++q) {
      if (q != r) s.pcie.insert("gpu-" + std::to_string(q));
    }
    return s;
  };
  EXPECT_TRUE(setUp(2, pcie).agreed().available);
  const Verdicts three = setUp(3, pcie);
  EXPECT_FALSE(three.agreed().available);
  EXPECT_EQ(three.agreed().reason,
            "ranks 0 and 1 (GPUs 0 and 1) are not linked by NVLink; past 2 GPUs the custom kernel "
            "needs NVLink between every pair (over PCIe NCCL is faster)");
}

}  // namespace
}  // namespace tpcomm::testing
