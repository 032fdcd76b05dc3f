// The benchmark's harness around a peer's kernel: vLLM's custom allreduce
// (its csrc/custom_all_reduce.cuh and csrc/custom_collective_common.cuh,
// which the user names at run time; they are never part of tpcomm). It is
// compiled at run time by tpcomm.bench.peer_vllm and driven through ctypes,
// N ranks on N streams of one GPU, exactly as `bench car` drives tpcomm's
// kernel: vLLM's constructor takes raw Signal pointers and register_buffer()
// raw peer pointers, so one process can hold every rank.
//
// Every function returns 0 on success, else writes a message into `err`.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <vector>

#include "custom_all_reduce.cuh"

namespace {

void fail(char* err, int len, const char* what) {
  if (err != nullptr && len > 0) std::snprintf(err, static_cast<size_t>(len), "%s", what);
}

template <typename T, int N>
int residentBlocks(int twoStage) {
  int perSm = 0, device = 0, sms = 0;
  auto kernel =
      twoStage ? vllm::cross_device_reduce_2stage<T, N> : vllm::cross_device_reduce_1stage<T, N>;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&perSm, kernel, 512, 0) != cudaSuccess)
    return 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return perSm * sms;
}

template <typename T>
int residentFor(int world, int twoStage) {
  switch (world) {
    case 2:
      return residentBlocks<T, 2>(twoStage);
    case 4:
      return residentBlocks<T, 4>(twoStage);
    case 6:
      return residentBlocks<T, 6>(twoStage);
    case 8:
      return residentBlocks<T, 8>(twoStage);
  }
  return 0;
}

}  // namespace

extern "C" {

int vh_signal_bytes() { return static_cast<int>(sizeof(vllm::Signal)); }

// Blocks of the one-stage (twoStage 0) or two-stage kernel the current GPU
// holds at once (0: a world size vLLM does not build).
int vh_resident_blocks(int world, int dtype, int twoStage) {
  switch (dtype) {
    case 1:
      return residentFor<half>(world, twoStage);
    case 2:
      return residentFor<nv_bfloat16>(world, twoStage);
  }
  return residentFor<float>(world, twoStage);
}

// One rank: `signals` holds every rank's signal buffer (zeroed, each followed
// by vLLM's temporary buffer of the largest size), `rankData` device memory
// for the registered pointer tables.
void* vh_create(void** signals, void* rankData, size_t rankDataBytes, int rank, int world,
                char* err, int len) {
  try {
    return new vllm::CustomAllreduce(reinterpret_cast<vllm::Signal**>(signals), rankData,
                                     rankDataBytes, rank, world, true);
  } catch (const std::exception& e) {
    fail(err, len, e.what());
    return nullptr;
  }
}

void vh_destroy(void* handle) { delete static_cast<vllm::CustomAllreduce*>(handle); }

// register_buffer(): `ptrs` holds every rank's pointer of one buffer.
int vh_register(void* handle, void** ptrs, char* err, int len) {
  try {
    static_cast<vllm::CustomAllreduce*>(handle)->register_buffer(ptrs);
    return 0;
  } catch (const std::exception& e) {
    fail(err, len, e.what());
    return 1;
  }
}

// allreduce<T>() of `count` elements (dtype 0 float32, 1 float16, 2
// bfloat16) on `stream`; the input must be registered, or the stream
// capturing (vLLM's graph mode).
int vh_allreduce(void* handle, int dtype, void* stream, void* in, void* out, int count,
                 int blockLimit, char* err, int len) {
  auto* car = static_cast<vllm::CustomAllreduce*>(handle);
  auto s = static_cast<cudaStream_t>(stream);
  try {
    switch (dtype) {
      case 1:
        car->allreduce<half>(s, static_cast<half*>(in), static_cast<half*>(out), count, 512,
                             blockLimit);
        break;
      case 2:
        car->allreduce<nv_bfloat16>(s, static_cast<nv_bfloat16*>(in),
                                    static_cast<nv_bfloat16*>(out), count, 512, blockLimit);
        break;
      default:
        car->allreduce<float>(s, static_cast<float*>(in), static_cast<float*>(out), count, 512,
                              blockLimit);
    }
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
      fail(err, len, cudaGetErrorString(e));
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    fail(err, len, e.what());
    return 1;
  }
}

// What vLLM's register_graph_buffers() does after a capture, with the peers'
// pointers taken from the other ranks' handles of this process instead of
// IPC handles: buffer i of every rank's capture list becomes one table entry.
int vh_register_graph_local(void** handles, int world, char* err, int len) {
  std::vector<vllm::CustomAllreduce*> cars;
  for (int r = 0; r < world; ++r) cars.push_back(static_cast<vllm::CustomAllreduce*>(handles[r]));
  const size_t count = cars[0]->graph_unreg_buffers_.size();
  for (auto* c : cars) {
    if (c->graph_unreg_buffers_.size() != count) {
      fail(err, len, "ranks captured different numbers of calls");
      return 1;
    }
  }
  try {
    for (int r = 0; r < world; ++r) {
      cars[r]->check_rank_data_capacity(count);
      std::vector<vllm::RankData> data(count);
      for (size_t i = 0; i < count; ++i) {
        for (int j = 0; j < world; ++j) data[i].ptrs[j] = cars[j]->graph_unreg_buffers_[i];
      }
      if (cudaMemcpy(cars[r]->d_rank_data_base_, data.data(), sizeof(vllm::RankData) * count,
                     cudaMemcpyHostToDevice) != cudaSuccess) {
        fail(err, len, "cudaMemcpy of the rank data failed");
        return 1;
      }
    }
    for (auto* c : cars) {
      c->d_rank_data_base_ += count;
      c->graph_unreg_buffers_.clear();
    }
    return 0;
  } catch (const std::exception& e) {
    fail(err, len, e.what());
    return 1;
  }
}

}  // extern "C"
