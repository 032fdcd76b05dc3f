// A CPU allreduce's cost from C++, per call: through c10d::ProcessGroup
// (torch's dispatcher, as torch's C++ callers reach a backend) and through
// tpcomm::allReduce (the direct route, straight to the backend). `python -m tpcomm.bench cpu --paths --cpp <this
// program>` runs it beside Python's ways of calling the same allreduce.
//
//   ./allreduce_latency --world-size 2 [--sizes 4,64,1024,16384] [--iters 2000] [--rounds 5]
//
// Rank 0 prints one line per size: "bytes=4 process_group_us=... direct_us=..."
// (float32 SUM in place; per round the slowest rank's mean over --iters
// calls, the best of --rounds rounds, the two ways alternated).
#include <cstdio>
#include <sstream>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "launch.hpp"
#include "tpcomm/tpcomm.hpp"

int main(int argc, char** argv) {
  const auto args = example::parseArgs(
      argc, argv,
      example::withLaunchArgs({{"sizes", "4,64,1024,16384"}, {"iters", "2000"}, {"rounds", "5"}}));
  const int world = std::stoi(args.at("world-size"));
  const int rank = std::stoi(args.at("rank"));
  if (rank < 0) return example::launchSelf(argc, argv, args, world, std::chrono::seconds(1200));
  at::set_num_threads(1);
  auto store = example::makeStore(args.at("master-addr"), std::stoi(args.at("port")), rank, world);
  auto pg = tpcomm::makeProcessGroup(store, rank, world);
  const int iters = std::stoi(args.at("iters"));
  const int rounds = std::stoi(args.at("rounds"));
  std::stringstream sizes(args.at("sizes"));
  for (std::string item; std::getline(sizes, item, ',');) {
    const int64_t bytes = std::stoll(item);
    std::vector<at::Tensor> x{at::ones({std::max<int64_t>(bytes / 4, 1)}, at::kFloat)};
    const auto timeOne = [&](auto&& call) {
      double best = 1e30;
      for (int r = 0; r < rounds; ++r) {
        pg->barrier()->wait();
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; ++i) call();
        // The slowest rank's time (as the Python benchmark keeps it).
        std::vector<at::Tensor> us{at::full({1}, std::chrono::duration<double, std::micro>(
                                                     std::chrono::steady_clock::now() - start)
                                                         .count() / iters, at::kDouble)};
        pg->allreduce(us, c10d::AllreduceOptions{c10d::ReduceOp::MAX})->wait();
        best = std::min(best, us[0].item<double>());
      }
      return best;
    };
    const auto viaGroup = [&] { pg->allreduce(x)->wait(); };
    const auto viaDirect = [&] { tpcomm::allReduce(pg, x[0]); };
    for (int i = 0; i < 100; ++i) viaGroup();
    // Alternated, so both see the same machine.
    double group = 1e30, direct = 1e30;
    for (int r = 0; r < 2; ++r) {
      group = std::min(group, timeOne(viaGroup));
      direct = std::min(direct, timeOne(viaDirect));
    }
    if (rank == 0) {
      std::printf("bytes=%lld process_group_us=%.2f direct_us=%.2f\n", (long long)bytes, group,
                  direct);
      std::fflush(stdout);
    }
  }
  return 0;
}
