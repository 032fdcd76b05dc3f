// A tensor-parallel decode loop in C++ on tpcomm, without Python.
//
//   ./tp_mlp_decode --world-size 2            # launches 2 ranks on this host
//   ./tp_mlp_decode --world-size 2 --rank 0 --port 29500 &   # or one per rank,
//   ./tp_mlp_decode --world-size 2 --rank 1 --port 29500     # from any launcher
//   torchrun --no-python --standalone --nproc-per-node 2 ./tp_mlp_decode
//                                  # (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
//
// A small language model (embedding, `layers` MLP blocks, output head):
// each MLP is split across the ranks Megatron-style (the first matrix by
// rows, the second by columns), so each block ends in one allreduce, which
// tpcomm sends through shared memory. Rank 0 drives: the run's shape (as
// bytes) and each step's inputs (the tokens, the step) go to the other ranks
// through tpcomm's message queue. At the end rank 0 runs the same model unsplit in one process and
// checks the tokens are the same. The model is float64 by default, so that
// the split's different summation order cannot flip a greedy token.
//
// --fault exit|abort with --fault-rank R --fault-step K makes rank R leave
// (exit without a word) or abort its group at step K: every other rank then
// gets c10d::DistBackendError naming it, within the group's timeout.
#include <cstdio>
#include <cstring>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/exception.h>

#include "launch.hpp"
#include "tpcomm/tpcomm.hpp"

namespace {

struct Config {
  int64_t vocab, hidden, ffn, layers, batch, steps;
  at::ScalarType dtype;
};

struct Model {
  at::Tensor embedding;                   // [vocab, hidden]
  at::Tensor head;                        // [vocab, hidden]
  std::vector<at::Tensor> up, down;       // [ffn / world, hidden], [hidden, ffn / world]
};

// The whole model from the seed, then this rank's slices of it (world 1:
// the whole model).
Model makeModel(const Config& c, int rank, int world) {
  at::manual_seed(1234);
  const auto options = at::TensorOptions().dtype(c.dtype);
  Model m;
  m.embedding = at::randn({c.vocab, c.hidden}, options);
  m.head = at::randn({c.vocab, c.hidden}, options);
  const int64_t part = c.ffn / world;
  for (int64_t l = 0; l < c.layers; ++l) {
    at::Tensor up = at::randn({c.ffn, c.hidden}, options) / std::sqrt(double(c.hidden));
    at::Tensor down = at::randn({c.hidden, c.ffn}, options) / std::sqrt(double(c.ffn));
    m.up.push_back(up.narrow(0, rank * part, part).contiguous());
    m.down.push_back(down.narrow(1, rank * part, part).contiguous());
  }
  return m;
}

at::Tensor rmsNorm(const at::Tensor& x) {
  return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + 1e-6);
}

// One decode step: next tokens from `tokens`. `allreduce` sums each block's
// partial output over the ranks (nothing at world size 1).
template <typename AllReduce>
at::Tensor step(const Model& m, const at::Tensor& tokens, AllReduce&& allreduce) {
  at::Tensor x = m.embedding.index_select(0, tokens);
  for (size_t l = 0; l < m.up.size(); ++l) {
    at::Tensor y = at::gelu(x.matmul(m.up[l].t())).matmul(m.down[l].t());
    allreduce(y);
    x = rmsNorm(x + y);
  }
  return x.matmul(m.head.t()).argmax(-1);
}

int runRank(const std::map<std::string, std::string>& args, const Config& c, int rank) {
  const int world = std::stoi(args.at("world-size"));
  const std::string fault = args.at("fault");
  const int faultRank = std::stoi(args.at("fault-rank"));
  const int64_t faultStep = std::stoll(args.at("fault-step"));
  auto store = example::makeStore(args.at("master-addr"), std::stoi(args.at("port")), rank, world);
  tpcomm::Options options;
  options.timeout = std::chrono::seconds(std::stoi(args.at("timeout-s")));
  options.groupName = "tp";
  auto pg = tpcomm::makeProcessGroup(store, rank, world, options);
  auto queue = tpcomm::MessageQueue::create(pg);
  // The run's shape from the driver, as bytes: a rank launched with other
  // arguments stops here instead of computing something else.
  std::string shape = "vocab=" + std::to_string(c.vocab) + " hidden=" + std::to_string(c.hidden) +
                      " ffn=" + std::to_string(c.ffn) + " layers=" + std::to_string(c.layers) +
                      " batch=" + std::to_string(c.batch) + " steps=" + std::to_string(c.steps) +
                      " dtype=" + args.at("dtype");
  const std::string driverShape = queue->broadcastBytes(rank == 0 ? shape : "");
  if (driverShape != shape) {
    std::fprintf(stderr, "rank %d: launched with %s, the driver with %s\n", rank, shape.c_str(),
                 driverShape.c_str());
    return 1;
  }
  const Model model = makeModel(c, rank, world);

  at::Tensor tokens = at::arange(c.batch, at::kLong).mul(7).remainder(c.vocab);
  std::vector<at::Tensor> produced;
  at::Tensor mine;  // what this rank computed at the previous step
  const auto start = std::chrono::steady_clock::now();
  try {
    for (int64_t s = 0; s < c.steps; ++s) {
      if (rank == faultRank && s == faultStep) {
        if (fault == "exit") {
          std::fprintf(stderr, "rank %d: leaving at step %lld\n", rank, (long long)s);
          std::fflush(stderr);
          ::_exit(3);
        }
        if (fault == "abort") {
          std::fprintf(stderr, "rank %d: aborting its group at step %lld\n", rank, (long long)s);
          pg->getBackend(c10::DeviceType::CPU)->abort();
        }
      }
      tpcomm::TensorDict inputs;
      if (rank == 0) inputs = {{"step", at::full({1}, s, at::kLong)}, {"tokens", tokens}};
      inputs = queue->broadcastTensorDict(inputs);
      if (inputs.at("step").item<int64_t>() != s ||
          (mine.defined() && !at::equal(mine, inputs.at("tokens")))) {
        std::fprintf(stderr, "rank %d: step %lld's inputs differ from this rank's own tokens\n",
                     rank, (long long)s);
        return 1;
      }
      // tpcomm::allReduce: the direct route (pg->allreduce({y})->wait() gives
      // the same result through torch's dispatcher, about 0.8 us slower).
      mine = step(model, inputs.at("tokens"), [&](at::Tensor& y) { tpcomm::allReduce(pg, y); });
      produced.push_back(mine);
      if (rank == 0) tokens = mine;
    }
  } catch (const c10::DistBackendError& e) {
    std::printf("rank %d: DistBackendError: %s\n", rank, e.what_without_backtrace());
    return 2;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  int64_t shmCalls = 0;
  std::string routes;
  for (const auto& row : tpcomm::stats(pg)) {
    if (row.calls == 0) continue;
    routes += " " + row.route + "=" + std::to_string(row.calls);
    // One host: shared memory; several: shared memory inside each host.
    if (row.route == "cpu_shm" || row.route == "cpu_hier") shmCalls += int64_t(row.calls);
  }
  if (rank != 0) return 0;
  std::printf("tpcomm %s (torch %s): TP=%d, %lld steps x %lld tokens, %.1f tokens/s\n",
              tpcomm::version().c_str(), tpcomm::builtWithTorch().c_str(), world,
              (long long)c.steps, (long long)c.batch, c.steps * c.batch / seconds);
  std::printf("allreduces through shared memory on rank 0: %lld (calls per route:%s)\n",
              (long long)shmCalls, routes.c_str());
  std::printf("python in process: %s\n", example::pythonLoaded() ? "yes" : "no");

  // The same steps in one process, unsplit.
  const Model whole = makeModel(c, 0, 1);
  at::Tensor t = at::arange(c.batch, at::kLong).mul(7).remainder(c.vocab);
  int64_t same = 0;
  for (int64_t s = 0; s < c.steps; ++s) {
    t = step(whole, t, [](at::Tensor&) {});
    same += at::equal(t, produced[s]) ? 1 : 0;
  }
  std::printf("tokens equal to the single process: %s (%lld of %lld steps)\n",
              same == c.steps ? "yes" : "no", (long long)same, (long long)c.steps);
  std::printf("last tokens:");
  for (int64_t b = 0; b < c.batch; ++b) std::printf(" %lld", (long long)t[b].item<int64_t>());
  std::printf("\n");
  return same == c.steps ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const auto args = example::parseArgs(
      argc, argv,
      example::withLaunchArgs({{"steps", "32"}, {"vocab", "512"}, {"hidden", "256"}, {"ffn", "1024"},
       {"layers", "4"}, {"batch", "4"}, {"dtype", "float64"}, {"timeout-s", "60"},
       {"fault", "none"}, {"fault-rank", "-1"}, {"fault-step", "-1"}}));
  const int world = std::stoi(args.at("world-size"));
  const int rank = std::stoi(args.at("rank"));
  const std::string dtype = args.at("dtype");
  Config c{std::stoll(args.at("vocab")), std::stoll(args.at("hidden")),
           std::stoll(args.at("ffn")),   std::stoll(args.at("layers")),
           std::stoll(args.at("batch")), std::stoll(args.at("steps")),
           dtype == "float32" ? at::kFloat : at::kDouble};
  if (world < 1 || c.ffn % world != 0 || (dtype != "float32" && dtype != "float64")) {
    std::fprintf(stderr, "need --world-size >= 1 dividing --ffn, --dtype float32|float64\n");
    return 64;
  }
  if (rank < 0) return example::launchSelf(argc, argv, args, world, std::chrono::seconds(600));
  at::set_num_threads(1);
  return runRank(args, c, rank);
}
