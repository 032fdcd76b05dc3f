"""The direct route of ``torch.distributed.all_reduce`` to a tpcomm group.

torch's ``all_reduce`` reaches a backend through its Python checks,
``ProcessGroup.allreduce``'s binding and the dispatcher, about 2 us per call
before any byte moves (the shared-memory engine then takes 0.1-0.2 us at
world size 1). ``install()`` puts ``all_reduce`` below in torch.distributed's
place: a call on a plain CPU tensor of a group whose CPU backend
is tpcomm goes straight to that backend (``_C._fast_all_reduce``: the same
checks, routing, flight recording and fault handling as torch's route, which
ends in the same backend call), and so does one with ``async_op=True``,
which returns the backend's Work as torch's would. Every other call (another
backend, a CUDA tensor, a tensor subclass, a complex or grad-requiring
tensor, torch function or dispatch modes, a profiler, coalescing) goes
through torch's function unchanged.

torch's function also refuses some calls before they reach any backend (a
non-tensor argument): on a tpcomm group such a refusal is reported to the
group's peers, as the front door does for the other collectives
(``_front_door``), so their matching call raises instead of waiting.

torch.compile maps this function to the functional collective as it maps
torch's own (``traceable_collective_remaps``).
"""

import functools

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tpcomm import _C, _front_door

_ReduceOp = c10d.ReduceOp

# ProcessGroup -> its handle (a capsule), or False: the group's CPU backend is
# not tpcomm. Emptied when groups are destroyed (a handle holds its backend
# weakly: a stale one sends the call torch's way).
_handles = {}


def _handle_of(group):
    """The group's handle, remembered while torch knows the group (a destroyed
    one is never remembered: its calls take torch's route)."""
    handle = None
    try:
        if group in c10d._world.pg_map and not c10d._rank_not_in_group(group):
            handle = _C._fast_handle(group)
            _handles[group] = handle if handle is not None else False
    except Exception:  # noqa: BLE001 - not a group tpcomm serves: torch's route decides
        handle = None
    return handle


def _make_all_reduce(original):
    fast = _C._fast_all_reduce
    calls_on_this_thread = _C._calls_on_this_thread
    world = c10d._world
    coalescing = world.pg_coalesce_state
    handles = _handles

    @functools.wraps(original)
    def all_reduce(tensor, op=_ReduceOp.SUM, group=None, async_op=False):
        if not coalescing:
            pg = group if group is not None else world._default_pg
            try:
                handle = handles.get(pg)
            except TypeError:  # an unhashable group: torch's function says what is wrong
                handle = False
            if handle is None and pg is not None:
                handle = _handle_of(pg)
            if handle:
                result = fast(handle, tensor, op, async_op)
                if result is True:
                    return None
                if result is not False:
                    return result  # async_op's Work
        calls_before = calls_on_this_thread()
        try:
            return original(tensor, op, group, async_op)
        except Exception as error:
            _front_door.report_refusal("allreduce", group, error, calls_before)
            raise

    all_reduce._tpcomm_direct = original
    return all_reduce


def _make_destroy(original):
    @functools.wraps(original)
    def destroy_process_group(*args, **kwargs):
        _handles.clear()
        try:
            return original(*args, **kwargs)
        finally:
            _handles.clear()

    destroy_process_group._tpcomm_direct = original
    return destroy_process_group


def install():
    """Puts the direct all_reduce in torch.distributed's place (once); not on a
    torch whose internals it reads are laid out otherwise, nor with
    TPCOMM_DIRECT_CALLS=0."""
    if not _C._direct_calls_enabled():
        return
    if not hasattr(c10d._world, "_default_pg") or not hasattr(c10d._world, "pg_coalesce_state"):
        return
    _C._fast_set_ops([(op, int(op)) for op in (
        _ReduceOp.SUM, _ReduceOp.AVG, _ReduceOp.PRODUCT, _ReduceOp.MIN, _ReduceOp.MAX,
        _ReduceOp.BAND, _ReduceOp.BOR, _ReduceOp.BXOR)])
    try:
        from torch.distributed._functional_collectives import traceable_collective_remaps
    except ImportError:  # pragma: no cover - torch without functional collectives
        traceable_collective_remaps = {}
    for name, make in (("all_reduce", _make_all_reduce),
                       ("destroy_process_group", _make_destroy)):
        original = getattr(c10d, name)
        if hasattr(original, "_tpcomm_direct"):
            continue
        replacement = make(original)
        setattr(c10d, name, replacement)
        if getattr(dist, name, None) is original:
            setattr(dist, name, replacement)
        if original in traceable_collective_remaps:
            traceable_collective_remaps[replacement] = traceable_collective_remaps[original]


def calls_taken():
    """How many calls of this thread took the direct route (for tests)."""
    return _C._fast_calls_taken()
