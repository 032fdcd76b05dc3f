"""tpcomm: a torch.distributed backend for tensor-parallel inference and training.

``import tpcomm`` registers the backend ``"tpcomm"`` once; then

    torch.distributed.init_process_group(backend="tpcomm")

serves CPU tensors through Gloo and CUDA tensors through NCCL (created only
when the first CUDA tensor arrives), except CUDA allreduces that the routing
table sends to tpcomm's peer-to-peer kernel (tpcomm.describe() shows the
table; tpcomm.graph_capture() adds its zero-copy mode for CUDA graphs). `tpcomm.GroupCoordinator` and
`tpcomm.initialize_model_parallel` give tensor-parallel servers vLLM's
group API over it.
"""

import torch
import torch.distributed  # registers c10d's Python types before our extension loads

from tpcomm._version import __version__


def _check_build_torch(built, running):
    """Refuses a torch other than the one the extension was compiled
    against: its C++ ABI is that version's alone (loading it elsewhere fails
    with an undefined symbol at best)."""
    if built is not None and built != running:
        raise ImportError(
            f"tpcomm {__version__} was compiled against torch {built}, but this environment has "
            f"torch {running}: rebuild tpcomm against it (pip install --no-build-isolation "
            f"--no-deps --force-reinstall <tpcomm source or sdist>; --no-deps keeps this torch)")


try:
    from tpcomm._build_torch import TORCH_VERSION as _BUILD_TORCH
except ImportError:  # a source tree that was never built
    _BUILD_TORCH = None
_check_build_torch(_BUILD_TORCH, torch.__version__)

from tpcomm import _C, _hooks, _ops  # noqa: E402
from tpcomm._registration import BACKEND_NAME, _backend_of, register  # noqa: E402
from tpcomm.message_queue import MessageQueue, PeerLostError

register()
_ops.register_ops()

from tpcomm._graphs import all_reduce_into, graph_capture  # noqa: E402
from tpcomm.coordinator import GraphCaptureContext, GroupCoordinator  # noqa: E402
from tpcomm.parallel_state import (  # noqa: E402
    cleanup_dist_env_and_memory, destroy_distributed_environment, destroy_model_parallel,
    ensure_model_parallel_initialized, get_dcp_group, get_dcp_world_size_and_rank,
    get_dp_group, get_engram_dp_group, get_engram_dp_size, get_ep_group, get_eplb_group,
    get_inner_dp_world_group, get_node_count, get_pcp_group, get_pipeline_model_parallel_rank,
    get_pipeline_model_parallel_world_size, get_pp_group, get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size, get_tp_group, get_world_group, in_the_same_node_as,
    init_distributed_environment, init_model_parallel_group, init_world_group,
    initialize_model_parallel, is_global_first_rank, is_local_first_rank,
    model_parallel_is_initialized, model_parallel_layout, tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce, tensor_model_parallel_gather,
    tensor_model_parallel_reduce_scatter)


def settings():
    """Every TPCOMM_* setting as (name, type, default, doc) tuples."""
    return list(_C.settings())


def build_info():
    """The CUDA version and SM architectures this build's kernels target, and
    which of torch's newest backend capabilities it offers
    (``torch_capabilities``: name -> on; docs/torch_capabilities.md)."""
    info = dict(_C.build_info())
    info["torch_capabilities"] = dict(info["torch_capabilities"])
    return info


def stats(group=None):
    """This rank's calls and bytes per route of a tpcomm group (default: the
    world; a GroupCoordinator means its device group):
    {"gloo": {"calls": n, "bytes": b}, "custom_oneshot": ..., "custom_twoshot": ...,
    "nccl": ...}."""
    return dict(_backend_of(group).stats())


def describe(group=None):
    """A tpcomm group's configuration (default: the world): group name, rank,
    world size, backends, whether the custom allreduce is available and if
    not why, the CUDA allreduce routing table in force, and whether each of
    tpcomm's hooks into torch's internals is on (``torch_hooks``: name ->
    "on (...)" or "off: <why>")."""
    out = dict(_backend_of(group).describe())
    out["torch_hooks"] = torch_hooks()
    return out


def torch_hooks():
    """Whether each of tpcomm's hooks into torch's internals found torch laid
    out as it expects: name -> "on (...)" or "off: <why>" (an "off" hook's
    calls take torch's own route; see tpcomm._hooks)."""
    return _hooks.statuses()


def reset_custom_allreduce(group=None):
    """Collective (every rank of the group): makes the group's custom CUDA
    allreduce usable again after a failure. Until then a failed call (a peer
    that did not arrive) poisons the group: its queued kernels and graph
    replays stop at once, and its next calls raise. Every rank synchronises
    its GPU, then the kernel's flags are zeroed between two barriers."""
    _backend_of(group).reset_custom_allreduce()


def set_cpu_shm_cpus(cpus):
    """The CPUs this process's shared-memory groups set up from now on may use
    ("0-7,16-23", or a list of ints; "" or None: back to TPCOMM_CPU_SHM_CPUS or
    the setting-up thread's affinity mask). Each rank's share of them holds its
    worker threads (one pinned to each CPU) and decides the NUMA node its part
    of the group's memory is bound to: for a process whose main thread an
    OpenMP runtime pinned to one core of its list."""
    if cpus is None:
        cpus = ""
    elif not isinstance(cpus, str):
        cpus = ",".join(str(int(c)) for c in cpus)
    _C.set_cpu_shm_cpus(cpus)


def reset_stats(group=None):
    """Sets the group's route counters on this rank back to zero."""
    _backend_of(group).reset_stats()


__all__ = [
    "BACKEND_NAME", "GraphCaptureContext", "GroupCoordinator", "MessageQueue", "PeerLostError",
    "all_reduce_into", "build_info", "cleanup_dist_env_and_memory", "describe",
    "destroy_distributed_environment", "destroy_model_parallel",
    "ensure_model_parallel_initialized", "get_dcp_group", "get_dcp_world_size_and_rank",
    "get_dp_group", "get_engram_dp_group", "get_engram_dp_size", "get_ep_group",
    "get_eplb_group", "get_inner_dp_world_group", "get_node_count", "get_pcp_group",
    "get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_world_size", "get_pp_group",
    "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size", "get_tp_group",
    "get_world_group", "graph_capture", "in_the_same_node_as", "init_distributed_environment",
    "init_model_parallel_group", "init_world_group", "initialize_model_parallel",
    "is_global_first_rank", "is_local_first_rank", "model_parallel_is_initialized",
    "model_parallel_layout", "register", "reset_custom_allreduce", "reset_stats", "set_cpu_shm_cpus",
    "settings",
    "stats", "tensor_model_parallel_all_gather", "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_gather", "tensor_model_parallel_reduce_scatter", "torch_hooks"]
