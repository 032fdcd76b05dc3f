"""Collectives that torch.distributed refuses before they reach the backend.

torch's Python functions check some arguments themselves (a scatter list on
a rank that is not the source, a tensor list of the wrong type, a group rank
out of range) and raise before the call reaches any backend. On a tpcomm
group the peers that made the call would then wait for this rank until the
group's timeout. So each collective function of ``torch.distributed`` is
wrapped: when it raises before reaching tpcomm (tpcomm's own refusals tell
the peers themselves) on a tpcomm group, the group's backend is
told (``ProcessGroupTpcomm._refuse``; an error raised after the call reached
tpcomm, which counts its calls per thread, is tpcomm's own business), the call takes its number in the
group's sequence, and a peer that made it raises within a second naming this
rank, the call and the error; a peer that refused the same call breaks
nothing (see the README's "Faults" section). The error raised here is the
original one, unchanged.

The wrapper costs one Python call frame on the path that does not raise.
torch.compile traces it as the function it wraps
(``traceable_collective_remaps`` maps both alike).
"""

import functools
import inspect

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tpcomm import _C, _hooks

# The collectives of torch.distributed whose front door checks more than the
# argument's type: lists on the right ranks and of the right length, split
# sizes. all_reduce has a function of its own (_fast_calls), which reports
# refusals too. The other per-token calls (broadcast, all_gather_into_tensor,
# reduce_scatter_tensor, barrier), whose front door refuses only a
# non-tensor argument, are left unwrapped: a Python frame costs them about
# 0.1 us per call (python -m tpcomm.bench fr). Point-to-point calls are not
# refused group-wide: only their peer waits.
_COLLECTIVES = (
    "all_reduce_coalesced", "reduce", "all_gather", "all_gather_coalesced", "gather",
    "scatter", "reduce_scatter", "all_to_all", "all_to_all_single",
)


# install() ran (once per process).
_installed = False


def _tpcomm_backend(group):
    """The group's tpcomm backend, or None (another backend, not a member)."""
    if group is None:
        if not dist.is_initialized():
            return None
        group = c10d._get_default_group()
    if c10d._rank_not_in_group(group) or group.size() < 2:
        return None
    backend = group._get_backend(torch.device("cpu"))
    return backend if isinstance(backend, _C.ProcessGroupTpcomm) else None


def report_refusal(name, group, error, calls_before):
    """Tells the peers of `group` (None: the default group) that this rank
    refused the call `name` with `error`, unless the call reached tpcomm
    (which told them itself) or the group is not a tpcomm group."""
    if _C._calls_on_this_thread() != calls_before:
        return  # the call reached tpcomm, which told the peers itself
    try:
        backend = _tpcomm_backend(group)
        if backend is not None:
            backend._refuse(name, f"{type(error).__name__}: {error}")
    except Exception:  # noqa: BLE001 - the caller gets its own error, unchanged
        pass


def _report(name, signature, args, kwargs, error, calls_before):
    """Tells the group's peers that this rank refused the call `name`."""
    try:
        bound = signature.bind(*args, **kwargs)
        group = bound.arguments.get("group")
    except TypeError:
        group = None  # a call torch could not even bind: the default group's
    report_refusal(name, group, error, calls_before)


def _wrap(name, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def collective(*args, **kwargs):
        calls_before = _C._calls_on_this_thread()
        try:
            return original(*args, **kwargs)
        except Exception as error:
            _report(name, signature, args, kwargs, error, calls_before)
            raise

    collective._tpcomm_front_door = original
    return collective


def ground_problem(module, name):
    """Empty when `module` (torch.distributed.distributed_c10d) has the
    collective `name` as the front door expects (a Python function with a
    `group` argument), else what differs."""
    original = getattr(module, name, None)
    if original is None:
        return f"torch.distributed has no {name}"
    try:
        parameters = inspect.signature(original).parameters
    except (TypeError, ValueError):
        return f"torch.distributed.{name} has no signature"
    if "group" not in parameters:
        return f"torch.distributed.{name} has no group argument"
    return ""


def install():
    """Wraps torch.distributed's collectives once; calling it again does
    nothing. A collective that torch lays out otherwise (ground_problem) is
    left as it is, and tpcomm's hooks say which and why."""
    global _installed
    if _installed:
        return
    _installed = True
    try:
        from torch.distributed._functional_collectives import traceable_collective_remaps
    except ImportError:  # pragma: no cover - torch without functional collectives
        traceable_collective_remaps = {}
    # The group helpers every refusal report uses.
    for helper in ("_rank_not_in_group", "_get_default_group"):
        if not callable(getattr(c10d, helper, None)):
            _hooks.set_status("front_door", (
                f"off: torch.distributed has no {helper}; refusals before tpcomm reach no peer"))
            return
    unwrapped = []
    for name in _COLLECTIVES:
        original = getattr(c10d, name, None)
        why = ground_problem(c10d, name)
        if why:
            unwrapped.append(why)
            continue
        wrapped = _wrap(name.lstrip("_"), original)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)
        if original in traceable_collective_remaps:
            traceable_collective_remaps[wrapped] = traceable_collective_remaps[original]
    if not unwrapped:
        _hooks.set_status("front_door", f"on ({len(_COLLECTIVES)} collectives)")
    elif len(unwrapped) == len(_COLLECTIVES):
        _hooks.set_status("front_door", f"off: {'; '.join(unwrapped)}; refusals before tpcomm reach no peer")
    else:
        _hooks.set_status("front_door", (
            f"on ({len(_COLLECTIVES) - len(unwrapped)} of {len(_COLLECTIVES)} collectives); off for "
            f"the others: {'; '.join(unwrapped)}"))
