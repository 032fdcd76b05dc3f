// The product's launches: the allreduce kernel dispatch.cuh picks, an empty
// kernel for the benchmark's baseline, and the set-up's write probe.
#include <atomic>

#include "custom_allreduce/cuda_check.hpp"
#include "custom_allreduce/dispatch.cuh"

namespace tpcomm::car {

namespace {

// Whether the current GPU has programmatic dependent launch (sm_90+),
// asked once per device.
bool currentGpuHasPdl() {
  static std::atomic<int> known[64];  // 0 unknown, 1 no, 2 yes
  int device = 0;
  TPCOMM_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= 64) return false;
  int state = known[device].load(std::memory_order_relaxed);
  if (state == 0) {
    int major = 0;
    TPCOMM_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    state = major >= 9 ? 2 : 1;
    known[device].store(state, std::memory_order_relaxed);
  }
  return state == 2;
}

}  // namespace

void launchAllreduce(const LaunchParams& p, cudaStream_t stream) {
  const KernelFn kernel = kernelFor(p);
  if (!p.pdl || !currentGpuHasPdl()) {
    kernel<<<p.blocks, kThreads, 0, stream>>>(kernelArgsOf(p));
    TPCOMM_CUDA_CHECK(cudaGetLastError());
    return;
  }
  // The kernel may be launched while the previous kernel on the stream
  // ends; it waits for it on the GPU (waitForPreviousGrid, signal.cuh).
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(p.blocks));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  TPCOMM_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, kernelArgsOf(p)));
}

int maxResidentBlocks(DType dtype, Algorithm algorithm, int worldSize, bool fused) {
  const KernelFn kernel = kernelFor(dtype, algorithm, worldSize, fused);
  int perSm = 0, device = 0, sms = 0;
  TPCOMM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &perSm, reinterpret_cast<const void*>(kernel), kThreads, 0));
  TPCOMM_CUDA_CHECK(cudaGetDevice(&device));
  TPCOMM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return perSm * sms;
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
