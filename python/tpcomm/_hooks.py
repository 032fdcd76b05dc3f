"""tpcomm's hooks into torch's internals, and whether each found its ground.

Four features of tpcomm reach past torch's public API, each into something
torch may lay out differently from one release to the next:

- ``direct_route``: ``torch.distributed.all_reduce``'s fast path
  (``_fast_calls``): torch's error-logging wrapper around its function, the
  world's group map and coalescing state.
- ``front_door``: what tells the peers about a call torch refused before
  it reached tpcomm (``_front_door``): torch's error logger, whose error
  path looks up ``c10d_logger._get_msg_dict``, and the functions it does
  not log, wrapped, with their ``group`` argument.
- ``flight_recorder``: tpcomm's entries in torch's own flight recorder
  (``backend/flight_record``): the recorder's instance, found by name, and
  its layout.
- ``gloo_connections``: the finder of a Gloo group's connections, shut down
  when the group breaks (``coordinator/faults/gloo_sockets``): the process's
  descriptors under ``/proc/self/fd``, told by the listening addresses
  the group's ranks exchanged through its store (checked per group too:
  ``_gloo_connections`` of a group's backend says why where it is not).

Each checks, when it is set up, that torch (or the system) is laid out as it
expects. Where it is not, that feature stays off and says why here (in
``tpcomm.describe()["torch_hooks"]`` and ``python -m tpcomm.info``), and the
calls it would have served take torch's own route. Nothing else changes.
"""

# name -> "on (...)" or "off: <why>", for the hooks set up in Python.
_python = {}


def set_status(name, status):
    """Records a Python hook's state ("on (...)" or "off: <why>")."""
    _python[name] = status


def statuses():
    """Every hook's state: name -> "on (...)" or "off: <why>" (a hook not set
    up yet: "not set up")."""
    from tpcomm import _C

    out = {name: _python.get(name, "not set up") for name in ("direct_route", "front_door")}
    out.update(_C._native_hooks())
    return out
