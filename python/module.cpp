// tpcomm._C: one register_<component> function per component.
#include <torch/csrc/utils/pybind.h>

namespace tpcomm::python {
void registerBackend(pybind11::module_& m);
void registerMessageQueue(pybind11::module_& m);
void registerCustomAllreduce(pybind11::module_& m);
}  // namespace tpcomm::python

PYBIND11_MODULE(_C, m) {
  m.doc() = "tpcomm's C++ core: the c10d backend and its coordinator";
  tpcomm::python::registerBackend(m);
  tpcomm::python::registerMessageQueue(m);
  tpcomm::python::registerCustomAllreduce(m);
}
