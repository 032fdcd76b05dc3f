"""Calls that torch.distributed refuses before they reach the backend.

torch's Python functions check some arguments themselves (a scatter list on
a rank that is not the source, a tensor list of the wrong type, an object
list that is not a list, a group rank out of range) and raise before the
call reaches any backend, or after part of it (an object collective whose
pickling fails between its two broadcasts). On a tpcomm group the peers
that made the call would then wait for this rank until the group's timeout.
So such an error on a tpcomm group is reported to the group: a collective
takes its number in the group's sequence as refused
(``ProcessGroupTpcomm._refuse``): a peer that made it raises within a
second naming this rank, the call and the error, a peer that refused the
same call breaks nothing; a point-to-point call (send, recv, isend, irecv,
the object sends) breaks the group (``ProcessGroupTpcomm._refuse_p2p``),
since its one peer waits in a call of its own. The error raised here is the
original one, unchanged; an error tpcomm raised itself (its calls tell the
peers themselves) is not reported again.

How the errors are seen, without a cost on calls that succeed:

- torch wraps each of its functions in an error logger
  (``c10d_logger._exception_logger``) whose error path looks up
  ``c10d_logger._get_msg_dict`` when it runs. tpcomm puts its report in
  front of that function: every logged function is covered, also when the
  program imported it before tpcomm (``from torch.distributed import
  broadcast``: the autoload path imports tpcomm after the program's own
  imports), and a call that succeeds never runs it;
- the functions torch does not log (``all_reduce_coalesced``,
  ``all_gather_coalesced``, ``isend``, ``irecv``, ``batch_isend_irecv``) are
  wrapped (one Python frame per call) where ``torch.distributed`` holds
  them; names imported before tpcomm keep torch's function.

torch.compile traces a wrapper as the function it wraps
(``traceable_collective_remaps`` maps both alike).
"""

import functools
import inspect
import sys
import types

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tpcomm import _C, _hooks

# The functions torch does not wrap in its error logger: wrapped here.
_COLLECTIVES = ("all_reduce_coalesced", "all_gather_coalesced")
_P2P_WRAPPED = ("isend", "irecv", "batch_isend_irecv")
# Point-to-point functions: a refusal breaks the group (its peer waits in a
# call of its own, not in the collective sequence).
_P2P = frozenset(("send", "recv", "isend", "irecv", "batch_isend_irecv", "send_object_list",
                  "recv_object_list"))
# Logged functions that are no calls on a group.
_NOT_CALLS = frozenset(("init_process_group", "new_group", "destroy_process_group"))


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


def _tpcomm_own(error):
    """Whether tpcomm raised `error` (its calls tell the peers themselves)."""
    return str(error).startswith("tpcomm: ")


def report_refusal(name, group, error, calls_before=None):
    """Tells the peers of `group` (None: the default group) that this rank
    refused the call `name` with `error`, unless the call reached tpcomm
    (which told them itself: the thread's tpcomm calls moved past
    `calls_before`, or tpcomm raised it), the error was reported already
    (an error passes through several wrappers) or the group is not a tpcomm
    group."""
    if getattr(error, "_tpcomm_reported", False):
        return
    try:
        error._tpcomm_reported = True
    except AttributeError:
        pass
    if calls_before is not None and _C._calls_on_this_thread() != calls_before:
        return  # the call reached tpcomm, which told the peers itself
    if _tpcomm_own(error):
        return
    try:
        backend = _tpcomm_backend(group)
        if backend is None:
            return
        why = f"{type(error).__name__}: {error}"
        if name in _P2P:
            backend._refuse_p2p(name, why)
        else:
            backend._refuse(name, why)
    except Exception:  # noqa: BLE001 - the caller gets its own error, unchanged
        pass


def _report(name, signature, args, kwargs, error, calls_before):
    """Tells the group's peers that this rank refused the call `name`."""
    try:
        bound = signature.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        if name == "batch_isend_irecv":
            ops = bound.arguments.get("p2p_op_list") or []
            group = getattr(ops[0], "group", None) if ops else None
    except (TypeError, IndexError, KeyError):
        group = None  # a call torch could not even bind: the default group's
    report_refusal(name, group, error, calls_before)


# name -> inspect.Signature of torch's function (the logger hook's).
_signatures = {}


def _signature_of(name):
    sig = _signatures.get(name)
    if sig is None:
        sig = inspect.signature(getattr(c10d, name))
        _signatures[name] = sig
    return sig


def _logged_error(func_name, args, kwargs):
    """The error path of torch's error logger, for the call `func_name`:
    the error being handled is reported to its group."""
    if func_name in _NOT_CALLS:
        return
    error = sys.exc_info()[1]
    if error is None or getattr(error, "_tpcomm_reported", False):
        return
    try:
        signature = _signature_of(func_name)
    except (AttributeError, TypeError, ValueError):
        return
    _report(func_name, signature, args, kwargs, error, None)


def _logger_problem(logger):
    """Empty when torch's error logger looks up `_get_msg_dict` on its error
    path as the hook expects, else what differs."""
    if not callable(getattr(logger, "_get_msg_dict", None)):
        return "torch.distributed.c10d_logger has no _get_msg_dict"
    decorator = getattr(logger, "_exception_logger", None)
    if decorator is None:
        return "torch.distributed.c10d_logger has no _exception_logger"
    inner = [c for c in decorator.__code__.co_consts if hasattr(c, "co_names")]
    if not any("_get_msg_dict" in c.co_names for c in inner):
        return "torch's error logger does not call _get_msg_dict"
    return ""


def _logged_names(logger):
    """The functions of torch.distributed wrapped in its error logger."""
    inner = [c for c in logger._exception_logger.__code__.co_consts if hasattr(c, "co_names")]
    names = []
    for name, fn in list(vars(c10d).items()):  # not getattr: deprecated names warn
        code = fn.__code__ if type(fn) is types.FunctionType else None
        if code is not None and code in inner and name not in _NOT_CALLS:
            names.append(name)
    return names


def _hook_logger():
    """Puts the report in front of torch's error logger's _get_msg_dict.
    Returns (number of functions it covers, or None, why not)."""
    from torch.distributed import c10d_logger

    why = _logger_problem(c10d_logger)
    if why:
        return None, why
    original = c10d_logger._get_msg_dict
    if getattr(original, "_tpcomm_wrapped", False):
        return len(_logged_names(c10d_logger)), ""

    @functools.wraps(original)
    def _get_msg_dict(func_name, *args, **kwargs):
        try:
            _logged_error(func_name, args, kwargs)
        except Exception:  # noqa: BLE001 - torch's own logging goes on
            pass
        return original(func_name, *args, **kwargs)

    _get_msg_dict._tpcomm_wrapped = True
    c10d_logger._get_msg_dict = _get_msg_dict
    return len(_logged_names(c10d_logger)), ""


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


def ground_problem(module, name, argument="group"):
    """Empty when `module` (torch.distributed.distributed_c10d) has the
    function `name` as the front door expects (a Python function with the
    argument that names its group: `group`, or batch_isend_irecv's
    `p2p_op_list`), else what differs."""
    original = getattr(module, name, None)
    if original is None:
        return f"torch.distributed has no {name}"
    try:
        parameters = inspect.signature(original).parameters
    except (TypeError, ValueError):
        return f"torch.distributed.{name} has no signature"
    if argument not in parameters:
        return f"torch.distributed.{name} has no {argument} argument"
    return ""


def install():
    """Hooks torch's error logger and wraps the functions it does not log,
    once; calling it again does nothing. A part torch lays out otherwise
    (_logger_problem, ground_problem) is left as it is, and tpcomm's hooks
    say which and why."""
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
    logged, logger_why = _hook_logger()
    unwrapped = []
    for name in (*_COLLECTIVES, *_P2P_WRAPPED):
        original = getattr(c10d, name, None)
        why = ground_problem(c10d, name, "p2p_op_list" if name == "batch_isend_irecv" else "group")
        if why:
            unwrapped.append(why)
            continue
        wrapped = _wrap(name.lstrip("_"), original)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapped)
        if original in traceable_collective_remaps:
            traceable_collective_remaps[wrapped] = traceable_collective_remaps[original]
    wrapped_count = len(_COLLECTIVES) + len(_P2P_WRAPPED) - len(unwrapped)
    parts = []
    if logged is not None:
        parts.append(f"{logged} functions through torch's error logger")
    if wrapped_count:
        parts.append(f"{wrapped_count} wrapped")
    problems = ([logger_why] if logger_why else []) + unwrapped
    if not parts:
        _hooks.set_status("front_door",
                          f"off: {'; '.join(problems)}; refusals before tpcomm reach no peer")
    elif problems:
        _hooks.set_status("front_door", f"on ({', '.join(parts)}); off for the rest: "
                                        f"{'; '.join(problems)}")
    else:
        _hooks.set_status("front_door", f"on ({', '.join(parts)})")
