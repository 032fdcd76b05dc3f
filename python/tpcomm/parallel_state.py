"""Model-parallel groups laid out as vLLM lays them out.

    tpcomm.init_distributed_environment()            # or an initialised default group
    tpcomm.initialize_model_parallel(tensor_model_parallel_size=2,
                                     pipeline_model_parallel_size=2)
    tp, pp = tpcomm.get_tp_group(), tpcomm.get_pp_group()

The world's ranks are arranged as [outer, data, pipeline, tensor] (tensor
fastest): a tensor-parallel group is `tp` consecutive ranks; a pipeline group
takes one rank per stage with the same tensor-parallel index; a data-parallel
group one rank per data replica; the expert-parallel group spans data x
tensor. The tensor-parallel group has a message-queue broadcaster.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._registration import BACKEND_NAME
from tpcomm.coordinator import GroupCoordinator

_WORLD = None
_TP = None
_PP = None
_DP = None
_EP = None


def init_distributed_environment(world_size=-1, rank=-1, distributed_init_method="env://",
                                 local_rank=-1, backend=BACKEND_NAME, timeout=None):
    """Initialises torch.distributed if needed and makes the world group."""
    global _WORLD
    if not dist.is_initialized():
        kwargs = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
        dist.init_process_group(backend, init_method=distributed_init_method,
                                world_size=world_size, rank=rank, **kwargs)
    if local_rank == -1:
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    if _WORLD is None:
        _WORLD = GroupCoordinator([list(range(dist.get_world_size()))], local_rank, backend,
                                  group_name="world")
    elif _WORLD.world_size != dist.get_world_size():
        raise RuntimeError(f"the world group has {_WORLD.world_size} ranks but torch.distributed "
                           f"has {dist.get_world_size()}")
    return _WORLD


def get_world_group():
    if _WORLD is None:
        raise RuntimeError("the world group is not initialised: call "
                           "tpcomm.init_distributed_environment()")
    return _WORLD


def _layout(world_size, tp, pp, dp):
    for name, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                       ("data_parallel_size", dp)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}")
    if world_size % (tp * pp * dp):
        raise ValueError(f"world size {world_size} is not a multiple of tensor ({tp}) x pipeline "
                         f"({pp}) x data ({dp}) parallel sizes")
    return torch.arange(world_size).reshape(-1, dp, pp, tp)


def model_parallel_layout(world_size, tensor_model_parallel_size=1,
                          pipeline_model_parallel_size=1, data_parallel_size=1):
    """The rank lists of each kind of group: {"tp": [...], "pp": [...], ...}."""
    ranks = _layout(world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                    data_parallel_size)
    tp, pp, dp = (tensor_model_parallel_size, pipeline_model_parallel_size, data_parallel_size)
    return {
        "tp": [g.tolist() for g in ranks.reshape(-1, tp).unbind(0)],
        "pp": [g.tolist() for g in ranks.transpose(2, 3).reshape(-1, pp).unbind(0)],
        "dp": [g.tolist() for g in ranks.transpose(1, 3).reshape(-1, dp).unbind(0)],
        "ep": [g.tolist() for g in ranks.transpose(1, 2).reshape(-1, dp * tp).unbind(0)],
    }


def initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              backend=None, data_parallel_size=1, device=None):
    """Makes the tensor-, pipeline-, data- and expert-parallel groups. Every
    rank calls it with the same sizes. Makes the world group first if needed."""
    global _TP, _PP, _DP, _EP
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs torch.distributed to be initialised "
                           "(tpcomm.init_distributed_environment)")
    if _TP is not None:
        raise RuntimeError("model parallel groups are already initialised; call "
                           "destroy_model_parallel() first")
    world = _WORLD or init_distributed_environment()
    backend = backend or dist.get_backend()
    layout = model_parallel_layout(dist.get_world_size(), tensor_model_parallel_size,
                                   pipeline_model_parallel_size, data_parallel_size)
    local = world.local_rank
    _TP = GroupCoordinator(layout["tp"], local, backend, use_message_queue_broadcaster=True,
                           group_name="tp", device=device)
    _PP = GroupCoordinator(layout["pp"], local, backend, group_name="pp", device=device)
    _DP = GroupCoordinator(layout["dp"], local, backend, group_name="dp", device=device)
    _EP = GroupCoordinator(layout["ep"], local, backend, group_name="ep", device=device)


def ensure_model_parallel_initialized(tensor_model_parallel_size,
                                      pipeline_model_parallel_size, backend=None):
    """Initialises the groups, or checks that the existing ones have these sizes."""
    if _TP is None:
        initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size,
                                  backend)
        return
    have = (_TP.world_size, _PP.world_size)
    want = (tensor_model_parallel_size, pipeline_model_parallel_size)
    if have != want:
        raise RuntimeError(f"model parallel groups exist with (tp, pp) = {have}, not {want}")


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
    """Destroys the tensor-, pipeline-, data- and expert-parallel groups."""
    global _TP, _PP, _DP, _EP
    for group in (_TP, _PP, _DP, _EP):
        if group is not None:
            group.destroy()
    _TP = _PP = _DP = _EP = None


def destroy_distributed_environment():
    """Destroys the model-parallel groups and the world group (not the
    default process group, which its creator owns)."""
    global _WORLD
    destroy_model_parallel()
    if _WORLD is not None:
        _WORLD.destroy()
    _WORLD = None
