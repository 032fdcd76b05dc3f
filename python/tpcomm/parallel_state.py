"""Model-parallel groups laid out as vLLM lays them out.

    tpcomm.init_distributed_environment()            # or an initialised default group
    tpcomm.initialize_model_parallel(tensor_model_parallel_size=2,
                                     pipeline_model_parallel_size=2)
    tp, pp = tpcomm.get_tp_group(), tpcomm.get_pp_group()

The world's ranks are arranged as vLLM 0.33 arranges them, [outer, data,
pipeline, prefill context, tensor] (tensor fastest): a tensor-parallel group
is `tp` consecutive ranks; a decode-context-parallel group `dcp` ranks of the
prefill-context x tensor block, prefill context first (with pcp 1: `dcp`
consecutive ranks, splitting a tensor-parallel group); a
prefill-context-parallel, pipeline or data-parallel group takes one rank per
index of its dimension with the others fixed; the expert-parallel group spans
data x prefill context x tensor. The tensor-parallel group has a
message-queue broadcaster.

The names, signatures and meanings are vLLM 0.33's `vllm.distributed.
parallel_state` (docs/vllm.md lists each, and what does not apply).
"""

import gc
import os
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm import _expert_parallel, _ops, coordinator as _coordinator
from tpcomm._registration import BACKEND_NAME
from tpcomm.coordinator import GroupCoordinator

_WORLD = None
_INNER_DP_WORLD = None
_NODE_COUNT = None
_TP = None
_DCP = None
_PCP = None
_PP = None
_DP = None
_EP = None
_EPLB = None
# The expert-parallel dispatch (_expert_parallel.moe_group) reads the groups
# made here through this.
_expert_parallel.parallel_groups(lambda: (_EP, _DP, _PCP))


def init_distributed_environment(world_size=-1, rank=-1, distributed_init_method="env://",
                                 local_rank=-1, backend=BACKEND_NAME, timeout=None):
    """Initialises torch.distributed if needed and makes the world group."""
    global _WORLD
    if not dist.is_initialized():
        kwargs = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
        dist.init_process_group(backend, init_method=distributed_init_method,
                                world_size=world_size, rank=rank, **kwargs)
    global _NODE_COUNT
    if local_rank == -1:
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    if _WORLD is None:
        _WORLD = init_world_group(list(range(dist.get_world_size())), local_rank, backend)
        _NODE_COUNT = _node_count(_WORLD.cpu_group)
    elif _WORLD.world_size != dist.get_world_size():
        raise RuntimeError(f"the world group has {_WORLD.world_size} ranks but torch.distributed "
                           f"has {dist.get_world_size()}")
    return _WORLD


def init_world_group(ranks, local_rank, backend):
    """The world's coordinator over `ranks` (every rank calls it)."""
    return GroupCoordinator([list(ranks)], local_rank, backend, use_device_communicator=False,
                            group_name="world")


def init_model_parallel_group(group_ranks, local_rank, backend,
                              use_message_queue_broadcaster=False, group_name=None,
                              use_device_communicator=True, use_all2all=False, device=None):
    """A coordinator over `group_ranks` (every rank calls it). tpcomm's
    dispatch and combine need no all-to-all manager: `use_all2all` is
    accepted and changes nothing."""
    return GroupCoordinator(group_ranks, local_rank, backend,
                            use_device_communicator=use_device_communicator,
                            use_message_queue_broadcaster=use_message_queue_broadcaster,
                            group_name=group_name, device=device)


def get_world_group():
    if _WORLD is None:
        raise RuntimeError("the world group is not initialised: call "
                           "tpcomm.init_distributed_environment()")
    return _WORLD


def get_inner_dp_world_group():
    """The ranks of this rank's data-parallel replica (consecutive blocks of
    world / data_parallel_size); the world group when there is one replica."""
    return _INNER_DP_WORLD if _INNER_DP_WORLD is not None else get_world_group()


def _layout(world_size, tp, pp, dp, pcp=1, dcp=1):
    for name, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                       ("data_parallel_size", dp), ("prefill_context_model_parallel_size", pcp),
                       ("decode_context_model_parallel_size", dcp)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}")
    if world_size % (tp * pp * dp * pcp):
        raise ValueError(f"world size {world_size} is not a multiple of tensor ({tp}) x pipeline "
                         f"({pp}) x data ({dp}) x prefill context ({pcp}) parallel sizes")
    if (tp * pcp) % dcp:
        raise ValueError(f"decode_context_model_parallel_size {dcp} does not divide "
                         f"tensor ({tp}) x prefill context ({pcp}) parallel sizes (a "
                         "decode-context group splits that block)")
    return torch.arange(world_size).reshape(-1, dp, pp, pcp, tp)


def model_parallel_layout(world_size, tensor_model_parallel_size=1,
                          pipeline_model_parallel_size=1, data_parallel_size=1,
                          prefill_context_model_parallel_size=1,
                          decode_context_model_parallel_size=1):
    """The rank lists of each kind of group: {"tp": [...], "pp": [...], "dp",
    "ep", "dcp", "pcp", "inner_dp_world"}."""
    tp, pp, dp = (tensor_model_parallel_size, pipeline_model_parallel_size, data_parallel_size)
    pcp, dcp = prefill_context_model_parallel_size, decode_context_model_parallel_size or 1
    ranks = _layout(world_size, tp, pp, dp, pcp, dcp)
    inner = tp * pp * pcp  # one data-parallel replica's ranks

    def groups(t, size):
        return [g.tolist() for g in t.reshape(-1, size).unbind(0)]

    return {
        "tp": groups(ranks, tp),
        # Spans prefill context first, then tensor (vLLM 0.33).
        "dcp": groups(ranks.transpose(-1, -2) if dcp > 1 else ranks, dcp),
        "pcp": groups(ranks.transpose(3, 4), pcp),
        "pp": groups(ranks.transpose(2, 4), pp),
        "dp": groups(ranks.transpose(1, 4), dp),
        "ep": groups(ranks.transpose(1, 2), dp * pcp * tp),
        "inner_dp_world": [list(range(d * inner, (d + 1) * inner))
                           for d in range(world_size // inner)],
    }


def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              prefill_context_model_parallel_size=1,
                              decode_context_model_parallel_size=1, backend=None,
                              data_parallel_size=1, device=None, enable_eplb=False):
    """Makes the tensor-, decode-context-, prefill-context-, pipeline-, data-
    and expert-parallel groups (and, with `enable_eplb`, the expert load
    balancer's group: the expert-parallel ranks on a communicator of their
    own), as vLLM 0.33 lays them out; positional arguments in vLLM's order.
    Every rank calls it with the same sizes. Makes the world group first if
    needed."""
    global _TP, _DCP, _PCP, _PP, _DP, _EP, _EPLB, _INNER_DP_WORLD
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed to be initialised "
                           "(tpcomm.init_distributed_environment)")
    if _TP is not None:
        raise RuntimeError("model parallel groups are already initialised; call "
                           "destroy_model_parallel() first")
    layout = model_parallel_layout(dist.get_world_size(), tensor_model_parallel_size,
                                   pipeline_model_parallel_size, data_parallel_size,
                                   prefill_context_model_parallel_size,
                                   decode_context_model_parallel_size)
    world = _WORLD or init_distributed_environment()
    backend = backend or dist.get_backend()
    local = world.local_rank

    def make(name, mq=False):
        return init_model_parallel_group(layout[name], local, backend,
                                         use_message_queue_broadcaster=mq, group_name=name,
                                         device=device)

    _TP = make("tp", mq=True)
    _DCP = make("dcp", mq=True)
    _PCP = make("pcp")
    _PP = make("pp")
    _DP = make("dp")
    _EP = make("ep")
    _EPLB = (init_model_parallel_group(layout["ep"], local, backend, group_name="eplb",
                                       device=device) if enable_eplb else None)
    _INNER_DP_WORLD = (init_model_parallel_group(layout["inner_dp_world"], local, backend,
                                                 use_message_queue_broadcaster=True,
                                                 group_name="inner_dp_world",
                                                 use_device_communicator=False, device=device)
                       if data_parallel_size > 1 else None)


def ensure_model_parallel_initialized(tensor_model_parallel_size, pipeline_model_parallel_size,
                                      prefill_context_model_parallel_size=1,
                                      decode_context_model_parallel_size=1, backend=None):
    """Initialises the groups, or checks that the existing ones have these sizes."""
    if _TP is None:
        initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size,
                                  prefill_context_model_parallel_size,
                                  decode_context_model_parallel_size, backend)
        return
    have = (_TP.world_size, _PP.world_size, _PCP.world_size, _DCP.world_size)
    want = (tensor_model_parallel_size, pipeline_model_parallel_size,
            prefill_context_model_parallel_size, decode_context_model_parallel_size or 1)
    if have != want:
        raise RuntimeError(f"model parallel groups exist with (tp, pp, pcp, dcp) = {have}, "
                           f"not {want}")


def model_parallel_is_initialized():
    return _TP is not None and _PP is not None


def _get(group, name):
    if group is None:
        raise RuntimeError(f"the {name} group is not initialised: call "
                           "tpcomm.initialize_model_parallel()")
    return group


def get_tp_group():
    return _get(_TP, "tensor model parallel")


def get_pp_group():
    return _get(_PP, "pipeline model parallel")


def get_dp_group():
    return _get(_DP, "data parallel")


def get_ep_group():
    return _get(_EP, "expert parallel")


def get_eplb_group():
    return _get(_EPLB, "expert load balancing (initialize_model_parallel(enable_eplb=True))")


def get_dcp_group():
    return _get(_DCP, "decode context parallel")


def get_pcp_group():
    return _get(_PCP, "prefill context parallel")


def get_dcp_world_size_and_rank(enabled=True):
    """(world size, rank) in the decode-context-parallel group; (1, 0) when
    not `enabled` or the group is not made."""
    if not enabled or _DCP is None:
        return 1, 0
    return _DCP.world_size, _DCP.rank_in_group


def get_engram_dp_group():
    """None: tpcomm makes no engram data-parallel group (every replica holds
    a whole embedding table, vLLM's meaning of None)."""
    return None


def get_engram_dp_size():
    return 1


def get_tensor_model_parallel_world_size():
    return get_tp_group().world_size


def get_tensor_model_parallel_rank():
    return get_tp_group().rank_in_group


def get_pipeline_model_parallel_world_size():
    return get_pp_group().world_size


def get_pipeline_model_parallel_rank():
    return get_pp_group().rank_in_group


def tensor_model_parallel_all_reduce(input_):
    return get_tp_group().all_reduce(input_)


def tensor_model_parallel_all_gather(input_, dim=-1):
    return get_tp_group().all_gather(input_, dim)


def tensor_model_parallel_reduce_scatter(input_, dim=-1):
    return get_tp_group().reduce_scatter(input_, dim)


def tensor_model_parallel_gather(input_, dst=0, dim=-1):
    return get_tp_group().gather(input_, dst, dim)


def destroy_model_parallel():
    """Destroys the model-parallel groups (every kind initialize_model_parallel
    made)."""
    global _TP, _DCP, _PCP, _PP, _DP, _EP, _EPLB, _INNER_DP_WORLD
    for group in (_TP, _DCP, _PCP, _PP, _DP, _EP, _EPLB, _INNER_DP_WORLD):
        if group is not None:
            group.destroy()
    _TP = _DCP = _PCP = _PP = _DP = _EP = _EPLB = _INNER_DP_WORLD = None


def destroy_distributed_environment():
    """Destroys the model-parallel groups and the world group (not the
    default process group, which its creator owns)."""
    global _WORLD, _NODE_COUNT
    destroy_model_parallel()
    if _WORLD is not None:
        _WORLD.destroy()
    _WORLD = _NODE_COUNT = None


def cleanup_dist_env_and_memory(shutdown_ray=False):
    """Destroys the groups (destroy_distributed_environment), then the
    default process group (whoever made it, as vLLM's does), and collects
    garbage and the CUDA cache. With `shutdown_ray`, Ray is shut down (an
    ImportError without Ray)."""
    destroy_distributed_environment()
    if dist.is_initialized():
        dist.destroy_process_group()
    if shutdown_ray:
        import ray

        ray.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -------------------------------------------------------------- nodes and ranks
def in_the_same_node_as(pg, source_rank=0):
    """Collective over `pg` (a process group or a GroupCoordinator): for each
    group rank, whether it shares this host's memory with group rank
    `source_rank` (tpcomm's host identity: boot id and IPC namespace, the
    test its shared-memory routes use)."""
    from tpcomm import _C

    if isinstance(pg, GroupCoordinator):
        pg = pg.cpu_group
    n = dist.get_world_size(pg)
    if not isinstance(source_rank, int) or not 0 <= source_rank < n:
        raise ValueError(f"in_the_same_node_as: source_rank {source_rank!r} is not a rank of a "
                         f"group of {n}")
    hosts = [None] * n
    dist.all_gather_object(hosts, _C.host_id(), group=pg)
    return [h == hosts[source_rank] for h in hosts]


def _node_count(pg):
    hosts = [None] * dist.get_world_size(pg)
    from tpcomm import _C

    dist.all_gather_object(hosts, _C.host_id(), group=pg)
    return len(set(hosts))


def get_node_count():
    """How many hosts the world spans (counted by init_distributed_environment)."""
    if _NODE_COUNT is None:
        raise RuntimeError("the distributed environment is not initialised: call "
                           "tpcomm.init_distributed_environment()")
    return _NODE_COUNT


def is_global_first_rank():
    """Whether this is the world's rank 0 (True without torch.distributed)."""
    if _WORLD is not None:
        return _WORLD.is_first_rank
    return not dist.is_initialized() or dist.get_rank() == 0


def is_local_first_rank():
    """Whether this is its host's first rank: local rank 0 (True without
    torch.distributed)."""
    if _WORLD is not None:
        return _WORLD.local_rank == 0
    if not dist.is_initialized():
        return True
    return int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0


# -------------------------------------------------------------- by group name
def all_reduce(tensor, group_name):
    """The coordinator named `group_name`'s all_reduce (out of place), as
    torch.ops.tpcomm.all_reduce."""
    return torch.ops.tpcomm.all_reduce(tensor, group_name)


def all_gather(tensor, dim, world_size, group_name):
    return torch.ops.tpcomm.all_gather(tensor, dim, world_size, group_name)


def reduce_scatter(tensor, dim, world_size, group_name):
    return torch.ops.tpcomm.reduce_scatter(tensor, dim, world_size, group_name)


# The ops' shapes without running them (torch.compile's fake tensors).
all_reduce_fake = _ops._all_reduce_fake
all_gather_fake = _ops._all_gather_fake
reduce_scatter_fake = _ops._reduce_scatter_fake


def set_custom_all_reduce(enable):
    """Whether coordinators made after this call may send CUDA allreduces
    to tpcomm's custom kernel (True, the default: by size, as routed) or to
    NCCL alone (False: their route mode becomes "nccl")."""
    _coordinator.custom_all_reduce_enabled = bool(enable)


@contextmanager
def graph_capture(device):
    """CUDA graph capture over the tensor- and pipeline-parallel groups: one
    side stream on `device`, both groups' captures nested (their custom
    allreduces read their inputs in place after the context exits)."""
    from tpcomm.coordinator import GraphCaptureContext

    if not torch.cuda.is_available():
        raise RuntimeError("graph_capture needs CUDA; this process has no GPU")
    context = GraphCaptureContext(torch.cuda.Stream(device=device))
    with get_tp_group().graph_capture(context), get_pp_group().graph_capture(context):
        yield context
