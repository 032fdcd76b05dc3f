"""The direct route of ``torch.distributed.all_reduce`` to a tpcomm group.

torch's ``all_reduce`` reaches a backend through its Python checks,
``ProcessGroup.allreduce``'s binding and the dispatcher, about 2 us per call
before any byte moves (the shared-memory engine then takes 0.1-0.2 us at
world size 1). ``install()`` puts ``all_reduce`` below in place of torch's
function, inside the error logger that wraps it (``torch.distributed.all_reduce``
stays the same object): a call on a plain CPU tensor of a group whose CPU
backend is tpcomm, or on a plain CUDA tensor of a group whose CUDA backend is
that same tpcomm backend, goes straight to that backend
(``_C._fast_all_reduce``: the same checks, routing, flight recording and
fault handling as torch's route, which ends in the same backend call; a CUDA
call is ordered on the current stream either way), and so does one with
``async_op=True``, which returns the backend's Work as torch's would. Every
other call (another backend, a tensor subclass, a complex or grad-requiring
tensor, torch function or dispatch modes, a profiler, coalescing) goes
through torch's function unchanged.

torch's function also refuses some calls before they reach any backend (a
non-tensor argument): on a tpcomm group such a refusal is reported to the
group's peers, as the front door does for the other collectives
(``_front_door``), so their matching call raises instead of waiting.

torch.compile, export and the coalescing manager see torch's own function
object, as without tpcomm.
"""

import functools
import inspect
import weakref

import torch.distributed.distributed_c10d as c10d

from tpcomm import _C, _front_door, _hooks

_ReduceOp = c10d.ReduceOp

# torch's all_reduce's parameters, in order (the direct function's own).
_PARAMETERS = ("tensor", "op", "group", "async_op")

# id(ProcessGroup) -> (a weak reference to it, its handle (a capsule) or
# False: its CPU backend is not tpcomm). Weak: a group dropped by torch and
# the caller leaves nothing behind; its entry goes with it.
_handles = {}

# torch's own all_reduce (the function its error logger wraps), once the
# direct one took its place.
_torch_all_reduce = None


def _forget(handles, key, _ref):
    """A remembered group was collected: its entry goes (bound to the dict
    itself, which outlives the module's globals at interpreter exit)."""
    handles.pop(key, None)


def _handle_of(group):
    """The group's handle (None: the call takes torch's route), remembered
    from the first call on a group torch knows."""
    if group is None:
        return None
    handle = None
    try:
        if group in c10d._world.pg_map and not c10d._rank_not_in_group(group):
            handle = _C._fast_handle(group)
            key = id(group)
            gone = functools.partial(_forget, _handles, key)
            _handles[key] = (weakref.ref(group, gone), handle if handle is not None else False)
    except Exception:  # noqa: BLE001 - not a group tpcomm serves: torch's route decides
        handle = None
    return handle


def cached_handle(group):
    """The group's direct-call handle (None or False: not taken), remembered
    per group as all_reduce's are (tpcomm.all_reduce_into uses it)."""
    entry = _handles.get(id(group))
    if entry is not None and entry[0]() is group:
        return entry[1]
    return _handle_of(group)


def _make_all_reduce(original):
    fast = _C._fast_all_reduce
    calls_on_this_thread = _C._calls_on_this_thread
    world = c10d._world
    coalescing = world.pg_coalesce_state
    handles = _handles

    def all_reduce(tensor, op=_ReduceOp.SUM, group=None, async_op=False):
        if not coalescing:
            pg = group if group is not None else world._default_pg
            entry = handles.get(id(pg))
            handle = entry[1] if entry is not None and entry[0]() is pg else _handle_of(pg)
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

    functools.update_wrapper(all_reduce, original)
    return all_reduce


def install():
    """Puts the direct all_reduce in place of torch's (once): inside the error
    logger that wraps torch's function, so that torch.distributed.all_reduce
    stays the very object torch.compile, export and the coalescing manager
    recognise, and names imported before tpcomm take the direct route too.
    Not on a torch laid out otherwise (ground_problem; replacing torch's
    function object instead would break torch.compile for names imported
    earlier): its calls keep torch's route, and tpcomm's hooks say why.
    TPCOMM_DIRECT_CALLS=0 is honoured by the groups' handles (_C._fast_handle), made at each group's
    first call: reading settings here, at import, would freeze them before
    the program set its environment."""
    global _torch_all_reduce
    if _torch_all_reduce is not None:
        return
    why = ground_problem(c10d)
    if why:
        _hooks.set_status("direct_route", f"off: {why}; all_reduce takes torch's route")
        return
    _C._fast_set_ops([(op, int(op)) for op in (
        _ReduceOp.SUM, _ReduceOp.AVG, _ReduceOp.PRODUCT, _ReduceOp.MIN, _ReduceOp.MAX,
        _ReduceOp.BAND, _ReduceOp.BOR, _ReduceOp.BXOR)])
    outer = c10d.all_reduce
    inner = outer.__wrapped__
    _torch_all_reduce = inner
    outer.__closure__[0].cell_contents = _make_all_reduce(inner)
    _hooks.set_status("direct_route", "on (all_reduce inside torch's error logger)")


def ground_problem(module):
    """Empty when `module` (torch.distributed.distributed_c10d) is laid out as
    the direct route expects, else what differs: its world keeps the default
    group, the group map and the coalescing state where they were, and
    all_reduce is the error logger's wrapper around one function (a closure
    over `func`, the function it wraps)."""
    world = getattr(module, "_world", None)
    missing = [name for name in ("_default_pg", "pg_map", "pg_coalesce_state")
               if not hasattr(world, name)]
    if missing:
        return f"torch.distributed's world state has no {', '.join(missing)}"
    if not callable(getattr(module, "_rank_not_in_group", None)):
        return "torch.distributed has no _rank_not_in_group"
    outer = getattr(module, "all_reduce", None)
    cells = getattr(outer, "__closure__", None) or ()
    inner = getattr(outer, "__wrapped__", None)
    code = getattr(outer, "__code__", None)
    if (code is None or code.co_freevars != ("func",) or len(cells) != 1 or inner is None
            or cells[0].cell_contents is not inner):
        return "torch.distributed.all_reduce is not an error logger's wrapper around one function"
    # The direct function calls torch's by position when it does not serve
    # the call itself.
    try:
        parameters = list(inspect.signature(inner).parameters)
    except (TypeError, ValueError):
        parameters = None
    if parameters != list(_PARAMETERS):
        return (f"torch's all_reduce takes ({', '.join(parameters or ['?'])}), "
                f"not ({', '.join(_PARAMETERS)})")
    return ""


def torch_route():
    """torch's own all_reduce, which never takes the direct route (tests,
    benchmarks)."""
    return _torch_all_reduce if _torch_all_reduce is not None else c10d.all_reduce


def calls_taken():
    """How many calls of this thread took the direct route (for tests)."""
    return _C._fast_calls_taken()
