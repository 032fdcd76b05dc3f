// Bindings of the shared-memory ring (tpcomm::mq). Waits release the GIL;
// tpcomm errors become TimeoutError, PeerLostError, ValueError or OSError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <chrono>

#include "coordinator/common/error.hpp"
#include "coordinator/common/settings.hpp"
#include "message_queue/ring.hpp"

namespace py = pybind11;

namespace tpcomm::python {

namespace {

std::chrono::milliseconds toMillis(double seconds) {
  TPCOMM_CHECK(seconds >= 0, kInvalidUsage, "timeout must be >= 0 seconds, got ", seconds);
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

std::string hostId() {
  if (!settings().hostId.empty()) return settings().hostId;
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  return name;
}

}  // namespace

void registerMessageQueue(py::module_& m) {
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
            std::vector<py::buffer_info> views;
            std::vector<mq::Writer::Part> raw;
            for (const auto& part : parts) {
              views.push_back(py::reinterpret_borrow<py::buffer>(part).request());
              const auto& v = views.back();
              raw.push_back({v.ptr, static_cast<size_t>(v.size * v.itemsize)});
            }
            py::gil_scoped_release release;
            w.write(raw, toMillis(timeout));
          },
          py::arg("parts"), py::arg("timeout"),
          "Writes one message made of the given contiguous buffers.")
      .def("shutdown", &mq::Writer::shutdown);

  py::class_<mq::Reader>(m, "MqReader", "Reader end of a shared-memory ring.")
      .def(py::init<const std::string&, uint32_t>(), py::arg("name"), py::arg("index"))
      .def(
          "read",
          [](mq::Reader& r, double timeout) {
            PyObject* out = nullptr;
            {
              py::gil_scoped_release release;
              r.read(toMillis(timeout), [&](uint64_t bytes) -> char* {
                py::gil_scoped_acquire gil;
                out = PyByteArray_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(bytes));
                if (out == nullptr) throw py::error_already_set();
                return PyByteArray_AsString(out);
              });
            }
            return py::reinterpret_steal<py::bytearray>(out);
          },
          py::arg("timeout"), "Reads the next message into a new bytearray.")
      .def("shutdown", &mq::Reader::shutdown);

  m.def("host_id", &hostId, "This process's host identity (TPCOMM_HOST_ID or the host name).");
}

}  // namespace tpcomm::python
