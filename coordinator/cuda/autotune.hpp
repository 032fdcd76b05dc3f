#pragma once
// TPCOMM_AUTOTUNE=1: the crossovers of the CUDA allreduce routing table
// measured on this machine when a group sets up its custom kernel, and
// cached per machine and world size so that later groups and runs skip the
// measurement.
//
// What is measured (by the coordinator, collectively): for sizes from 4 KiB
// doubling up to the custom maximum, the time of one-shot, two-shot and,
// where the group's ranks are on distinct GPUs (NCCL refuses ranks sharing
// one), NCCL. Every rank measures; the slowest rank's time counts, so every
// rank derives the same table. This file holds the parts that need no GPU:
// choosing crossovers from timings, and the cache.
//
// Cache file (text, one key=value per line, '#' comments):
//   oneshot_max_bytes=524288
//   custom_max_bytes=8388608
// at <TPCOMM_AUTOTUNE_DIR>/<key>.txt, where the key names the host, the GPU
// model, the world size and the custom maximum. Only rank 0 reads and writes
// it; the others take rank 0's values.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tpcomm::coord {

struct TunedRoutes {
  int64_t oneShotMaxBytes = 0;  // one-shot up to here
  int64_t customMaxBytes = 0;   // two-shot up to here, NCCL above
};

struct RouteTimings {
  std::vector<int64_t> sizes;  // ascending
  std::vector<double> oneShotUs;
  std::vector<double> twoShotUs;
  std::vector<double> ncclUs;  // empty: not measured
};

// One-shot up to the last size before two-shot is first faster by more than
// `margin` (a fraction); the custom kernel up to the last size before NCCL
// is first faster than the better custom algorithm by more than `margin`.
// Without NCCL timings the custom kernel keeps `maxBytes`.
TunedRoutes chooseCrossovers(const RouteTimings& timings, int64_t maxBytes, double margin = 0.03);

// File-name-safe key: "<host>-<gpu model>-ws<N>-max<bytes>".
std::string autotuneKey(const std::string& host, const std::string& gpuModel, int worldSize,
                        int64_t maxBytes);
// <dir>/<key>.txt; dir from TPCOMM_AUTOTUNE_DIR, else $XDG_CACHE_HOME/tpcomm,
// else $HOME/.cache/tpcomm.
std::string autotunePath(const std::string& key);

std::string formatTuned(const TunedRoutes& tuned, const RouteTimings& timings);
// Nullopt for a missing, unreadable or malformed file (then it is measured
// again and rewritten).
std::optional<TunedRoutes> parseTuned(const std::string& text, int64_t maxBytes);
std::optional<TunedRoutes> readTuned(const std::string& path, int64_t maxBytes);
// Atomic (write to a temporary, rename); creates the directory. Returns an
// error text, empty on success (a cache that cannot be written is no error).
std::string writeTuned(const std::string& path, const std::string& text);

}  // namespace tpcomm::coord
