// Bindings of the custom peer-to-peer allreduce (tpcomm::car): rank buffers,
// one rank's launcher, IPC handles, and the host-only planning functions.
// Errors map as in register_message_queue.cpp (Timeout -> TimeoutError,
// PeerLost -> PeerLostError, InvalidUsage -> ValueError).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>

#include "common/error.hpp"
#include "common/settings.hpp"
#include "coordinator/cuda/custom_path.hpp"
#include "coordinator/cuda/custom_setup.hpp"
#include "custom_allreduce/custom_allreduce.hpp"

namespace py = pybind11;

namespace tpcomm::python {

namespace {

car::Algorithm toAlgorithm(const std::string& name) {
  if (name == "oneshot" || name == "one-shot") return car::Algorithm::kOneShot;
  if (name == "twoshot" || name == "two-shot") return car::Algorithm::kTwoShot;
  if (name == "push") return car::Algorithm::kPush;
  TPCOMM_THROW(kInvalidUsage, "custom allreduce: algorithm '", name,
               "' is not one of push, oneshot, twoshot");
}

// One rank: its own buffer (kept alive here) and its view of every peer's.
class Rank {
 public:
  Rank(int rank, int worldSize, std::shared_ptr<car::RankBuffer> own,
       const std::vector<uintptr_t>& buffers, double timeoutMs)
      : keep_(own),
        ownBase_(own->base()),
        device_(own->device()),
        impl_(rank, worldSize, toPointers(buffers), own->layout().maxBytes,
              std::chrono::milliseconds(static_cast<int64_t>(timeoutMs)), own->errorHost(),
              own->errorDevice()) {
    TPCOMM_CHECK(reinterpret_cast<uintptr_t>(ownBase_) == buffers.at(rank), kInvalidUsage,
                 "custom allreduce: buffers[", rank, "] is not this rank's own buffer");
    // Ranks of one process sharing buffers directly (LocalGroup): the GPUs
    // are those of the buffers.
    impl_.configureFor(devicesOf(buffers));
  }

  // A rank of a group the shared set-up made (coordinator/cuda/custom_setup.hpp):
  // `gpu` owns this rank's buffer and the peers' mappings.
  Rank(int rank, int worldSize, int device, std::shared_ptr<coord::CustomDevice> gpu,
       const std::vector<void*>& bases, size_t maxBytes, double timeoutMs)
      : keep_(gpu),
        ownBase_(gpu->ownBase()),
        device_(device),
        impl_(rank, worldSize, bases, maxBytes,
              std::chrono::milliseconds(static_cast<int64_t>(timeoutMs)), gpu->errorHost(),
              gpu->errorDevice()) {}

  // out = sum of every rank's `input`, enqueued on `stream` (default: the
  // current stream of the input's device).
  // `registered` nonzero: zero-copy, the device address of a RegisteredInputs
  // table naming every rank's input (filled, ready set); this rank's input is
  // then read where it lies, not staged.
  void allReduce(const at::Tensor& input, at::Tensor& output, const std::string& algorithm,
                 int blocks, std::optional<int64_t> stream, uintptr_t registered) {
    TPCOMM_CHECK(input.is_cuda() && output.is_cuda(), kInvalidUsage,
                 "custom allreduce: tensors must be CUDA tensors");
    TPCOMM_CHECK(input.device() == output.device(), kInvalidUsage,
                 "custom allreduce: input and output are on different devices");
    TPCOMM_CHECK(input.is_contiguous() && output.is_contiguous(), kInvalidUsage,
                 "custom allreduce: tensors must be contiguous");
    TPCOMM_CHECK(input.scalar_type() == output.scalar_type() && input.numel() == output.numel(),
                 kInvalidUsage, "custom allreduce: output must match the input's dtype and size");
    TPCOMM_CHECK(input.device().index() == device_, kInvalidUsage, "custom allreduce: a tensor on ",
                 input.device(), ", but this rank's buffer is on cuda:", device_);
    const car::DType dtype = coord::carDType(input.scalar_type());
    c10::cuda::CUDAGuard guard(input.device());  // the launch goes to the tensors' GPU
    cudaStream_t s = stream ? reinterpret_cast<cudaStream_t>(*stream)
                            : c10::cuda::getCurrentCUDAStream(input.device().index()).stream();
    const size_t count = static_cast<size_t>(input.numel());
    car::CallOptions options;
    options.chooseAlgorithm = algorithm.empty();
    if (!algorithm.empty()) options.algorithm = toAlgorithm(algorithm);
    options.blocks = blocks;
    if (registered != 0) {
      // One-shot peers read this rank's input while it writes its output.
      TPCOMM_CHECK(
          !car::rangesOverlap(input.data_ptr(), output.data_ptr(), count * car::dtypeSize(dtype)),
          kInvalidUsage, "custom allreduce: zero-copy needs an output apart from the input");
      options.registered = reinterpret_cast<const car::RegisteredInputs*>(registered);
      options.stageInput = false;
    }
    impl_.allreduce(input.data_ptr(), output.data_ptr(), count, dtype, s, options);
  }

  // The fused allreduce + residual add + RMSNorm (normed and residualOut
  // written), enqueued like allReduce.
  void allReduceAddRmsNorm(const at::Tensor& input, const at::Tensor& residual,
                           const at::Tensor& weight, double eps, at::Tensor& normed,
                           at::Tensor& residualOut, const std::string& algorithm, int blocks,
                           std::optional<int64_t> stream) {
    for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&input, &residual, &weight,
                                                                        &normed, &residualOut}) {
      TPCOMM_CHECK(t->is_cuda() && t->is_contiguous() && t->device() == input.device() &&
                       t->scalar_type() == input.scalar_type(),
                   kInvalidUsage,
                   "custom allreduce + RMSNorm: tensors must be contiguous CUDA tensors of one "
                   "device and dtype");
    }
    TPCOMM_CHECK(input.dim() >= 1 && weight.numel() == input.size(-1) &&
                     residual.sizes() == input.sizes() && normed.sizes() == input.sizes() &&
                     residualOut.sizes() == input.sizes(),
                 kInvalidUsage, "custom allreduce + RMSNorm: shapes differ");
    TPCOMM_CHECK(input.device().index() == device_, kInvalidUsage, "custom allreduce: a tensor on ",
                 input.device(), ", but this rank's buffer is on cuda:", device_);
    c10::cuda::CUDAGuard guard(input.device());
    cudaStream_t s = stream ? reinterpret_cast<cudaStream_t>(*stream)
                            : c10::cuda::getCurrentCUDAStream(input.device().index()).stream();
    car::CallOptions options;
    options.chooseAlgorithm = algorithm.empty();
    if (!algorithm.empty()) options.algorithm = toAlgorithm(algorithm);
    options.blocks = blocks;
    car::CustomAllreduce::AddRmsNorm norm;
    norm.residual = residual.data_ptr();
    norm.residualOut = residualOut.data_ptr();
    norm.weight = weight.data_ptr();
    norm.normed = normed.data_ptr();
    norm.hidden = static_cast<size_t>(weight.numel());
    norm.rows = norm.hidden == 0 ? 0 : static_cast<size_t>(input.numel()) / norm.hidden;
    norm.eps = static_cast<float>(eps);
    impl_.allreduceAddRmsNorm(input.data_ptr(), norm, coord::carDType(input.scalar_type()), s,
                              options);
  }

  car::CustomAllreduce& impl() { return impl_; }
  void* ownBase() const { return ownBase_; }
  int device() const { return device_; }

 private:
  // The GPU each buffer lives on (-1 where the driver does not say).
  static std::vector<int> devicesOf(const std::vector<uintptr_t>& buffers) {
    std::vector<int> out;
    for (uintptr_t p : buffers) {
      cudaPointerAttributes attributes{};
      if (cudaPointerGetAttributes(&attributes, reinterpret_cast<void*>(p)) != cudaSuccess) {
        cudaGetLastError();
        out.push_back(-1 - static_cast<int>(out.size()));  // unknown: never "the same GPU"
        continue;
      }
      out.push_back(attributes.device);
    }
    return out;
  }

  static std::vector<void*> toPointers(const std::vector<uintptr_t>& in) {
    std::vector<void*> out;
    for (uintptr_t p : in) out.push_back(reinterpret_cast<void*>(p));
    return out;
  }

  std::shared_ptr<void> keep_;  // this rank's buffer (and the peers' mappings)
  void* ownBase_;
  int device_;  // the GPU of this rank's buffer
  car::CustomAllreduce impl_;
};

py::tuple eligibilityTuple(const car::Eligibility& e) {
  return py::make_tuple(e.eligible, e.reason);
}

}  // namespace

void registerCustomAllreduce(py::module_& m) {
  py::class_<car::RankBuffer, std::shared_ptr<car::RankBuffer>>(
      m, "CarBuffer", "One rank's custom-allreduce buffer on the current CUDA device.")
      .def(py::init<size_t>(), py::arg("max_bytes"))
      .def_property_readonly(
          "base", [](const car::RankBuffer& b) { return reinterpret_cast<uintptr_t>(b.base()); })
      .def_property_readonly("device", &car::RankBuffer::device)
      .def("ipc_handle", [](const car::RankBuffer& b) { return py::bytes(b.ipcHandle()); });

  py::class_<Rank>(m, "CarRank", "One rank of a custom-allreduce group.")
      .def(py::init<int, int, std::shared_ptr<car::RankBuffer>, const std::vector<uintptr_t>&,
                    double>(),
           py::arg("rank"), py::arg("world_size"), py::arg("buffer"), py::arg("buffers"),
           py::arg("timeout_ms"))
      .def("all_reduce", &Rank::allReduce, py::arg("input"), py::arg("output"),
           py::arg("algorithm") = "", py::arg("blocks") = 0, py::arg("stream") = py::none(),
           py::arg("registered") = 0,
           "Enqueues output = sum of every rank's input (algorithm '' chooses by size); "
           "`registered`: the device address of a zero-copy table of every rank's input "
           "(zero-copy or not must be the same on every rank of a call).")
      .def("all_reduce_add_rms_norm", &Rank::allReduceAddRmsNorm, py::arg("input"),
           py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("normed"),
           py::arg("residual_out"), py::arg("algorithm") = "", py::arg("blocks") = 0,
           py::arg("stream") = py::none(),
           "Enqueues residual_out = sum of every rank's input + residual and normed = "
           "RMSNorm(residual_out) x weight (the fused kernel).")
      .def(
          "barrier_only",
          [](Rank& r, int blocks, int64_t stream) {
            const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(r.device()));
            r.impl().barrierOnly(reinterpret_cast<cudaStream_t>(stream), blocks);
          },
          py::arg("blocks"), py::arg("stream"),
          "Enqueues a call that moves no data: the start barrier alone (the benchmark's flag "
          "round trip).")
      .def_property_readonly("device_scope", [](Rank& r) { return r.impl().deviceScope(); })
      .def_property(
          "capture_events", [](Rank& r) { return r.impl().captureEvents(); },
          [](Rank& r, bool events) { r.impl().setCaptureEvents(events); },
          "Whether captured calls carry external event nodes (TPCOMM_CAR_GRAPH_ORDER=event): "
          "replays then also order against this rank's calls on other streams.")
      .def_property(
          "pdl", [](Rank& r) { return r.impl().pdl(); },
          [](Rank& r, bool pdl) { r.impl().setPdl(pdl); },
          "Programmatic dependent launch of this rank's kernels (TPCOMM_CAR_PDL; used where "
          "the GPU has it, sm_90+).")
      .def("check_error", [](Rank& r) { r.impl().checkError(); })
      .def_property_readonly("error_code", [](Rank& r) { return r.impl().errorCode(); })
      .def("clear_error", [](Rank& r) { r.impl().clearError(); })
      .def(
          "reset",
          [](Rank& r, const py::function& barrier) {
            car::CustomAllreduce::ResetOps ops;
            ops.synchronize = [&r] { r.impl().waitForLaunches(); };
            ops.barrier = [&barrier] {
              py::gil_scoped_acquire acquire;
              barrier();
            };
            ops.zeroSignals = [&r](void* buffer) {
              const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(r.device()));
              car::resetSignals(buffer, car::BufferLayout::forMaxBytes(r.impl().maxBytes()),
                                nullptr);
            };
            py::gil_scoped_release release;
            r.impl().reset(ops);
          },
          py::arg("barrier"),
          "The collective reset after a failure (every rank calls it): synchronises the "
          "device, barrier(), zeroes this rank's flags, poison and epochs and its error word, "
          "barrier().");

  m.def(
      "car_set_up",
      [](const c10::intrusive_ptr<c10d::Backend>& cpu, int rank, int worldSize, int device,
         size_t maxBytes, double timeoutMs) -> py::tuple {
        std::shared_ptr<coord::CustomDevice> gpu = coord::makeCudaDevice(device);
        coord::CustomSetupResult result;
        {
          py::gil_scoped_release release;  // the exchange waits on the peers
          result = coord::setUpCustomAllreduce(
              *cpu, rank, worldSize, *gpu, hostIdentity(), maxBytes,
              {{"TPCOMM_CAR_BLOCKS", std::to_string(settings().carBlocks)},
               {"TPCOMM_CAR_FLAG_SCOPE", settings().carFlagScope},
               {"TPCOMM_CAR_PUSH_MAX_BYTES", std::to_string(settings().carPushMaxBytes)},
               {"TPCOMM_CAR_PDL", settings().carPdl}});
        }
        if (!result.available) return py::make_tuple(false, result.reason, py::none());
        auto made =
            std::make_unique<Rank>(rank, worldSize, device, gpu, result.bases, maxBytes, timeoutMs);
        made->impl().configureFor(result.devices);
        return py::make_tuple(true, "", py::cast(std::move(made)));
      },
      py::arg("cpu_backend"), py::arg("rank"), py::arg("world_size"), py::arg("device"),
      py::arg("max_bytes"), py::arg("timeout_ms"),
      "The set-up the backend uses (coordinator/cuda/custom_setup.hpp) over `cpu_backend`: "
      "(eligible, reason, CarRank or None), the same verdict on every rank.");
  m.def(
      "car_group_eligibility",
      [](const std::vector<std::string>& hostIds, const std::vector<int>& devices,
         const std::vector<std::string>& access, const std::vector<std::string>& links,
         bool probeSucceeded, const std::string& probeDetail) {
        car::Topology t;
        t.hostIds = hostIds;
        t.devices = devices;
        t.access = access;
        t.links = links;
        t.probeSucceeded = probeSucceeded;
        t.probeDetail = probeDetail;
        return eligibilityTuple(car::groupEligibility(t));
      },
      py::arg("host_ids"), py::arg("devices"), py::arg("access"), py::arg("links"),
      py::arg("probe_succeeded"), py::arg("probe_detail") = "",
      "(eligible, reason) of a group from what its ranks reported.");
  m.def(
      "car_call_eligibility",
      [](const std::string& dtype, size_t bytes, uintptr_t input, uintptr_t output,
         size_t maxBytes) {
        return eligibilityTuple(car::callEligibility(dtype, bytes, input, output, maxBytes));
      },
      "(eligible, reason) of one call.");
  m.def(
      "car_choose_algorithm",
      [](int worldSize, size_t bytes, size_t maxBytes) {
        switch (car::chooseAlgorithm(worldSize, bytes, maxBytes, settings().carPushMaxBytes)) {
          case car::Algorithm::kPush:
            return "push";
          case car::Algorithm::kOneShot:
            return "oneshot";
          case car::Algorithm::kTwoShot:
            break;
        }
        return "twoshot";
      },
      "The algorithm the kernel uses for a size by default (TPCOMM_CAR_PUSH_MAX_BYTES "
      "applied).");
  m.def(
      "car_push_limit",
      [](int worldSize, size_t maxBytes) {
        return car::pushLimit(worldSize, maxBytes, settings().carPushMaxBytes);
      },
      "The largest call made as a push by default (TPCOMM_CAR_PUSH_MAX_BYTES applied).");
  m.def(
      "car_push_slot_bytes",
      [](size_t maxBytes) { return car::BufferLayout::forMaxBytes(maxBytes).pushSlotBytes; },
      "The largest push a group of this maximum can make (its push slot).");
  m.def(
      "car_choose_blocks",
      [](const std::string& algorithm, int worldSize, size_t bytes, int override) {
        return car::chooseBlocks(toAlgorithm(algorithm), worldSize, bytes, override);
      },
      "Thread blocks a call uses.");
  m.def(
      "car_shared_gpu_blocks",
      [](int worldSize, int requested, int chosen, int residentTotal) {
        return car::sharedGpuBlocks(worldSize, requested, chosen, residentTotal);
      },
      py::arg("world_size"), py::arg("requested"), py::arg("chosen"), py::arg("resident_total"),
      "Blocks per rank when every rank runs on one GPU (all must be resident at once); "
      "ValueError for a request that does not fit.");
  m.def(
      "car_max_resident_blocks",
      [](const std::string& dtype, const std::string& algorithm, int worldSize, bool fused) {
        car::DType d = car::DType::kFloat32;
        if (dtype == "float16")
          d = car::DType::kFloat16;
        else if (dtype == "bfloat16")
          d = car::DType::kBFloat16;
        else
          TPCOMM_CHECK(dtype == "float32", kInvalidUsage, "custom allreduce: dtype ", dtype);
        return car::maxResidentBlocks(d, toAlgorithm(algorithm), worldSize, fused);
      },
      py::arg("dtype"), py::arg("algorithm"), py::arg("world_size"), py::arg("fused") = false,
      "How many blocks of the kernel (fused: the add + RMSNorm one) the current GPU holds at "
      "once.");
  m.def(
      "car_describe_error", [](uint32_t code) { return car::describeError(code); }, py::arg("code"),
      "What a kernel's failure code (CarRank.error_code) says.");
  m.def("car_defaults", [] {
    py::dict d;
    d["max_bytes"] = settings().carMaxBytes;
    d["timeout_ms"] = settings().carTimeoutMs > 0 ? settings().carTimeoutMs : kDirectCarTimeoutMs;
    d["blocks"] = settings().carBlocks;
    return d;
  });
  m.def(
      "car_launch_empty_kernel",
      [](std::optional<int64_t> stream) {
        car::launchEmptyKernel(stream ? reinterpret_cast<cudaStream_t>(*stream)
                                      : c10::cuda::getCurrentCUDAStream().stream());
      },
      py::arg("stream") = py::none(), "Launches a kernel that does nothing.");
}

}  // namespace tpcomm::python
