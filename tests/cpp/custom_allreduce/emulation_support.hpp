#pragma once
// What the kernel emulation tests share (test_kernel_emulation.cpp,
// test_fused_emulation.cpp, one executable): the launch order check, the
// dtype conversions and tolerances, the shared-memory arena the ranks fork
// over, and the forking. The emulation's launchAllreduce is defined once, in
// test_kernel_emulation.cpp.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "custom_allreduce/dispatch.cuh"

namespace tpcomm::car {

// The product's launch as the emulation runs it: the host API
// (CustomAllreduce::allreduce in host.cpp) ends here, with dispatch.cuh's
// kernel choice and argument mapping, as kernels.cu launches on a GPU.
// Fewer threads per block than on the GPU keep the emulation quick; the
// kernels' loops stride by whatever blockDim is.
//
// The host API brackets every launch with its LaunchOrder; CheckedOrder (the
// order the emulation's host-API calls use) checks that it does, on the
// launch's own stream: before(s), the launch, after(s), nothing else between.
enum class OrderState { kIdle, kBefore, kLaunched };
inline OrderState orderState = OrderState::kIdle;
inline cudaStream_t orderStream = nullptr;
inline uint64_t orderedLaunches = 0;

[[noreturn]] inline void orderViolation(const char* what) {
  std::fprintf(stderr, "launch order: %s\n", what);
  _exit(8);
}

class CheckedOrder : public LaunchOrder {
 public:
  void synchronize() override {}  // emulated launches end before they return
  void before(cudaStream_t stream) override {
    if (orderState != OrderState::kIdle) orderViolation("before() inside another launch");
    orderState = OrderState::kBefore;
    orderStream = stream;
  }
  void after(cudaStream_t stream) override {
    if (orderState != OrderState::kLaunched) orderViolation("after() without a launch");
    if (stream != orderStream) orderViolation("after() on another stream than before()");
    orderState = OrderState::kIdle;
    ++orderedLaunches;
  }
};

// Element i of a tensor of `dtype` as float, and a float stored as `dtype`.
inline float load(DType dtype, const void* p, size_t i) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(p)[i];
    case DType::kFloat16:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
}

inline void store(DType dtype, void* p, size_t i, float v) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(p)[i] = v;
      break;
    case DType::kFloat16:
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      break;
    default:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  }
}

// Half the spacing of `dtype`'s values near 1.
inline double roundingOf(DType dtype) {
  return dtype == DType::kFloat32 ? std::ldexp(1.0, -24)
                                  : std::ldexp(1.0, dtype == DType::kFloat16 ? -11 : -8);
}

// The spacing of `dtype`'s subnormals (float16's are coarse: 2^-24).
inline double subnormalOf(DType dtype) {
  return std::ldexp(1.0, dtype == DType::kFloat16 ? -24 : dtype == DType::kFloat32 ? -149 : -133);
}

// Runs `body(rank)` in a child process per rank of `ranks`, all at once.
// False when a child could not start or did not exit cleanly within
// `deadlineS` (it is killed then).
template <typename Body>
bool forkRanks(const std::vector<int>& ranks, int deadlineS, Body&& body) {
  std::vector<pid_t> pids;
  bool ok = true;
  for (int rank : ranks) {
    const pid_t pid = fork();
    if (pid == 0) {
      body(rank);
      _exit(0);
    }
    if (pid < 0) {
      ok = false;  // the started ranks are still waited for (or killed) below
      break;
    }
    pids.push_back(pid);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(deadlineS);
  for (pid_t pid : pids) {
    int status = 0;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        ok = false;
        break;
      }
      usleep(2000);
    }
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return ok;
}

// Shared memory mapped before the ranks fork.
class Arena {
 public:
  explicit Arena(size_t bytes) : size_(bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap failed");
    base_ = static_cast<char*>(p);  // zero-filled
  }
  ~Arena() { munmap(base_, size_); }
  void* take(size_t bytes) {
    used_ = (used_ + 255) / 256 * 256;
    if (used_ + bytes > size_) throw std::runtime_error("arena too small");
    void* p = base_ + used_;
    used_ += bytes;
    return p;
  }

 private:
  char* base_ = nullptr;
  size_t size_ = 0;
  size_t used_ = 0;
};

}  // namespace tpcomm::car
