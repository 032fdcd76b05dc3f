// tpcomm._C: one register_<component> function per component.
#include <torch/csrc/utils/pybind.h>

#include "coordinator/interpreter_lock.hpp"

namespace tpcomm::python {
void registerBackend(pybind11::module_& m);
void registerMessageQueue(pybind11::module_& m);
void registerCustomAllreduce(pybind11::module_& m);
void registerOps(pybind11::module_& m);
void registerFastCalls(pybind11::module_& m);
}  // namespace tpcomm::python

namespace {

// A group's teardown joins threads that may need the GIL (see
// interpreter_lock.hpp): release it around that teardown when this thread
// holds it. (During interpreter exit Python reports itself uninitialised
// and lets no other thread take the GIL, so nothing is released there.)
void releaseInterpreterLock(const std::function<void()>& fn) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    pybind11::gil_scoped_release release;
    fn();
  } else {
    fn();
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  tpcomm::coord::setInterpreterLockReleaser(&releaseInterpreterLock);
  m.doc() = "tpcomm's C++ core: the c10d backend and its coordinator";
  tpcomm::python::registerBackend(m);
  tpcomm::python::registerMessageQueue(m);
  tpcomm::python::registerCustomAllreduce(m);
  tpcomm::python::registerOps(m);
  tpcomm::python::registerFastCalls(m);
}
