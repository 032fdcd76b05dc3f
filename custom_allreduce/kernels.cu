// The one place where the kernels are instantiated: dtype x world size x
// algorithm, and the launch that picks one.
#include "custom_allreduce/cuda_check.hpp"
#include "custom_allreduce/kernels.cuh"
#include "custom_allreduce/launch.hpp"

namespace tpcomm::car {

namespace {

using KernelFn = void (*)(KernelArgs);

template <typename T, int N>
KernelFn pick(Algorithm algorithm) {
  return algorithm == Algorithm::kOneShot ? oneShotKernel<T, N> : twoShotKernel<T, N>;
}

template <typename T>
KernelFn pickSize(Algorithm algorithm, int worldSize) {
  switch (worldSize) {
    case 2:
      return pick<T, 2>(algorithm);
    case 3:
      return pick<T, 3>(algorithm);
    case 4:
      return pick<T, 4>(algorithm);
    case 5:
      return pick<T, 5>(algorithm);
    case 6:
      return pick<T, 6>(algorithm);
    case 7:
      return pick<T, 7>(algorithm);
    case 8:
      return pick<T, 8>(algorithm);
  }
  TPCOMM_THROW(kInvalidUsage, "custom allreduce: world size ", worldSize, " is outside 2..",
               kMaxRanks);
}

}  // namespace

void launchAllreduce(const LaunchParams& p, cudaStream_t stream) {
  KernelArgs a{};
  a.input = p.input;
  a.output = p.output;
  a.count = p.count;
  for (int r = 0; r < p.worldSize; ++r) a.buffers[r] = static_cast<char*>(p.buffers[r]);
  a.registered = p.registered;
  a.stage = p.stage ? 1 : 0;
  a.scale = p.scale;
  a.stagingOffset = p.stagingOffset;
  a.resultOffset = p.resultOffset;
  a.rank = p.rank;
  a.timeoutNs = p.timeoutNs;
  a.error = p.errorDevice;
  KernelFn fn = nullptr;
  switch (p.dtype) {
    case DType::kFloat32:
      fn = pickSize<float>(p.algorithm, p.worldSize);
      break;
    case DType::kFloat16:
      fn = pickSize<__half>(p.algorithm, p.worldSize);
      break;
    case DType::kBFloat16:
      fn = pickSize<__nv_bfloat16>(p.algorithm, p.worldSize);
      break;
  }
  fn<<<p.blocks, kThreads, 0, stream>>>(a);
  TPCOMM_CUDA_CHECK(cudaGetLastError());
}

// A kernel that does nothing, for the benchmark's launch-overhead baseline.
__global__ void emptyKernel() {}

void launchEmptyKernel(cudaStream_t stream) {
  emptyKernel<<<1, 32, 0, stream>>>();
  TPCOMM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace tpcomm::car

namespace tpcomm::car {

namespace {

// One store through the peer pointer, as the allreduce kernels store flags.
__global__ void probeKernel(uint32_t* slot, uint32_t value) { storeRelease(slot, value); }

}  // namespace

void writeProbe(void* peerBuffer, int fromRank, uint32_t value, cudaStream_t stream) {
  TPCOMM_CHECK(fromRank >= 0 && fromRank < kMaxRanks, kInvalidUsage, "probe from rank ", fromRank);
  auto* signal = static_cast<Signal*>(peerBuffer);
  probeKernel<<<1, 1, 0, stream>>>(&signal->probe[fromRank].value, value);
  TPCOMM_CUDA_CHECK(cudaGetLastError());
  TPCOMM_CUDA_CHECK(stream == nullptr ? cudaDeviceSynchronize() : cudaStreamSynchronize(stream));
}

}  // namespace tpcomm::car
