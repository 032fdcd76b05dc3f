// Bindings of the shared-memory ring (tpcomm::mq). Waits release the GIL;
// tpcomm errors become TimeoutError, PeerLostError, ValueError or OSError.
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/mman.h>
#include <torch/csrc/utils/pybind.h>
#include <unistd.h>

#include <mutex>

#include <chrono>

#include "common/error.hpp"
#include "common/settings.hpp"
#include "coordinator/cpu/cpu_shm_path.hpp"
#include "message_queue/arena/arena.hpp"
#include "message_queue/collectives/shm_reduce.hpp"
#include "message_queue/ring/ring.hpp"
#include "python/mq_frames.hpp"

namespace py = pybind11;

namespace tpcomm::python {

namespace {

std::chrono::milliseconds toMillis(double seconds) {
  TPCOMM_CHECK(seconds >= 0, kInvalidUsage, "timeout must be >= 0 seconds, got ", seconds);
  // A year at most: deadlines are steady_clock::now() + timeout.
  return std::chrono::milliseconds(static_cast<int64_t>(std::min(seconds, 3.2e7) * 1000.0));
}

// set_spin_us of either end.
std::chrono::microseconds toSpin(int64_t us) {
  TPCOMM_CHECK(us >= 0, kInvalidUsage, "spin_us must be >= 0, got ", us);
  return std::chrono::microseconds(us);
}
constexpr const char* kSpinDoc =
    "How long this end's waits poll before sleeping (0: 4,000 polls and a wake-up after every "
    "publish, as before the setting).";

// Receive buffers. A fresh large buffer costs first-touch page faults on
// every page, which bound big messages (1.56 GB/s into fresh memory against
// 8 GB/s warm on the 2-core machine). So the memory of a large message comes
// back here when its tensors die, and the next large message reuses it: one
// spare buffer at most, so the cache holds no more than one message.
class ReceiveBuffers {
 public:
  static constexpr uint64_t kRecycleFrom = 64ull << 10;

  static ReceiveBuffers& instance() {
    static ReceiveBuffers* buffers = new ReceiveBuffers();  // outlives every tensor
    return *buffers;
  }

  at::Tensor take(uint64_t bytes) {
    if (bytes < kRecycleFrom) return at::empty({static_cast<int64_t>(bytes)}, at::kByte);
    void* p = nullptr;
    uint64_t capacity = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (spare_ != nullptr && spareBytes_ >= bytes && spareBytes_ / 2 <= bytes) {
        std::swap(p, spare_);
        capacity = spareBytes_;
      }
    }
    if (p == nullptr) {
      capacity = bytes;
      p = ::mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      TPCOMM_CHECK(p != MAP_FAILED, kSystem, "mmap of a ", bytes, "-byte receive buffer failed");
    }
    return at::from_blob(
        p, {static_cast<int64_t>(bytes)},
        [capacity](void* q) { ReceiveBuffers::instance().give(q, capacity); },
        at::TensorOptions().dtype(at::kByte));
  }

  void give(void* p, uint64_t capacity) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (spare_ != nullptr) ::munmap(spare_, spareBytes_);
    spare_ = p;
    spareBytes_ = capacity;
  }

 private:
  std::mutex mutex_;
  void* spare_ = nullptr;
  uint64_t spareBytes_ = 0;
};

// pickle.loads, looked up once at registration (under the import lock, not
// in a call that may race another thread for the GIL). Never destroyed: a
// py::object torn down at exit, without the GIL, would crash the
// interpreter's finalisation.
py::object* gPickleLoads = nullptr;
const py::object& pickleLoads() { return *gPickleLoads; }

// The buffers of a list of bytes-like parts, kept alive while they are written.
struct Buffers {
  std::vector<py::buffer_info> views;
  std::vector<mq::Writer::Part> parts;
  explicit Buffers(const py::list& list) {
    views.reserve(list.size());
    for (const auto& part : list) {
      views.push_back(py::reinterpret_borrow<py::buffer>(part).request());
      const auto& v = views.back();
      parts.push_back({v.ptr, static_cast<size_t>(v.size * v.itemsize)});
    }
  }
};

// A frame's whole bytes in one uint8 tensor (for readers on other hosts).
at::Tensor packFrame(const OutgoingFrame& f) {
  at::Tensor out = at::empty({static_cast<int64_t>(f.bytes)}, at::kByte);
  char* p = static_cast<char*>(out.data_ptr());
  for (const auto& part : f.parts) {
    if (part.bytes > 0) std::memcpy(p, part.data, part.bytes);
    p += part.bytes;
  }
  return out;
}

// Unpickles a received frame: `loadsFrame(stream, tensors)` with the GIL.
py::object loadFrame(const at::Tensor& message, const std::shared_ptr<mq::Arena>& arena,
                     const py::object& loadsFrame) {
  IncomingFrame f = parseFrame(message, arena);
  py::list tensors(f.tensors.size());
  for (size_t i = 0; i < f.tensors.size(); ++i) tensors[i] = py::cast(std::move(f.tensors[i]));
  py::memoryview stream = py::memoryview::from_memory(
      static_cast<const char*>(message.const_data_ptr()) + f.streamOffset,
      static_cast<ssize_t>(f.streamBytes));
  py::object result;
  try {
    result = loadsFrame(stream, tensors);
  } catch (py::error_already_set& e) {
    stream.attr("release")();  // no Python call with an error set
    e.restore();
    throw py::error_already_set();
  }
  stream.attr("release")();
  return result;
}

at::Tensor checkedMessage(const at::Tensor& message) {
  TPCOMM_CHECK(message.device().is_cpu() && message.scalar_type() == at::kByte &&
                   message.dim() == 1 && message.is_contiguous(),
               kInvalidUsage, "a received message is a contiguous 1-D uint8 CPU tensor");
  return message;
}

}  // namespace

void registerMessageQueue(py::module_& m) {
  gPickleLoads = new py::object(py::module_::import("pickle").attr("loads"));
  static py::exception<Error> peerLost(m, "PeerLostError", PyExc_RuntimeError);
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      switch (e.code()) {
        case ErrorCode::kTimeout:
          PyErr_SetString(PyExc_TimeoutError, e.what());
          return;
        case ErrorCode::kPeerLost:
          py::set_error(peerLost, e.what());
          return;
        case ErrorCode::kInvalidUsage:
          PyErr_SetString(PyExc_ValueError, e.what());
          return;
        default:
          PyErr_SetString(PyExc_OSError, e.what());
          return;
      }
    }
  });

  py::class_<mq::Writer>(m, "MqWriter", "Writer end of a shared-memory ring.")
      .def(py::init([](uint32_t readers, uint64_t chunks, uint64_t chunkBytes) {
             mq::Geometry g;
             g.numReaders = readers;
             g.numChunks = chunks;
             g.chunkBytes = chunkBytes;
             return std::make_unique<mq::Writer>(g);
           }),
           py::arg("num_readers"), py::arg("num_chunks"), py::arg("chunk_bytes"))
      .def_property_readonly("name", &mq::Writer::name)
      .def(
          "wait_for_readers",
          [](mq::Writer& w, double timeout) {
            py::gil_scoped_release release;
            w.waitForReaders(toMillis(timeout));
          },
          py::arg("timeout"))
      .def(
          "write",
          [](mq::Writer& w, const py::list& parts, double timeout) {
            Buffers buffers(parts);
            py::gil_scoped_release release;
            w.write(buffers.parts, toMillis(timeout));
          },
          py::arg("parts"), py::arg("timeout"),
          "Writes one message made of the given contiguous buffers.")
      .def(
          "write_frame",
          [](mq::Writer& w, const py::list& stream, std::vector<at::Tensor> tensors, double timeout,
             mq::Arena* arena) {
            const uint32_t readers = w.numReaders();  // each holds a view of every arena tensor
            Buffers buffers(stream);
            OutgoingFrame f = buildFrame(buffers.parts, std::move(tensors), arena);
            py::gil_scoped_release release;
            for (uint32_t slot : f.arenaSlots) arena->hold(slot, readers);
            try {
              w.write(f.parts, toMillis(timeout));
            } catch (...) {
              for (uint32_t slot : f.arenaSlots) arena->unhold(slot, readers);
              throw;
            }
          },
          py::arg("stream"), py::arg("tensors"), py::arg("timeout"), py::arg("arena") = nullptr,
          "Writes one frame: the pickle stream's parts and the tensors it refers to (raw, "
          "64-byte aligned; in place when they lie in `arena`, held for a view per reader).")
      .def(
          "set_spin_us", [](mq::Writer& w, int64_t us) { w.setSpin(toSpin(us)); }, py::arg("us"),
          kSpinDoc)
      .def("shutdown", &mq::Writer::shutdown);

  py::class_<mq::Reader>(m, "MqReader", "Reader end of a shared-memory ring.")
      .def(py::init<const std::string&, uint32_t>(), py::arg("name"), py::arg("index"))
      .def(
          "read",
          [](mq::Reader& r, double timeout) {
            py::gil_scoped_release release;
            at::Tensor out;
            r.read(toMillis(timeout), [&](uint64_t bytes) -> char* {
              out = ReceiveBuffers::instance().take(bytes);
              return static_cast<char*>(out.data_ptr());
            });
            return out;
          },
          py::arg("timeout"),
          "Reads the next message into a uint8 tensor (large ones reuse recycled memory).")
      .def(
          "read_object",
          [](mq::Reader& r, double timeout, const py::object& loadsFrame,
             const std::shared_ptr<mq::Arena>& arena) {
            const py::object& loads = pickleLoads();
            py::object result;
            bool failed = false;
            at::Tensor copied;  // a wrapped message's copy (recycled memory)
            at::Tensor frame;   // a frame, copied out of the ring
            {
              py::gil_scoped_release release;
              const auto allocate = [&](uint64_t bytes) -> char* {
                copied = ReceiveBuffers::instance().take(bytes);
                return static_cast<char*>(copied.data_ptr());
              };
              r.readInPlace(
                  toMillis(timeout),
                  [&](const char* data, uint64_t bytes) {
                    if (isFrame(data, bytes)) {
                      // Its tensors outlive the ring's chunks: copied once, and
                      // unpickled once the chunks are consumed.
                      if (copied.defined() && copied.const_data_ptr() == data) {
                        frame = copied;
                      } else {
                        frame = ReceiveBuffers::instance().take(bytes);
                        std::memcpy(frame.data_ptr(), data, bytes);
                      }
                      return;
                    }
                    py::gil_scoped_acquire acquire;
                    // A view of the ring, released before the chunks are
                    // consumed: unpickling copies what it keeps.
                    py::memoryview view =
                        py::memoryview::from_memory(data, static_cast<ssize_t>(bytes));
                    try {
                      result = loads(view);
                    } catch (py::error_already_set& e) {
                      view.attr("release")();  // no Python call with an error set
                      e.restore();
                      failed = true;
                      return;
                    }
                    view.attr("release")();
                  },
                  allocate);
            }
            if (failed) throw py::error_already_set();
            if (frame.defined()) return loadFrame(frame, arena, loadsFrame);
            return result;
          },
          py::arg("timeout"), py::arg("loads_frame"), py::arg("arena") = nullptr,
          "Reads the next message. A plain pickle stream is unpickled straight from the ring "
          "when it lies in one stretch of it (copied first when it wraps); a frame is copied "
          "out once and handed to loads_frame(stream, tensors), its tensors being views of "
          "that copy (or of `arena`).")
      .def(
          "set_spin_us", [](mq::Reader& r, int64_t us) { r.setSpin(toSpin(us)); }, py::arg("us"),
          kSpinDoc)
      .def_property_readonly("polls_briefly", &mq::Reader::pollsBriefly,
                             "Whether this reader's waits now poll briefly and sleep, its recent "
                             "messages having come later than its spin (TPCOMM_MQ_SPIN_ADAPT).")
      .def("shutdown", &mq::Reader::shutdown);

  py::class_<mq::Arena, std::shared_ptr<mq::Arena>>(
      m, "MqArena", "Shared memory beside a ring where the writer places tensors (zero copy).")
      .def(py::init([](uint64_t capacity) { return mq::Arena::create(capacity); }),
           py::arg("capacity"))
      .def_static("attach", &mq::Arena::attach, py::arg("name"))
      .def_property_readonly("name", &mq::Arena::name)
      .def_property_readonly("capacity", &mq::Arena::capacity)
      .def("close_descriptor", &mq::Arena::closeDescriptor)
      .def("describe_use", &mq::Arena::describeUse)
      .def(
          "empty",
          [](const std::shared_ptr<mq::Arena>& arena, std::vector<int64_t> shape,
             at::ScalarType dtype, double timeout, mq::Writer* writer) {
            const auto options = at::TensorOptions().dtype(dtype);
            TPCOMM_CHECK(!c10::isQIntType(dtype), kInvalidUsage,
                         "arena tensors are plain tensors, not ", c10::toString(dtype));
            uint64_t bytes = c10::elementSize(dtype);
            for (int64_t d : shape) {
              TPCOMM_CHECK(d >= 0 && (d == 0 || bytes <= (uint64_t{1} << 62) / d), kInvalidUsage,
                           "arena tensors need sizes >= 0 that fit memory, got shape ", shape);
              bytes *= static_cast<uint64_t>(d);
            }
            if (bytes == 0) return at::empty(shape, options);
            mq::Arena::Block block;
            {
              py::gil_scoped_release release;
              block = arena->allocate(bytes, toMillis(timeout), [writer] {
                return writer == nullptr || writer->readersAlive();
              });
            }
            const uint32_t slot = block.slot;
            try {
              return at::from_blob(
                  arena->data() + block.offset, shape,
                  [arena, slot](void*) { arena->releaseOwner(slot); }, options);
            } catch (...) {
              arena->releaseOwner(slot);
              throw;
            }
          },
          py::arg("shape"), py::arg("dtype"), py::arg("timeout"), py::arg("writer") = nullptr,
          "A tensor in a free block of the arena, waiting up to `timeout` s for one.");

  m.def(
      "mq_pack_frame",
      [](const py::list& stream, std::vector<at::Tensor> tensors) {
        Buffers buffers(stream);
        return packFrame(buildFrame(buffers.parts, std::move(tensors), nullptr));
      },
      py::arg("stream"), py::arg("tensors"),
      "A frame's bytes (pickle stream parts + tensors, all inline) in one uint8 tensor.");
  m.def(
      "mq_load_frame",
      [](const at::Tensor& message, const py::object& loadsFrame,
         const std::shared_ptr<mq::Arena>& arena) {
        return loadFrame(checkedMessage(message), arena, loadsFrame);
      },
      py::arg("message"), py::arg("loads_frame"), py::arg("arena") = nullptr,
      "Unpickles a received frame: loads_frame(stream, tensors), the tensors being views of "
      "`message` (or of `arena`, the queue's, for tensors the writer placed there).");
  m.def(
      "mq_is_frame",
      [](const at::Tensor& message) {
        checkedMessage(message);
        return isFrame(static_cast<const char*>(message.const_data_ptr()),
                       static_cast<uint64_t>(message.numel()));
      },
      py::arg("message"));
  m.def(
      "mq_default_spin_us", [] { return static_cast<int64_t>(mq::defaultSpin().count()); },
      "How long message-queue waits poll before sleeping (TPCOMM_MQ_SPIN_US).");
  m.def("host_id", &hostIdentity,
        "This process's host identity: TPCOMM_HOST_ID, else the host name with a hash of the "
        "boot id and the pid- and mount-namespace inodes (equal only where memory can be "
        "shared).");
  m.def("host_name", &hostName, "This process's host name (or TPCOMM_HOST_ID).");
  m.def(
      "cpu_reduce_isa", [] { return std::string(mq::reduceIsaName(mq::bestReduceIsa())); },
      "The widest reduction kernels this CPU runs (avx512, avx2, portable).");
  m.def(
      "cpu_reduce_isas",
      [] {
        std::vector<std::string> levels;
        for (auto isa : {mq::ReduceIsa::kAvx512, mq::ReduceIsa::kAvx2, mq::ReduceIsa::kPortable}) {
          if (mq::cpuRunsReduceIsa(isa)) levels.emplace_back(mq::reduceIsaName(isa));
        }
        return levels;
      },
      "Every reduction kernel level this CPU runs, widest first.");
  m.def(
      "cpu_reduce_isa_of",
      [](const std::string& setting) {
        return std::string(mq::reduceIsaName(coord::reduceIsaOf(setting)));
      },
      py::arg("setting"),
      "The level a TPCOMM_CPU_REDUCE_ISA value gives on this CPU (auto: the best).");
  m.def("usable_cpus", &coord::usableCpus,
        "The CPUs this process may use (its affinity, capped by a cgroup v2 quota).");
  m.def(
      "set_cpu_shm_cpus",
      [](const std::string& cpus) {
        coord::setProcessCpus(cpus.empty() ? std::vector<int>{}
                                           : coord::parseCpuList(cpus, "set_cpu_shm_cpus"));
      },
      py::arg("cpus"),
      "The CPUs this process's shared-memory groups set up from now on may use (\"0-7\"; "
      "\"\": back to TPCOMM_CPU_SHM_CPUS or the affinity mask).");
  m.def(
      "rank_cpus", [] { return coord::formatCpuList(coord::rankCpus()); },
      "The CPUs a shared-memory group set up now would take as this rank's.");
  m.def("numa_nodes", &coord::numaNodes, "The NUMA nodes with memory this machine has.");
  m.def("numa_node_of", &coord::numaNodeOf, py::arg("cpu"), "The NUMA node of a CPU.");
}

}  // namespace tpcomm::python
