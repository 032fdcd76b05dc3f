"""Registration of the "tpcomm" backend with torch.distributed."""

import functools
import numbers
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tpcomm import _C, _fast_calls, _front_door
from tpcomm._net import gloo_device_maker

BACKEND_NAME = "tpcomm"


def _backend_of(group):
    """The tpcomm backend object of `group`: a process group, a
    GroupCoordinator (its device group) or None (the world)."""
    if group is not None and not isinstance(group, dist.ProcessGroup) \
            and hasattr(group, "device_group"):
        group = group.device_group
    if group is None:
        group = dist.group.WORLD
    backend = group._get_backend(torch.device("cpu"))
    if not isinstance(backend, _C.ProcessGroupTpcomm):
        raise ValueError(f"group uses backend {dist.get_backend(group)!r}, not {BACKEND_NAME!r}")
    return backend


def _make_device_backend(store, rank, size, timeout):
    """The device backend (torch's ProcessGroupNCCL), made on the first CUDA call."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def _gloo_factory(make_devices):
    """Makes Gloo groups (store, rank, size, timeout), each on devices of its
    own from `make_devices`: the Gloo sub-groups of a group whose ranks sit
    on several hosts and of its splits, on the network interface of the
    group's own Gloo group."""
    def make(store, rank, size, timeout):
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = make_devices()
        return dist.ProcessGroupGloo(store, rank, size, opts)
    return make


def _create_backend(dist_opts, backend_options):
    """Creator called by init_process_group / new_group (extended API)."""
    rank, size = dist_opts.group_rank, dist_opts.group_size
    timeout = dist_opts.timeout
    if getattr(dist_opts, "enable_reconfigure", False) and _C.build_info()[
            "torch_capabilities"]["reconfigure"]:
        # torch's reconfigure regime: no member until dist._reconfigure
        # forms the group on this store (backend/reconfigure.cpp).
        device_factory = _make_device_backend if dist.is_nccl_available() else None
        return _C.ProcessGroupTpcomm._unformed(
            dist_opts.store, rank, size, timeout, dist_opts.group_id or "", device_factory,
            _gloo_factory(gloo_device_maker(dist_opts.store)))
    # Every key of the group (its Gloo group's rendezvous, its faults) under
    # the prefix of this life of the group: nothing of a group made earlier
    # under the same name on the same store reaches it.
    life = _C._agree_on_life(dist_opts.store, rank, size, timeout)
    store = dist.PrefixStore(f"tpcomm-life-{life}", dist_opts.store)
    try:
        make_devices = gloo_device_maker(store)
        cpu_store = dist.PrefixStore("cpu/", store)
        cpu = _gloo_factory(make_devices)(cpu_store, rank, size, timeout)
        device_factory = _make_device_backend if dist.is_nccl_available() else None
        pg = _C.ProcessGroupTpcomm(
            store, rank, size, timeout, dist_opts.group_id or "", cpu, device_factory,
            _gloo_factory(make_devices), life,
        )
        # The group's Gloo connections, told by the listening addresses its
        # ranks exchanged there, are shut down if the group breaks (abort, a
        # failure): the peers' Gloo calls then fail at once.
        pg._set_gloo_store(cpu_store)
        pg._set_global_ranks([int(r) for r in (dist_opts.global_ranks_in_group or range(size))])
    except BaseException as e:  # an interrupt too: the making failed on this rank
        # Every other rank raises it at once instead of waiting out the
        # timeout; this rank's Gloo group (`cpu`, if made) stays open until
        # every rank ended the making.
        _C._finish_making(store, rank, size, timeout, f"{type(e).__name__}: {e}")
        raise
    # Returned once every rank made its part: a rank that destroys the group
    # at once would otherwise close Gloo connections a slower peer is still
    # to take, failing that peer's making (coordinator/group_life.hpp).
    _C._finish_making(store, rank, size, timeout)
    return pg


def _patch_monitored_barrier():
    """Let tpcomm groups through torch's monitored_barrier front door.

    torch's Python wrapper refuses every backend but "gloo" by name, although
    the C++ call it makes works on any backend that implements it (ours hands
    it to its Gloo CPU group). Other backends still reach the original.
    """
    original = c10d.monitored_barrier
    if getattr(original, "_tpcomm_wrapped", False):
        return

    @functools.wraps(original)
    def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
        if c10d._rank_not_in_group(group) or c10d.get_backend(group) != BACKEND_NAME:
            return original(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)
        if timeout is None:
            timeout = c10d._get_default_timeout(BACKEND_NAME)
        elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
            # As torch's own wrapper: a number is seconds, with a warning.
            warnings.warn("Please specify timeout arg as a timedelta. Converting current value "
                          f"of {timeout} assuming it represents seconds", stacklevel=2)
            timeout = timedelta(seconds=timeout)
        c10d._check_valid_timeout(timeout)
        group_to_use = c10d._get_default_group() if group is None else group
        return group_to_use.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    monitored_barrier._tpcomm_wrapped = True
    c10d.monitored_barrier = monitored_barrier
    dist.monitored_barrier = monitored_barrier


def _patch_shrink_group():
    """A group shrunk from a tpcomm group serves every device its parent did.

    torch's shrink_group registers the new backend for one device only (the
    group's bound device, else the CPU), as fits a backend per device; a
    tpcomm backend serves CPU and CUDA tensors alike, so the shrunk group
    gets it for each of its parent's devices (its CUDA tensors would find
    no backend otherwise). Other backends' groups are as torch makes them.
    """
    original = getattr(c10d, "shrink_group", None)
    if original is None or getattr(original, "_tpcomm_wrapped", False):
        return

    @functools.wraps(original)
    def shrink_group(ranks_to_exclude, group=None, shrink_flags=0, pg_options=None):
        target = c10d._get_default_group() if group is None else group
        devices = []
        if not c10d._rank_not_in_group(target) and c10d.get_backend(target) == BACKEND_NAME:
            devices = list(target._device_types)
        shrunk = original(ranks_to_exclude, group=group, shrink_flags=shrink_flags,
                          pg_options=pg_options)
        have = set(shrunk._device_types)
        if devices and have:
            backend = shrunk._get_backend(next(iter(have)))
            for device in devices:
                if device not in have:
                    shrunk._register_backend(device, dist.ProcessGroup.BackendType.CUSTOM,
                                             backend)
        return shrunk

    shrink_group._tpcomm_wrapped = True
    c10d.shrink_group = shrink_group
    if hasattr(dist, "shrink_group"):
        dist.shrink_group = shrink_group


def _patch_flight_recorder_dumps():
    """torch's dump functions first rename the entries of tpcomm's own Gloo
    groups ("gloo:all_gather" of a set-up exchange, which torchfrtrace
    cannot read) as tpcomm's own dumps do."""
    module = torch._C._distributed_c10d
    for name in ("_dump_fr_trace", "_dump_fr_trace_json"):
        original = getattr(module, name, None)
        if original is None or getattr(original, "_tpcomm_wrapped", False):
            continue

        def dump(*args, _original=original, **kwargs):
            _C._fr_rename_internal()
            return _original(*args, **kwargs)

        functools.update_wrapper(dump, original)
        dump._tpcomm_wrapped = True
        setattr(module, name, dump)


def _declare_self_recording():
    """tpcomm records its calls in torch's flight recorder itself
    (backend/flight_record.hpp). torch 2.15 attaches a recording hook to every
    group whose backend is not in its set of backends that record themselves:
    on a tpcomm group that hook recorded each call a second time, into a
    recorder of its own that torch's default dump does not read, gathering a
    Python stack per call (about a tenth of a small send/recv's CPU time).
    Without that set (torch 2.11-2.14) there is no such hook."""
    backends = getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if isinstance(backends, set):
        backends.add(BACKEND_NAME)


def register():
    """Register backend "tpcomm" for cpu and cuda; calling it again does nothing."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(
            BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"]
        )
    _declare_self_recording()
    _patch_monitored_barrier()
    _patch_shrink_group()
    _front_door.install()
    _fast_calls.install()
    _patch_flight_recorder_dumps()
