// Bindings of the backend, its coordinator's settings and build facts.
#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "backend/flight_dump.hpp"
#include "backend/flight_record.hpp"
#include "backend/process_group_tpcomm.hpp"
#include "common/settings.hpp"
#include "coordinator/group_life.hpp"
#include "custom_allreduce/custom_allreduce.hpp"

namespace py = pybind11;

namespace tpcomm::python {

namespace {

bool interpreterFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// Wraps a Python callable (store, rank, size, timeout) -> Backend as a
// coordinator factory; the GIL is taken only when it runs.
coord::BackendFactory wrapFactory(py::object factory) {
  if (factory.is_none()) return {};
  std::shared_ptr<py::object> callable(new py::object(std::move(factory)), [](py::object* p) {
    if (!Py_IsInitialized() || interpreterFinalizing()) return;  // leak at exit, never crash
    py::gil_scoped_acquire gil;
    delete p;
  });
  return [callable](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                    std::chrono::milliseconds timeout) {
    py::gil_scoped_acquire gil;
    py::object backend = (*callable)(store, rank, size, timeout);
    return backend.cast<c10::intrusive_ptr<c10d::Backend>>();
  };
}

c10::intrusive_ptr<backend::ProcessGroupTpcomm> makeBackend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& groupName,
    const c10::intrusive_ptr<c10d::Backend>& cpuBackend, py::object deviceFactory,
    py::object cpuFactory, const std::string& life) {
  coord::GroupOptions options;
  options.life = life;
  options.rank = rank;
  options.size = size;
  options.timeout = timeout;
  options.groupName = groupName;
  options.debugChecks = settings().debug;
  auto coordinator = std::make_shared<coord::GroupCoordinator>(
      options, store, cpuBackend, wrapFactory(std::move(deviceFactory)));
  coordinator->setCpuBackendFactory(wrapFactory(std::move(cpuFactory)));
  return c10::make_intrusive<backend::ProcessGroupTpcomm>(std::move(coordinator));
}

// A group in torch's reconfigure regime: no member until its first
// reconfigure (backend/reconfigure.cpp).
c10::intrusive_ptr<backend::ProcessGroupTpcomm> makeUnformed(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout, const std::string& groupName, py::object deviceFactory,
    py::object cpuFactory) {
  backend::ProcessGroupTpcomm::Unformed unformed;
  unformed.store = store;
  unformed.options.rank = rank;
  unformed.options.size = size;
  unformed.options.timeout = timeout;
  unformed.options.groupName = groupName;
  unformed.options.debugChecks = settings().debug;
  unformed.deviceFactory = wrapFactory(std::move(deviceFactory));
  unformed.cpuFactory = wrapFactory(std::move(cpuFactory));
  return c10::make_intrusive<backend::ProcessGroupTpcomm>(std::move(unformed));
}

}  // namespace

void registerBackend(py::module_& m) {
  // Before any group exists, so before anything can write a dump through
  // the writer it replaces (backend/flight_dump.hpp).
  backend::registerMergingDumpWriter();
  using backend::TpcommOptions;
  py::class_<TpcommOptions, c10d::Backend::Options, c10::intrusive_ptr<TpcommOptions>>(
      m, "Options", "Options of a tpcomm backend: timeout and group name.")
      .def(py::init<std::chrono::milliseconds>(), py::arg("timeout") = kBackendDefaultTimeout)
      .def("__copy__",
           [](const TpcommOptions& self) { return c10::make_intrusive<TpcommOptions>(self); })
      .def("__deepcopy__", [](const TpcommOptions& self, py::dict) {
        return c10::make_intrusive<TpcommOptions>(self);
      });

  py::class_<backend::ProcessGroupTpcomm, c10d::Backend,
             c10::intrusive_ptr<backend::ProcessGroupTpcomm>>(m, "ProcessGroupTpcomm", R"(
The c10d backend "tpcomm": CPU tensors through the CPU backend (Gloo), CUDA
tensors through the device backend (NCCL), created on first use.)")
      .def_property_readonly("options", &backend::ProcessGroupTpcomm::getBackendOptions,
                             "This backend's options (copied by torch's split_group).")
      .def(py::init(&makeBackend), py::arg("store"), py::arg("rank"), py::arg("size"),
           py::arg("timeout"), py::arg("group_name"), py::arg("cpu_backend"),
           py::arg("device_factory"), py::arg("cpu_factory") = py::none(), py::arg("life") = "")
      .def_static("_unformed", &makeUnformed, py::arg("store"), py::arg("rank"), py::arg("size"),
                  py::arg("timeout"), py::arg("group_name"), py::arg("device_factory"),
                  py::arg("cpu_factory"),
                  "A group in torch's reconfigure regime (enable_reconfigure=True): no member "
                  "until dist._reconfigure formed it.")
      .def_property_readonly("_formed", &backend::ProcessGroupTpcomm::formed,
                             "Whether the group has members (False: the reconfigure regime, "
                             "before its first reconfigure).")
      .def("_set_global_ranks", &backend::ProcessGroupTpcomm::setGlobalRanks, py::arg("ranks"),
           "The group's global ranks (for the flight recorder's group table).")
      .def(
          "_set_gloo_store",
          [](backend::ProcessGroupTpcomm& self, const c10::intrusive_ptr<c10d::Store>& store) {
            self.coordinator().fault().addGlooSockets(
                coord::GlooSockets::ofGroup(store, self.getRank(), self.getSize()));
          },
          py::arg("store"), py::call_guard<py::gil_scoped_release>(),
          "The store the group's Gloo group was made with: its ranks' listening addresses there "
          "tell its connections, shut down when the group breaks.")
      .def_property_readonly(
          "_gloo_connections",
          [](backend::ProcessGroupTpcomm& self) {
            const auto sockets = self.coordinator().fault().glooSockets();
            return py::make_tuple(sockets.connections(), sockets.problem());
          },
          "(descriptors of the group's Gloo connections open now, why some are not known or '').")
      .def(
          "_refuse_p2p",
          [](backend::ProcessGroupTpcomm& self, const std::string& op, const std::string& why) {
            self.coordinator().fault().breakGroup("rank " + std::to_string(self.getRank()) +
                                                  " refused " + op + " (" + why + ")");
          },
          py::arg("op"), py::arg("why"), py::call_guard<py::gil_scoped_release>(),
          "torch.distributed's front door refused a point-to-point call on this group: its peer "
          "waits in a call of its own, so the group breaks naming it (see docs/faults.md).")
      .def("_refuse", &backend::ProcessGroupTpcomm::refuseFromPython, py::arg("op"), py::arg("why"),
           py::call_guard<py::gil_scoped_release>(),
           "torch.distributed's front door refused a collective on this group before it reached "
           "the backend: the peers learn it (see docs/faults.md).")
      .def_property_readonly(
          "fault",
          [](backend::ProcessGroupTpcomm& self) { return self.coordinator().fault().reason(); },
          "Why the group broke (an abort, a failure, a collective refused on another rank); "
          "empty while it works.")
      .def_property_readonly(
          "positions",
          [](backend::ProcessGroupTpcomm& self) {
            py::gil_scoped_release nogil;  // reads the store, up to a second
            return self.coordinator().fault().positions();
          },
          "Where the group's ranks are, as a failed call's error names them: ' [across ranks: "
          "this rank (0) in allreduce #2; rank 1: in recv #1 (p2p) for 0.4 s]' (a peer says "
          "where it waits once a call of its has waited TPCOMM_WATCHDOG_MS; read from the store "
          "within one second; '' for a group of one).")
      .def_property_readonly(
          "device_backend_created",
          [](backend::ProcessGroupTpcomm& self) {
            return static_cast<bool>(self.coordinator().deviceBackendIfCreated());
          },
          "Whether the device backend (NCCL) exists yet; False for a CPU-only job.")
      .def_property_readonly(
          "cpu_backend",
          [](backend::ProcessGroupTpcomm& self) { return self.coordinator().cpuBackend(); })
      .def_property_readonly("debug_checks",
                             [](backend::ProcessGroupTpcomm& self) {
                               return self.coordinator().options().debugChecks;
                             })
      .def(
          "stats",
          [](backend::ProcessGroupTpcomm& self) {
            py::dict out;
            for (const auto& row : self.coordinator().stats()) {
              py::dict counts;
              counts["calls"] = row.calls;
              counts["bytes"] = row.bytes;
              out[py::str(row.route)] = counts;
            }
            return out;
          },
          "Calls and bytes per route (gloo, cpu_shm, custom_oneshot, custom_twoshot, nccl) on this "
          "rank.")
      .def(
          "describe",
          [](backend::ProcessGroupTpcomm& self) {
            auto& c = self.coordinator();
            const auto& routing = c.routing();
            py::dict out;
            out["group"] = c.options().groupName;
            out["flight_recorder"] = backend::FlightRecord::get().status();
            out["rank"] = c.rank();
            out["world_size"] = c.size();
            out["cpu_backend"] = "gloo";
            const auto device = c.cudaDevice();
            out["device"] = device ? py::object(py::str(device->str())) : py::object(py::none());
            out["device_backend"] = c.deviceBackendIfCreated() ? "nccl" : "nccl (not created)";
            py::dict custom;
            custom["available"] = routing.customAvailable();
            custom["reason"] = routing.customReason();
            custom["max_bytes"] = routing.config().customMaxBytes;
            custom["oneshot_max_bytes"] = routing.oneShotMaxBytes();
            custom["timeout_ms"] = c.customTimeout().count();
            py::dict zeroCopy;
            if (auto path = c.customPath()) {
              const auto z = path->zeroCopyStats();
              zeroCopy["registered"] = z.registered;
              zeroCopy["staged"] = z.staged;
              zeroCopy["last_staged_reason"] = z.lastStagedReason;
              zeroCopy["table_slots"] = z.tableSlots;
              zeroCopy["table_capacity"] = z.tableCapacity;
              zeroCopy["table_full"] = z.tableFull;
            }
            custom["zero_copy"] = zeroCopy;
            out["custom_allreduce"] = custom;
            // shmMutex_ without the GIL: a set-up that holds it makes Gloo
            // sub-groups through Python (the GIL) for a group across hosts.
            coord::GroupCoordinator::CpuShmState shmState;
            {
              py::gil_scoped_release released;
              shmState = c.cpuShmState();
            }
            const auto shmConfig = coord::CpuShmConfig::fromSettings();
            py::dict shm;
            shm["mode"] = shmState.mode;
            shm["set_up"] = shmState.setUp;
            shm["available"] = shmState.available;
            shm["reason"] = shmState.reason;
            // The chunk in force once set up, else the setting (0: auto).
            shm["buffer_bytes"] = shmState.bufferBytes != 0
                                      ? static_cast<int64_t>(shmState.bufferBytes)
                                      : shmConfig.bufferBytes;
            shm["two_phase_bytes"] = shmConfig.twoPhaseBytes;
            shm["spin_us"] = shmState.spinUs;
            shm["yields"] = shmState.yields;
            py::dict waits;
            waits["waits"] = shmState.waits.waits;
            waits["at_once"] = shmState.waits.atOnce;
            waits["met_polling"] = shmState.waits.metPolling;
            waits["slept"] = shmState.waits.slept;
            waits["poll_us"] = shmState.waits.pollNs / 1000.0;
            waits["sleep_us"] = shmState.waits.sleepNs / 1000.0;
            py::list late;
            for (uint64_t n : shmState.waits.late) late.append(n);
            waits["late"] = late;
            shm["waits"] = waits;
            shm["threads"] = shmState.threads;
            shm["reduce_isa"] = shmState.reduceIsa;
            shm["memfd"] = shmState.memfd;
            shm["numa_nodes"] = shmState.numaNodes;
            py::list ranks;
            for (const auto& share : shmState.ranks) {
              py::dict one;
              one["node"] = share.node;
              one["allowed_cpus"] = share.allowed;
              one["cpus"] = share.cpus;
              one["threads"] = share.threads;
              one["pinned_workers"] = share.pinnedWorkers;
              one["memory"] = share.memory;
              ranks.append(one);
            }
            shm["ranks"] = ranks;
            py::dict hier;
            hier["used"] = shmState.hierarchical;
            hier["hosts"] = shmState.layout;
            hier["reason"] = shmState.hierReason;
            hier["slice_bytes"] = shmState.hierSliceBytes;
            hier["gather_bytes"] = shmState.hierGatherBytes;
            hier["inline_bytes"] = shmState.hierInlineBytes;
            shm["across_hosts"] = hier;
            out["cpu_shm"] = shm;
            out["route_mode"] = routing.config().mode;
            out["autotune"] = routing.tuneSource();
            py::list rows;
            for (const auto& row : routing.rows()) {
              py::dict r;
              r["route"] = coord::deviceRouteName(row.route);
              r["from_bytes"] = row.fromBytes;
              r["to_bytes"] = row.toBytes < 0 ? py::object(py::none()) : py::int_(row.toBytes);
              rows.append(r);
            }
            out["cuda_allreduce_routes"] = rows;
            return out;
          },
          "This group's configuration: size, backends, whether the CPU shared-memory path and "
          "the custom allreduce are available (and why not), and the CUDA allreduce routing "
          "table in force.")
      .def(
          "all_reduce_into",
          [](backend::ProcessGroupTpcomm& self, at::Tensor input, at::Tensor output, bool average,
             bool asyncOp) {
            c10d::AllreduceOptions opts;
            opts.reduceOp = average ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
            opts.asyncOp = asyncOp;
            return self.allreduceInto(input, output, opts);
          },
          py::arg("input"), py::arg("output"), py::arg("average") = false,
          py::arg("async_op") = false, py::call_guard<py::gil_scoped_release>(),
          "output = sum (or mean) of every rank's input, out of place; returns a Work when "
          "async_op, else None (ordered on the current stream).")
      .def(
          "all_reduce_add_rms_norm",
          [](backend::ProcessGroupTpcomm& self, at::Tensor input, at::Tensor residual,
             at::Tensor weight, double eps, at::Tensor normed, at::Tensor residualOut) {
            return self.allreduceAddRmsNorm(input, residual, weight, eps, normed, residualOut);
          },
          py::arg("input"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
          py::arg("normed"), py::arg("residual_out"), py::call_guard<py::gil_scoped_release>(),
          "residual_out = sum of every rank's input + residual; normed = RMSNorm(residual_out) x "
          "weight over the last dimension (float32 statistics), fused where the path allows. "
          "Contiguous tensors; residual_out may be residual. CPU: done on return; CUDA: ordered "
          "on the current stream. Returns the path taken (custom_oneshot, custom_twoshot, "
          "cpu_shm, local, composed).")
      .def(
          "set_route_mode",
          [](backend::ProcessGroupTpcomm& self, const std::string& mode) {
            self.coordinator().setRouteMode(mode);
          },
          py::arg("mode"),
          "This group's CUDA allreduce routing mode (auto, nccl, oneshot, twoshot) instead of "
          "TPCOMM_ROUTE; every rank must set the same mode between the same two calls.")
      .def(
          "set_cpu_shm_mode",
          [](backend::ProcessGroupTpcomm& self, const std::string& mode) {
            py::gil_scoped_release released;  // shmMutex_ before the GIL, never after
            self.coordinator().setCpuShmMode(mode);
          },
          py::arg("mode"),
          "This group's TPCOMM_CPU_SHM mode (auto, 0, 1) instead of the process's; every rank "
          "calls it before the group's first CPU collective (benchmarks, tests).")
      .def(
          "set_cpu_reduce_isa",
          [](backend::ProcessGroupTpcomm& self, const std::string& level) {
            py::gil_scoped_release released;  // shmMutex_ before the GIL, never after
            self.coordinator().setCpuReduceIsa(level);
          },
          py::arg("level"),
          "The widest reduction kernels of this group's shared-memory path (auto, avx512, avx2, "
          "portable) instead of TPCOMM_CPU_REDUCE_ISA; any time, every rank alike (benchmarks, "
          "tests).")
      .def(
          "set_cpu_shm_spin_us",
          [](backend::ProcessGroupTpcomm& self, int64_t spinUs) {
            py::gil_scoped_release released;  // shmMutex_ before the GIL, never after
            self.coordinator().setCpuShmSpinUs(spinUs);
          },
          py::arg("spin_us"),
          "How long this group's shared-memory waits poll before sleeping (-1: the policy's "
          "choice) instead of TPCOMM_CPU_SHM_SPIN_US; any time, any rank (benchmarks, tests).")
      .def(
          "set_cpu_shm_threads",
          [](backend::ProcessGroupTpcomm& self, int64_t threads) {
            py::gil_scoped_release released;  // shmMutex_ before the GIL, never after
            self.coordinator().setCpuShmThreads(threads);
          },
          py::arg("threads"),
          "This group's TPCOMM_CPU_SHM_THREADS (0: the default) instead of the process's, before "
          "its first CPU collective on this rank (benchmarks, tests).")
      .def(
          "begin_graph_registration",
          [](backend::ProcessGroupTpcomm& self) { self.coordinator().beginGraphRegistration(); },
          "graph_capture(): custom allreduces captured from now on read their inputs in place "
          "once finish_graph_registration() ran (on every rank).")
      .def(
          "reset_custom_allreduce",
          [](backend::ProcessGroupTpcomm& self) { self.coordinator().resetCustom(); },
          py::call_guard<py::gil_scoped_release>(),
          "Collective: makes the custom allreduce usable again after a failure (every rank "
          "synchronises its GPU, then the flags are zeroed between two barriers).")
      .def(
          "finish_graph_registration",
          [](backend::ProcessGroupTpcomm& self) { self.coordinator().finishGraphRegistration(); },
          py::call_guard<py::gil_scoped_release>(),
          "Collective: exchanges and maps the captured inputs (see begin_graph_registration).")
      .def(
          "reset_stats", [](backend::ProcessGroupTpcomm& self) { self.coordinator().resetStats(); },
          "Sets every route's counters back to zero.");

  m.def("_agree_on_life", &coord::agreeOnLife, py::arg("store"), py::arg("rank"), py::arg("size"),
        py::arg("timeout"), py::call_guard<py::gil_scoped_release>(),
        "Collective: the id every rank of a group being made agrees on, under which the "
        "group's store keys live (coordinator/group_life.hpp).");
  m.def("_finish_making", &coord::finishMaking, py::arg("store"), py::arg("rank"),
        py::arg("size"), py::arg("timeout"), py::arg("failure") = py::none(),
        py::call_guard<py::gil_scoped_release>(),
        "Collective: the end of a group's making on its life's store; returns once every rank "
        "made its part, raises the failure a rank reported (coordinator/group_life.hpp).");
  m.def(
      "_fr_rename_internal", [] { backend::FlightRecord::get().renameInternal(); },
      "Renames the flight recorder's entries of tpcomm's own Gloo groups for torchfrtrace.");
  m.def(
      "_write_fr_dump",
      [](int rank, const py::bytes& dump) {
        std::string data = dump;
        py::gil_scoped_release release;
        c10d::DebugInfoWriter::getWriter(rank).write(data);
      },
      py::arg("rank"), py::arg("dump"),
      "Writes a pickled flight-recorder dump through torch's dump writer, as ProcessGroupNCCL "
      "does after its failures (tests the merging writer, backend/flight_dump.hpp).");
  m.def(
      "_calls_on_this_thread", [] { return backend::ProcessGroupTpcomm::callsOnThisThread(); },
      "How many calls this thread has made on tpcomm groups (refused ones too).");
  m.def(
      "_native_hooks",
      [] {
        py::dict out;
        out["flight_recorder"] = backend::FlightRecord::get().status();
        out["gloo_connections"] = coord::GlooSockets::status();
        return out;
      },
      "The C++ hooks into torch's internals: 'on (...)' or 'off: <why>' each.");
  m.def("_gloo_ground_of", &coord::GlooSockets::groundOf, py::arg("fd_dir"),
        "The Gloo connection finder's check against a descriptor folder: '' or why it fails.");
  m.def(
      "settings",
      [] {
        py::list rows;
        for (const auto& s : settingTable()) {
          rows.append(py::make_tuple(s.name, s.type, s.defaultValue, s.doc));
        }
        return rows;
      },
      "Every TPCOMM_* setting as (name, type, default, doc).");
  m.def(
      "build_info",
      [] {
        py::dict info;
        info["cuda_version"] = car::compiledCudaVersion();
        info["cuda_architectures"] = car::compiledArchitectures();
        // torch's newest c10d::Backend capabilities (docs/torch_capabilities.md):
        // compiled in where the torch built against declares them.
        py::dict capabilities;
#if defined(TPCOMM_ABORT_HOOKS)
        capabilities["abort_hooks"] = true;
#else
        capabilities["abort_hooks"] = false;
#endif
#if defined(TPCOMM_COMPLETION_HOOKS)
        capabilities["completion_hooks"] = true;
#else
        capabilities["completion_hooks"] = false;
#endif
        capabilities["coalescing"] = true;  // c10d::Backend has had it since before 2.11
#if defined(TPCOMM_SHRINK)
        capabilities["shrink"] = true;
#else
        capabilities["shrink"] = false;
#endif
#if defined(TPCOMM_RECONFIGURE)
        capabilities["reconfigure"] = true;
#else
        capabilities["reconfigure"] = false;
#endif
#if defined(TPCOMM_WINDOW)
        capabilities["window"] = true;
#else
        capabilities["window"] = false;
#endif
        info["torch_capabilities"] = capabilities;
        return info;
      },
      "The CUDA version and SM architectures this build's kernels target, and which of torch's "
      "newest backend capabilities it offers (torch_capabilities).");
}

}  // namespace tpcomm::python
