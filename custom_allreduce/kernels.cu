// The product's launches: the allreduce kernel dispatch.cuh picks, an empty
// kernel for the benchmark's baseline, and the set-up's write probe.
#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "custom_allreduce/cuda_check.hpp"
#include "custom_allreduce/dispatch.cuh"

namespace tpcomm::car {

namespace {

// What one kernel allows, asked of the current GPU once per kernel: whether
// its code waits for the previous grid (compiled for sm_90+: code JIT-built
// from older PTX has no griddepcontrol.wait, so it must never be launched
// early), and how many of its blocks the GPU holds at once.
struct KernelFacts {
  bool pdl = false;
  int resident = 0;
};

KernelFacts factsOf(KernelFn kernel) {
  static std::mutex mutex;
  static std::map<std::pair<KernelFn, int>, KernelFacts> known;
  int device = 0;
  TPCOMM_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find({kernel, device});
  if (it != known.end()) return it->second;
  cudaFuncAttributes attributes{};
  TPCOMM_CUDA_CHECK(cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(kernel)));
  int major = 0, perSm = 0, sms = 0;
  TPCOMM_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TPCOMM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &perSm, reinterpret_cast<const void*>(kernel), kThreads, 0));
  TPCOMM_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  KernelFacts facts;
  facts.pdl = major >= 9 && attributes.ptxVersion >= 90;
  facts.resident = perSm * sms;
  known.emplace(std::make_pair(kernel, device), facts);
  return facts;
}

}  // namespace

void launchAllreduce(const LaunchParams& p, cudaStream_t stream) {
  const KernelFn kernel = kernelFor(p);
  const KernelFacts facts = factsOf(kernel);
  const bool pdl = p.pdl && facts.pdl;
  int blocks = p.blocks;
  if (p.sharedGpu) {
    // Every rank's blocks wait for each other on this GPU (and with PDL a
    // rank's next kernel may already hold its blocks): all must fit.
    const int fit = facts.resident / (p.worldSize * (pdl ? 2 : 1));
    blocks = std::clamp(blocks, 1, std::max(1, fit));
  }
  if (!pdl) {
    kernel<<<blocks, kThreads, 0, stream>>>(kernelArgsOf(p));
    TPCOMM_CUDA_CHECK(cudaGetLastError());
    return;
  }
  // The kernel may be launched while the previous kernel on the stream
  // ends; it waits for it on the GPU (waitForPreviousGrid, signal.cuh).
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  TPCOMM_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, kernelArgsOf(p)));
}

int maxResidentBlocks(DType dtype, Algorithm algorithm, int worldSize, bool fused) {
  return factsOf(kernelFor(dtype, algorithm, worldSize, fused)).resident;
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
