// The shortest route from Python to a tpcomm group for the per-token calls:
// torch.distributed.all_reduce (tpcomm/_fast_calls.py puts its function in
// torch.distributed's place), GroupCoordinator.all_reduce and
// tpcomm.all_reduce_into.
//
// torch's route to the backend costs about 2 us before any byte moves: its
// Python function (argument checks, AllreduceOptions made and filled through
// pybind), ProcessGroup.allreduce's binding, the dispatcher's c10d::allreduce_
// op and a Work handed back to Python to wait on. The group engine itself
// takes 0.1-0.2 us at world size 1. These functions call the group's backend
// as that op does (ProcessGroupTpcomm::allreduce, the same checks, routing,
// recording and fault handling) when the call needs nothing else of torch's
// route: a plain dense CPU tensor, or CUDA tensor of a group whose CUDA
// backend is the same tpcomm backend (torch's op kernel for CUDA makes the
// same backend call; the kernel launch or NCCL call is ordered on the current
// stream either way), a plain reduce op, no torch function or
// dispatch mode, no profiler, no functorch or functionalization layer. Any
// other call answers "not taken" before it did anything, and the caller goes
// through torch's route.
//
// They are raw METH_FASTCALL functions (a pybind call costs more than the
// engine); errors reach Python through torch's own translation, as from any
// torch function.
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <array>
#include <memory>
#include <utility>

#include "backend/process_group_tpcomm.hpp"
#include "common/settings.hpp"
#include "python/op_outputs.hpp"

namespace py = pybind11;

namespace tpcomm::python {

namespace {

constexpr const char* kHandleName = "tpcomm.fast_handle";

// What a capsule made by _fast_handle holds: the group's tpcomm backend,
// weakly (a destroyed group's calls go torch's way, which says so), and
// whether it is also the group's CUDA backend (else CUDA calls go torch's
// way: "cpu:tpcomm,cuda:nccl", or no CUDA backend).
struct Handle {
  c10::weak_intrusive_ptr<backend::ProcessGroupTpcomm> backend;
  bool servesCuda = false;
  c10::weak_intrusive_ptr<c10d::ProcessGroup> group;
};

#if defined(TPCOMM_ABORT_HOOKS)
// Whether pre/post collective hooks are registered on `group`: torch fires
// them in its c10d ops' kernels, which the direct route skips, so with any
// registered the call goes torch's way. (The maps are protected members of
// ProcessGroup; a derived type's member pointers read them.)
struct CollectiveHooks : c10d::ProcessGroup {
  static bool any(const c10d::ProcessGroup& group) {
    return !(group.*(&CollectiveHooks::preHooks_)).empty() ||
           !(group.*(&CollectiveHooks::postHooks_)).empty();
  }
};
#endif

// torch's ReduceOp.RedOpType objects, by identity (set once by
// _fast_set_ops): comparing pointers costs nothing, converting through
// pybind does.
std::array<std::pair<PyObject*, c10d::ReduceOp::RedOpType>, 8> reduceOps{};
int reduceOpCount = 0;

thread_local uint64_t callsTaken = 0;

bool opOf(PyObject* object, c10d::ReduceOp::RedOpType* op) {
  for (int i = 0; i < reduceOpCount; ++i) {
    if (reduceOps[i].first == object) {
      *op = reduceOps[i].second;
      return true;
    }
  }
  return false;
}

// The group's backend for `tensor`'s device, or null when `capsule` is not a
// live handle, the backend does not serve that device or the group has
// collective hooks.
c10::intrusive_ptr<backend::ProcessGroupTpcomm> backendOf(PyObject* capsule,
                                                          const at::Tensor& tensor) {
  if (!PyCapsule_CheckExact(capsule)) return {};
  auto* handle = static_cast<Handle*>(PyCapsule_GetPointer(capsule, kHandleName));
  if (handle == nullptr) {
    PyErr_Clear();
    return {};
  }
  if (tensor.is_cuda() && !handle->servesCuda) return {};
#if defined(TPCOMM_ABORT_HOOKS)
  if (auto group = handle->group.lock(); group && CollectiveHooks::any(*group)) return {};
#endif
  return handle->backend.lock();
}

// A torch.Tensor (or Parameter, the same to C++) whose only dispatch keys are
// a dense CPU or CUDA tensor's, in a thread where nothing intercepts torch
// calls: the dispatcher would go straight to the c10d op's CPU or CUDA kernel
// with it.
const at::Tensor* plainTensor(PyObject* object) {
  if (!THPVariable_CheckExact(object)) return nullptr;
  const at::Tensor& tensor = THPVariable_Unpack(object);
  if (!tensor.defined()) return nullptr;
  static const c10::DispatchKeySet cpu({c10::DispatchKey::CPU, c10::DispatchKey::AutogradCPU,
                                        c10::DispatchKey::ADInplaceOrView,
                                        c10::DispatchKey::AutocastCPU});
  static const c10::DispatchKeySet cuda({c10::DispatchKey::CUDA, c10::DispatchKey::AutogradCUDA,
                                         c10::DispatchKey::ADInplaceOrView,
                                         c10::DispatchKey::AutocastCUDA});
  const uint64_t keys = tensor.key_set().raw_repr();
  if ((keys & ~cpu.raw_repr()) != 0 && (keys & ~cuda.raw_repr()) != 0) return nullptr;
  if (tensor.requires_grad() || at::isComplexType(tensor.scalar_type())) return nullptr;
  const auto local = c10::impl::tls_local_dispatch_key_set();
  static const c10::DispatchKeySet usual =
      c10::default_included_set | c10::autocast_dispatch_keyset;
  if ((local.included_.raw_repr() & ~usual.raw_repr()) != 0) {
    return nullptr;
  }
  if (c10::impl::TorchDispatchModeTLS::any_modes_set() || at::impl::torch_function_mode_enabled()) {
    return nullptr;
  }
  // A profiler (or any observer of torch ops) would see c10d::allreduce_.
  if (at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION)) return nullptr;
  return &tensor;
}

// _fast_all_reduce(handle, tensor, op, async_op) -> the call's result:
// dist.all_reduce(tensor, op, group, async_op) done as torch's route does it
// (ProcessGroup::allreduce, then the c10d op's CPU or CUDA kernel): True for a
// synchronous call (done), the Work (or None) for async_op. False when the
// call was not taken (nothing happened).
PyObject* fastAllReduce(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 4, "_fast_all_reduce takes (handle, tensor, op, async_op)");
  c10d::ReduceOp::RedOpType op;
  const at::Tensor* tensor = plainTensor(args[1]);
  if (tensor == nullptr || !opOf(args[2], &op)) Py_RETURN_FALSE;
  const int asyncOp = PyObject_IsTrue(args[3]);
  if (asyncOp < 0) return nullptr;
  auto backend = backendOf(args[0], *tensor);
  if (!backend) Py_RETURN_FALSE;
  std::vector<at::Tensor> tensors{*tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp(op);
  opts.asyncOp = asyncOp != 0;
  c10::intrusive_ptr<c10d::Work> work;
  {
    py::gil_scoped_release released;  // peers may need this process's other threads
    work = backend->allreduce(tensors, opts);
    if (c10d::allow_inflight_collective_as_graph_input()) {
      c10d::register_work(tensors[0], work);  // as ProcessGroup::allreduce does
    }
    if (!asyncOp && work) work->wait();
  }
  ++callsTaken;
  if (!asyncOp) Py_RETURN_TRUE;
  return py::cast(work).release().ptr();
  END_HANDLE_TH_ERRORS
}

// _fast_all_reduce_out(handle, tensor) -> Tensor | None: the sum over the
// group in a new tensor, as torch.ops.tpcomm.all_reduce's CPU kernel makes
// it (a CUDA tensor: as its CUDA kernel, tpcomm/_ops.py); None when the call
// was not taken.
PyObject* fastAllReduceOut(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 2, "_fast_all_reduce_out takes (handle, tensor)");
  const at::Tensor* tensor = plainTensor(args[1]);
  if (tensor == nullptr) Py_RETURN_NONE;
  auto backend = backendOf(args[0], *tensor);
  if (!backend) Py_RETURN_NONE;
  at::Tensor out;
  {
    py::gil_scoped_release released;
    out = allReduceOutOfPlace(*backend, *tensor);
  }
  ++callsTaken;
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}

// _fast_all_reduce_into(handle, input, out, average) -> bool: tpcomm's
// all_reduce_into (out = sum or mean of every rank's input, out of place) as
// its binding makes it (ProcessGroupTpcomm::allreduceInto, waited for: a CUDA
// call is ordered on the current stream), without pybind's conversions;
// False when the call was not taken (nothing happened).
PyObject* fastAllReduceInto(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 4, "_fast_all_reduce_into takes (handle, input, out, average)");
  const at::Tensor* input = plainTensor(args[1]);
  const at::Tensor* output = plainTensor(args[2]);
  if (input == nullptr || output == nullptr) Py_RETURN_FALSE;
  const int average = PyObject_IsTrue(args[3]);
  if (average < 0) return nullptr;
  auto backend = backendOf(args[0], *input);
  if (!backend) Py_RETURN_FALSE;
  at::Tensor in = *input;
  at::Tensor out = *output;
  c10d::AllreduceOptions opts;
  opts.reduceOp = average != 0 ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
  opts.asyncOp = false;
  {
    py::gil_scoped_release released;
    auto work = backend->allreduceInto(in, out, opts);
    if (work) work->wait();
  }
  ++callsTaken;
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"_fast_all_reduce", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&fastAllReduce)),
     METH_FASTCALL,
     "_fast_all_reduce(handle, tensor, op, async_op): dist.all_reduce's direct route (True: "
     "done; a Work or None: async_op's result; False: not taken, nothing happened)."},
    {"_fast_all_reduce_into",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&fastAllReduceInto)), METH_FASTCALL,
     "_fast_all_reduce_into(handle, input, out, average) -> bool: tpcomm.all_reduce_into's "
     "direct route (False: not taken, nothing happened)."},
    {"_fast_all_reduce_out",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&fastAllReduceOut)), METH_FASTCALL,
     "_fast_all_reduce_out(handle, tensor) -> Tensor | None: GroupCoordinator.all_reduce's "
     "direct route (None: not taken)."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

void registerFastCalls(py::module_& m) {
  m.def(
      "_fast_handle",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& group) -> py::object {
        // TPCOMM_DIRECT_CALLS=0: no handle, every call takes torch's route.
        // (Asked here, at a group's first call, not at import: settings
        // are read once, after the program had its chance to set them.)
        if (!settings().directCalls || !group || !group->hasBackends()) return py::none();
        c10::intrusive_ptr<c10d::Backend> cpu;
        try {
          cpu = group->getBackend(c10::DeviceType::CPU);
        } catch (const std::exception&) {
          return py::none();  // no CPU backend
        }
        auto tpcomm = c10::dynamic_intrusive_pointer_cast<backend::ProcessGroupTpcomm>(cpu);
        if (!tpcomm) return py::none();
        bool servesCuda = false;
        try {
          servesCuda = group->getBackend(c10::DeviceType::CUDA).get() == tpcomm.get();
        } catch (const std::exception&) {
          servesCuda = false;  // no CUDA backend on this group
        }
        auto handle = std::make_unique<Handle>(
            Handle{c10::weak_intrusive_ptr<backend::ProcessGroupTpcomm>(tpcomm), servesCuda,
                   c10::weak_intrusive_ptr<c10d::ProcessGroup>(group)});
        PyObject* capsule = PyCapsule_New(handle.get(), kHandleName, [](PyObject* c) {
          delete static_cast<Handle*>(PyCapsule_GetPointer(c, kHandleName));
        });
        if (capsule == nullptr) throw py::error_already_set();
        handle.release();  // the capsule owns it
        return py::reinterpret_steal<py::object>(capsule);
      },
      py::arg("group"),
      "A handle on the group's tpcomm CPU backend (and CUDA backend, when it is the same) for "
      "the direct calls, or None when its CPU backend is another or TPCOMM_DIRECT_CALLS=0.");
  m.def(
      "_fast_set_ops",
      [](const py::sequence& ops) {
        TORCH_CHECK_VALUE(ops.size() <= reduceOps.size(), "_fast_set_ops: at most ",
                          reduceOps.size(), " ops");
        std::array<std::pair<PyObject*, c10d::ReduceOp::RedOpType>, 8> table{};
        int count = 0;
        for (const auto& op : ops) {  // converted whole before the table changes
          auto pair = op.cast<py::tuple>();
          table[count++] = {pair[0].ptr(),
                            static_cast<c10d::ReduceOp::RedOpType>(pair[1].cast<int>())};
        }
        for (int i = 0; i < count; ++i) Py_INCREF(table[i].first);  // compared by identity
        for (int i = 0; i < reduceOpCount; ++i) Py_DECREF(reduceOps[i].first);
        reduceOps = table;
        reduceOpCount = count;
      },
      py::arg("ops"), "The (ReduceOp.RedOpType object, its value) pairs the direct calls accept.");
  m.def(
      "_fast_handle_devices",
      [](const py::object& capsule) {
        std::vector<std::string> out;
        if (!PyCapsule_CheckExact(capsule.ptr())) return out;
        auto* handle = static_cast<Handle*>(PyCapsule_GetPointer(capsule.ptr(), kHandleName));
        if (handle == nullptr) {
          PyErr_Clear();
          return out;
        }
        out.push_back("cpu");
        if (handle->servesCuda) out.push_back("cuda");
        return out;
      },
      py::arg("handle"), "The device types a direct-call handle serves (for tests).");
  m.def(
      "_fast_calls_taken", [] { return callsTaken; },
      "How many direct calls this thread made (for tests).");
  PyModule_AddFunctions(m.ptr(), methods);
}

}  // namespace tpcomm::python
