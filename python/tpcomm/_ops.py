"""torch custom ops over GroupCoordinators, so that torch.compile traces
through tensor-parallel collectives.

Dynamo cannot pass a Python object such as a GroupCoordinator into an op, so
each op takes the coordinator's unique name (a string) and looks it up in a
registry of live coordinators. Every op is out of place (custom ops may not
both mutate an input and return a new tensor) and has a fake implementation
that gives the output's shape and dtype without communicating.

CPU tensors run the ops' C++ kernels (python/register_ops.cpp), which look
the name up in a C++ registry and call the group's tpcomm backend directly;
CUDA tensors run the Python kernels below (the custom kernel's route).

    torch.ops.tpcomm.all_reduce(x, "tp:0")
    torch.ops.tpcomm.all_reduce_(x, "tp:0")  # in place, returns nothing
    torch.ops.tpcomm.all_gather(x, dim, world_size, "tp:0")
    torch.ops.tpcomm.reduce_scatter(x, dim, world_size, "tp:0")
    normed, residual_out = torch.ops.tpcomm.all_reduce_add_rms_norm(x, residual, weight, eps,
                                                                    "tp:0")
    normed = torch.ops.tpcomm.all_reduce_add_rms_norm_(x, residual, weight, eps, "tp:0")

Two are the exceptions to "out of place". all_reduce_ writes the sum into
`x` itself (declared as mutated in its schema, so torch.compile
functionalises it and, where `x` is a buffer of the graph's own, calls it in
place once inductor re-inplaces it): a compiled graph then allocates and
checks no output per call, about 3 us a call less than the out-of-place op
in a model step on 2 cores (python -m tpcomm.bench cpu --compiled).
all_reduce_add_rms_norm_ writes residual_out into `residual` and returns the
normed rows.
"""

import itertools
import threading
import weakref

import torch

from tpcomm import _C

_lock = threading.Lock()
_coordinators = {}  # unique name -> weakref to a GroupCoordinator
_name_counters = {}  # group name -> itertools.count


def unique_name(name):
    """`name` plus a per-process counter: "tp:0", "tp:1", ..."""
    with _lock:
        counter = _name_counters.setdefault(name, itertools.count())
        return f"{name}:{next(counter)}"


def register_coordinator(coordinator):
    with _lock:
        _coordinators[coordinator.unique_name] = weakref.ref(coordinator)
    _C.register_op_group(coordinator.unique_name, coordinator.device_group)


def unregister_coordinator(name):
    with _lock:
        _coordinators.pop(name, None)
    _C.unregister_op_group(name)


def lookup(name):
    with _lock:
        ref = _coordinators.get(name)
        coordinator = ref() if ref is not None else None
        if coordinator is None:
            known = sorted(k for k, r in _coordinators.items() if r() is not None)
            raise ValueError(f"no live tpcomm GroupCoordinator named {name!r} in this process "
                             f"(live: {known or 'none'})")
        return coordinator


def _gathered_shape(tensor, dim, world_size):
    shape = list(tensor.shape)
    shape[dim] *= world_size
    return shape


def _scattered_shape(tensor, dim, world_size):
    shape = list(tensor.shape)
    shape[dim] //= world_size
    return shape


def _all_reduce(tensor, group_name):
    return lookup(group_name)._all_reduce_out_place(tensor)


def _all_reduce_fake(tensor, group_name):
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _all_reduce_inplace(tensor, group_name):
    tensor.copy_(lookup(group_name)._all_reduce_out_place(tensor))


def _all_reduce_inplace_fake(tensor, group_name):
    return None


def _all_gather(tensor, dim, world_size, group_name):
    return lookup(group_name)._all_gather_out_place(tensor, dim)


def _all_gather_fake(tensor, dim, world_size, group_name):
    return tensor.new_empty(_gathered_shape(tensor, dim, world_size))


def _reduce_scatter(tensor, dim, world_size, group_name):
    return lookup(group_name)._reduce_scatter_out_place(tensor, dim)


def _reduce_scatter_fake(tensor, dim, world_size, group_name):
    return tensor.new_empty(_scattered_shape(tensor, dim, world_size))


def _all_reduce_add_rms_norm(tensor, residual, weight, eps, group_name):
    return lookup(group_name)._all_reduce_add_rms_norm_out(tensor, residual, weight, eps, None)


def _all_reduce_add_rms_norm_fake(tensor, residual, weight, eps, group_name):
    return (torch.empty_like(tensor, memory_format=torch.contiguous_format),
            torch.empty_like(residual, memory_format=torch.contiguous_format))


def _all_reduce_add_rms_norm_inplace(tensor, residual, weight, eps, group_name):
    normed, _ = lookup(group_name)._all_reduce_add_rms_norm_out(tensor, residual, weight, eps,
                                                                 residual)
    return normed


def _all_reduce_add_rms_norm_inplace_fake(tensor, residual, weight, eps, group_name):
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


_SCHEMAS = {
    "all_reduce": ("all_reduce(Tensor tensor, str group_name) -> Tensor", _all_reduce,
                   _all_reduce_fake),
    "all_reduce_": ("all_reduce_(Tensor(a!) tensor, str group_name) -> ()", _all_reduce_inplace,
                    _all_reduce_inplace_fake),
    "all_gather": ("all_gather(Tensor tensor, int dim, int world_size, str group_name) -> Tensor",
                   _all_gather, _all_gather_fake),
    "reduce_scatter": (
        "reduce_scatter(Tensor tensor, int dim, int world_size, str group_name) -> Tensor",
        _reduce_scatter, _reduce_scatter_fake),
    "all_reduce_add_rms_norm": (
        "all_reduce_add_rms_norm(Tensor tensor, Tensor residual, Tensor weight, float eps, "
        "str group_name) -> (Tensor, Tensor)",
        _all_reduce_add_rms_norm, _all_reduce_add_rms_norm_fake),
    "all_reduce_add_rms_norm_": (
        "all_reduce_add_rms_norm_(Tensor tensor, Tensor(a!) residual, Tensor weight, float eps, "
        "str group_name) -> Tensor",
        _all_reduce_add_rms_norm_inplace, _all_reduce_add_rms_norm_inplace_fake),
}

_library = None


def register_ops():
    """Defines the ops once per process (a reload of tpcomm does nothing)."""
    global _library
    if _library is not None or hasattr(torch.ops.tpcomm, "all_reduce"):
        return
    _library = torch.library.Library("tpcomm", "FRAGMENT")
    for name, (schema, impl, fake) in _SCHEMAS.items():
        _library.define(schema)
        _library.impl(name, impl, "CUDA")  # CPU: the C++ kernels
        torch.library.register_fake(f"tpcomm::{name}", fake, lib=_library)
    _C.register_op_cpu_kernels()
