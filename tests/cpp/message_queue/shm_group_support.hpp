#pragma once
// What the forked-process tests of the shared-memory collectives share
// (test_shm_group.cpp, test_shm_group_places.cpp,
// test_shm_group_lifecycle.cpp): a group of forked ranks over one fresh
// region, deterministic inputs, the rank-order reference, a check that makes
// a child exit non-zero, and a rank held back at random points.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <csignal>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "message_queue/collectives/shm_group.hpp"

namespace tpcomm::mq {

// Runs body(group) in `size` forked processes over one fresh region; returns
// each child's exit status (0: every check passed).
inline std::vector<int> runRanks(int size, const ShmGroupOptions& base,
                                 const std::function<int(ShmGroup&)>& body,
                                 const std::function<void(std::vector<pid_t>&)>& meanwhile = {}) {
  const size_t bytes = ShmGroup::regionBytes(size, base.bufferBytes);
  auto region = SharedRegion::create(bytes);
  ShmGroup::initRegion(region->base(), size, base.bufferBytes, base.twoPhaseMinBytes);
  const pid_t parent = ::getpid();
  std::vector<pid_t> pids(size);
  for (int r = 0; r < size; ++r) {
    pids[r] = ::fork();
    if (pids[r] == 0) {
      int status = 90;
      try {
        ShmGroupOptions options = base;
        options.rank = r;
        options.size = size;
        auto mine = SharedRegion::attach(parent, region->fd(), bytes, region->nonce());  // /proc
        std::vector<int32_t> ids;
        // A child knows the pids forked before it; later ones count as alive.
        for (int k = 0; k < size; ++k) ids.push_back(k < r ? pids[k] : 0);
        ShmGroup group(std::move(mine), options, ids);
        status = body(group);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        status = 91;
      }
      ::_exit(status);
    }
  }
  if (meanwhile) meanwhile(pids);
  std::vector<int> codes;
  for (pid_t p : pids) {
    int status = 0;
    ::waitpid(p, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  return codes;
}

inline size_t sizeOf(DType d) { return dtypeBytes(d); }

// Rank r's input element i, stored in dtype d.
inline void makeInput(DType d, int r, size_t count, std::vector<char>& out, bool small) {
  out.assign(count * sizeOf(d), 0);
  for (size_t i = 0; i < count; ++i) {
    const int64_t raw = static_cast<int64_t>((r * 7919 + i * 104729 + 13) % 2001) - 1000;
    const double v = small ? static_cast<double>(raw % 3 + (raw % 3 == 0 ? 2 : 0)) : raw / 64.0;
    char* p = out.data() + i * sizeOf(d);
    switch (d) {
      case DType::kFloat32: {
        const float f = static_cast<float>(v);
        std::memcpy(p, &f, 4);
        break;
      }
      case DType::kFloat64:
        std::memcpy(p, &v, 8);
        break;
      case DType::kBFloat16: {
        const uint16_t h = floatToBf16(static_cast<float>(v));
        std::memcpy(p, &h, 2);
        break;
      }
      case DType::kFloat16: {
        const uint16_t h = floatToFp16(static_cast<float>(v));
        std::memcpy(p, &h, 2);
        break;
      }
      case DType::kInt32: {
        const int32_t x = static_cast<int32_t>(raw);
        std::memcpy(p, &x, 4);
        break;
      }
      case DType::kInt64: {
        const int64_t x = raw * 1000003;
        std::memcpy(p, &x, 8);
        break;
      }
    }
  }
}

inline double loadAsDouble(DType d, const char* p) {
  switch (d) {
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kFloat64: {
      double v;
      std::memcpy(&v, p, 8);
      return v;
    }
    case DType::kBFloat16:
    case DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return d == DType::kBFloat16 ? bf16ToFloat(h) : fp16ToFloat(h);
    }
    case DType::kInt32: {
      int32_t x;
      std::memcpy(&x, p, 4);
      return x;
    }
    case DType::kInt64: {
      int64_t x;
      std::memcpy(&x, p, 8);
      return static_cast<double>(x);
    }
  }
  return 0;
}

// The promised result, written independently of shm_reduce.cpp's loops:
// rank-order accumulation in float (16-bit and float32), double (float64)
// or wrapping integers, one rounding at the end.
inline void reference(DType d, const ReduceSpec& spec, int size, size_t count, bool small,
                      std::vector<char>& out, std::vector<double>& exact) {
  std::vector<std::vector<char>> in(size);
  for (int r = 0; r < size; ++r) {
    makeInput(d, r, count, in[r], small);
    if (spec.premultiply) copyScaled(in[r].data(), in[r].data(), count, d, spec);
  }
  out.assign(count * sizeOf(d), 0);
  exact.assign(count, 0);
  const bool integral = d == DType::kInt32 || d == DType::kInt64;
  for (size_t i = 0; i < count; ++i) {
    const size_t at = i * sizeOf(d);
    if (integral) {
      int64_t acc = 0;
      uint64_t uacc = 0;
      for (int r = 0; r < size; ++r) {
        int64_t x;
        if (d == DType::kInt32) {
          int32_t y;
          std::memcpy(&y, in[r].data() + at, 4);
          x = y;
        } else {
          std::memcpy(&x, in[r].data() + at, 8);
        }
        const uint64_t ux = static_cast<uint64_t>(x);
        if (r == 0) {
          uacc = ux;
          acc = x;
          continue;
        }
        switch (spec.kind) {
          case ReduceKind::kSum:
            uacc += ux;
            break;
          case ReduceKind::kProduct:
            uacc *= ux;
            break;
          case ReduceKind::kMin:
            acc = std::min(acc, x);
            break;
          case ReduceKind::kMax:
            acc = std::max(acc, x);
            break;
        }
      }
      int64_t v =
          (spec.kind == ReduceKind::kSum || spec.kind == ReduceKind::kProduct)
              ? (d == DType::kInt32 ? static_cast<int32_t>(uacc) : static_cast<int64_t>(uacc))
              : acc;
      if (spec.divisor != 1) v /= spec.divisor;
      if (d == DType::kInt32) {
        const int32_t y = static_cast<int32_t>(v);
        std::memcpy(out.data() + at, &y, 4);
      } else {
        std::memcpy(out.data() + at, &v, 8);
      }
      exact[i] = static_cast<double>(v);
      continue;
    }
    double accD = 0, ex = 0;
    float accF = 0;
    for (int r = 0; r < size; ++r) {
      const double x = loadAsDouble(d, in[r].data() + at);
      const float xf = static_cast<float>(x);
      if (r == 0) {
        accD = x, accF = xf, ex = x;
        continue;
      }
      switch (spec.kind) {
        case ReduceKind::kSum:
          accD += x, accF += xf, ex += x;
          break;
        case ReduceKind::kProduct:
          accD *= x, accF *= xf, ex *= x;
          break;
        case ReduceKind::kMin:
          accD = std::min(accD, x), accF = std::min(accF, xf), ex = std::min(ex, x);
          break;
        case ReduceKind::kMax:
          accD = std::max(accD, x), accF = std::max(accF, xf), ex = std::max(ex, x);
          break;
      }
    }
    if (spec.divisor != 1) accD /= spec.divisor, accF /= spec.divisor, ex /= spec.divisor;
    exact[i] = ex;
    char* p = out.data() + at;
    if (d == DType::kFloat64) {
      std::memcpy(p, &accD, 8);
    } else if (d == DType::kFloat32) {
      std::memcpy(p, &accF, 4);
    } else {
      const uint16_t h = d == DType::kBFloat16 ? floatToBf16(accF) : floatToFp16(accF);
      std::memcpy(p, &h, 2);
    }
  }
}

#define CHILD_CHECK(cond, ...)                \
  do {                                        \
    if (!(cond)) {                            \
      std::fprintf(stderr, __VA_ARGS__);      \
      std::fprintf(stderr, " [%s]\n", #cond); \
      return 1;                               \
    }                                         \
  } while (0)

// runRanks' `meanwhile`: rank 1 of three stopped for 0-2 ms every 0-2 ms
// until every rank ended (reaped after).
inline void holdingRankOneBack(std::vector<pid_t>& pids) {
  std::atomic<bool> running{true};
  std::thread stopper([&] {
    unsigned seed = 7;
    while (running.load()) {
      seed = seed * 1103515245u + 12345u;
      std::this_thread::sleep_for(std::chrono::microseconds(seed % 2000));
      ::kill(pids[1], SIGSTOP);
      std::this_thread::sleep_for(std::chrono::microseconds((seed >> 11) % 2000));
      ::kill(pids[1], SIGCONT);
    }
  });
  for (pid_t p : {pids[0], pids[2], pids[1]}) {
    ::siginfo_t info;
    ::waitid(P_PID, p, &info, WEXITED | WNOWAIT);
  }
  running = false;
  stopper.join();
  ::kill(pids[1], SIGCONT);
}

inline ShmGroupOptions smallBuffers(uint64_t twoPhase) {
  ShmGroupOptions o;
  o.bufferBytes = 256;  // every op spans many chunks
  o.twoPhaseMinBytes = twoPhase;
  o.timeout = std::chrono::seconds(60);
  return o;
}

}  // namespace tpcomm::mq
