"""Faults every rank sees (coordinator/faults/group_fault.hpp): a collective that one
rank refuses (a bad argument, found by tpcomm or by torch's Python front
door), an abort on one rank (from any thread) and a call that fails on one
rank end the waits of every rank of the group, on the shared-memory route and
the Gloo route, with an error that names the rank and the call; the group is
unusable from then on and says why. A collective every rank refuses breaks
nothing.

Each case runs on a group of its own (new_group), so that the group it breaks
is not one another test uses. Times are checked against a bound far below the
group's timeout (60 s): the figures themselves are `python -m tpcomm.bench
faults`'s.
"""

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import error_message
from tpcomm.bench.faults import ONE_RANK_MISTAKES, one_rank_mistake

R = dist.ReduceOp
# A fault, not the group's timeout (60 s), must have ended the wait.
BOUND_S = 10


ONE_SIDED = list(ONE_RANK_MISTAKES)


def _refused_on_one_rank(ctx, case):
    w, r = ctx.world_size, ctx.rank
    g = dist.new_group(backend="tpcomm")
    warm = torch.ones(1)
    dist.all_reduce(warm, group=g)  # the route is set up
    start = time.monotonic()
    msg = error_message(one_rank_mistake(case, w, r, g))
    seconds = time.monotonic() - start
    start = time.monotonic()
    later = error_message(lambda: dist.all_reduce(torch.ones(2), group=g))
    later_s = time.monotonic() - start
    # Other groups are unaffected.
    y = torch.ones(2)
    dist.all_reduce(y)
    assert torch.equal(y, torch.full((2,), float(w)))
    return ONE_RANK_MISTAKES[case], msg, seconds, later, later_s


def _check_one_sided(results, case):
    bad = results[0][0]
    for r, (_, msg, seconds, later, later_s) in enumerate(results):
        assert msg is not None, f"{case}: rank {r} did not raise"
        if r == bad:
            # Its own error, at once.
            assert "the group is unusable" not in msg, msg
            assert seconds < BOUND_S, (r, seconds)
        else:
            assert msg.startswith("DistBackendError"), msg
            assert f"the group is unusable: rank {bad} refused" in msg, msg
            # This rank, or the first peer that found the refusal.
            assert "made that call" in msg and f"while rank {bad} " not in msg, msg
            assert seconds < BOUND_S, (case, r, seconds, msg)
        assert later is not None and "the group is unusable" in later, later
        assert f"rank {bad} refused" in later, later
        assert later_s < BOUND_S, later_s


@pytest.mark.parametrize("case", ONE_SIDED)
def test_a_call_one_rank_refuses_ends_every_ranks_wait_on_gloo(groups, case):
    _check_one_sided(groups(2).run(_refused_on_one_rank, case), case)


@pytest.mark.parametrize("case", ONE_SIDED)
def test_a_call_one_rank_refuses_ends_every_ranks_wait_on_shared_memory(shm_groups, case):
    _check_one_sided(shm_groups(2).run(_refused_on_one_rank, case), case)


@pytest.mark.parametrize("case", ["split_sizes", "scatter_list_missing", "bitwise_on_float"])
def test_three_ranks_each_name_the_refusing_rank(shm_groups, groups, case):
    _check_one_sided(shm_groups(3).run(_refused_on_one_rank, case), case)
    _check_one_sided(groups(3).run(_refused_on_one_rank, case), case)


def _extra_refused_call(ctx):
    """Rank 0 makes one extra collective, which it refuses, then the call
    every rank makes: its next call must not pair with the peers' call."""
    w, r = ctx.world_size, ctx.rank
    g = dist.new_group(backend="tpcomm")
    x = torch.ones(4)
    dist.all_reduce(x, group=g)
    extra = error_message(lambda: dist.all_reduce(x, op=R.BAND, group=g)) if r == 0 else None
    start = time.monotonic()
    msg = error_message(lambda: dist.all_reduce(x, group=g))
    return extra, msg, time.monotonic() - start, x.tolist()


@pytest.mark.parametrize("route", ["gloo", "shm"])
def test_an_extra_refused_call_on_one_rank_never_pairs_with_the_next(groups, shm_groups, route):
    group = groups(2) if route == "gloo" else shm_groups(2)
    results = group.run(_extra_refused_call)
    assert "ReduceOp.BAND needs an integer" in results[0][0], results[0]
    for r, (_, msg, seconds, x) in enumerate(results):
        assert msg is not None and "rank 0 refused allreduce #2" in msg, msg
        assert x == [2.0] * 4, x  # no call paired with another
        assert seconds < BOUND_S, seconds


def _refused_everywhere(ctx):
    """Every rank refuses the same calls (tpcomm's check, torch's front
    door): the group stays healthy."""
    w = ctx.world_size
    g = dist.new_group(backend="tpcomm")
    x = torch.ones(4)
    msgs = [
        error_message(lambda: dist.all_reduce(x, op=R.BAND, group=g)),
        error_message(lambda: dist.all_gather("not a list", x, group=g)),
        error_message(lambda: dist.scatter(torch.empty(4), None, src=0, group=g)
                      if ctx.rank == 0 else
                      dist.scatter(torch.empty(4), [x] * w, src=0, group=g)),
    ]
    y = torch.ones(4)
    dist.all_reduce(y, group=g)
    return msgs, y.tolist(), g._get_backend(torch.device("cpu")).fault


def test_calls_every_rank_refuses_leave_the_group_healthy(groups, shm_groups):
    for group in (groups(2), shm_groups(3)):
        for msgs, y, fault in group.run(_refused_everywhere):
            assert all(m is not None for m in msgs), msgs
            assert "unusable" not in " ".join(msgs), msgs
            assert y == [float(group.world_size)] * 4 and fault == "", (y, fault)


# ---------------------------------------------------------------- aborts
def _abort(ctx, case):
    """`case`: who aborts and what the others wait in. Returns each rank's
    error, when (wall clock) its wait ended or the abort happened, what a
    later call raised, and the group's fault."""
    w, r = ctx.world_size, ctx.rank
    g = dist.new_group(backend="tpcomm")
    backend = g._get_backend(torch.device("cpu"))
    x = torch.ones(1 << 12)
    dist.all_reduce(x, group=g)
    aborted_at = []

    def abort_later():
        time.sleep(0.3)
        aborted_at.append(time.time())
        backend.abort()

    msg = None
    if case == "own_from_a_thread":
        # Rank 0 waits in an allreduce the others never make; a thread of its
        # own aborts the group. The others call later.
        if r == 0:
            threading.Thread(target=abort_later).start()
            msg = error_message(lambda: dist.all_reduce(x, group=g))
        else:
            time.sleep(1.0)
            msg = error_message(lambda: dist.all_reduce(x, group=g))
    elif r == 0:
        abort_later()
    elif case == "peer_in_allreduce":
        msg = error_message(lambda: dist.all_reduce(x, group=g))
    elif case == "peer_in_recv":
        msg = error_message(lambda: dist.recv(torch.empty(4), 0, group=g))
    elif case == "peer_in_a_future":
        msg = error_message(
            lambda: dist.all_reduce(x, group=g, async_op=True).get_future().wait())
    ended = time.time()
    later = error_message(lambda: dist.all_reduce(torch.ones(2), group=g))
    return msg, aborted_at[0] if aborted_at else ended, later, backend.fault


@pytest.mark.parametrize("case", ["own_from_a_thread", "peer_in_allreduce", "peer_in_recv",
                                  "peer_in_a_future"])
@pytest.mark.parametrize("route", ["gloo", "shm"])
def test_an_abort_ends_every_ranks_wait(groups, shm_groups, route, case):
    group = groups(2) if route == "gloo" else shm_groups(2)
    results = group.run(_abort, case)
    aborted_at = results[0][1]
    for r, (msg, ended, later, fault) in enumerate(results):
        assert fault == "rank 0 aborted the group", fault
        assert later is not None and "the group is unusable: rank 0 aborted the group" in later
        if r == 0 and case != "own_from_a_thread":
            continue
        assert msg is not None and msg.startswith("DistBackendError"), msg
        assert "rank 0 aborted the group" in msg, msg
        assert ended - aborted_at < BOUND_S, (r, ended - aborted_at)


# ---------------------------------------------------------------- positions
def _stuck_in_different_calls(ctx):
    """Rank 0 gives up its allreduce after 3 s (its own timeout) while rank
    1 still waits in a recv nobody sends (the group's timeout is 30 s: rank
    0's break releases it). Rank 1 publishes its position once its recv is
    older than the watchdog's 200 ms: rank 0 starts its allreduce only once
    its backend's `positions` shows it (on a loaded 2-core machine, where a
    stalled process once published nothing for 3 s, the error would
    otherwise name rank 1's previous position)."""
    g = dist.new_group(backend="tpcomm", timeout=timedelta(seconds=30))
    dist.all_reduce(torch.ones(1), group=g)
    if ctx.rank == 1:
        return error_message(lambda: dist.recv(torch.empty(4), 0, group=g)), ""
    backend = g._get_backend(torch.device("cpu"))
    deadline = time.monotonic() + 20
    seen = backend.positions
    while "rank 1: in recv #1 (p2p) for " not in seen and time.monotonic() < deadline:
        time.sleep(0.05)
        seen = backend.positions
    backend.set_timeout(timedelta(seconds=3))
    return error_message(lambda: dist.all_reduce(torch.ones(4), group=g)), seen


@pytest.mark.parametrize("route", ["gloo", "shm"])
def test_a_timeout_names_where_the_peers_are(groups, shm_groups, route):
    group = groups(2) if route == "gloo" else shm_groups(2)
    (rank0, seen), (rank1, _) = group.run(_stuck_in_different_calls, timeout_s=90)
    # Between the calls, the backend says the same as a failed call's error.
    assert seen.startswith(" [across ranks: this rank (0) after allreduce #1; rank 1: in recv #1 "
                           "(p2p) for "), seen
    assert "[across ranks: this rank (0) in allreduce #2; rank 1: in recv #1 (p2p) for " in rank0, \
        rank0
    assert "within 3000 ms" in rank0 or "3000ms" in rank0, rank0  # its own timeout
    # Rank 0 gave up first.
    assert "this rank (1) in recv #1" in rank1, rank1
    assert "rank 0: after allreduce #2" in rank1 or "rank 0: in allreduce #2" in rank1, rank1


# ------------------------------------------- refusals of torch's front door
# Calls whose refusal torch raises before any backend is reached, seen
# through torch's error logger (every logged function, also names imported
# before tpcomm) or tpcomm's wrappers (isend, irecv): rank 0 makes the bad
# call, rank 1 the good one. A collective's peer raises naming the refused
# call; a point-to-point peer finds the group broken naming it.
def _front_door_calls(case, dist, g):
    x = torch.ones(4)
    out = [torch.empty(4) for _ in range(2)]
    unpicklable = threading.Lock()
    return {
        "broadcast": (lambda: dist.broadcast("x", 0, group=g),
                      lambda: dist.broadcast(x, 0, group=g)),
        "all_gather_into_tensor": (lambda: dist.all_gather_into_tensor(torch.empty(8), "x", group=g),
                                   lambda: dist.all_gather_into_tensor(torch.empty(8), x, group=g)),
        "reduce_scatter_tensor": (lambda: dist.reduce_scatter_tensor(torch.empty(4), "x", group=g),
                                  lambda: dist.reduce_scatter_tensor(torch.empty(4), torch.ones(8),
                                                                     group=g)),
        "barrier": (lambda: dist.barrier(group=g, device_ids=[]), lambda: dist.barrier(group=g)),
        "broadcast_object_list": (lambda: dist.broadcast_object_list([unpicklable], 0, group=g),
                                  lambda: dist.broadcast_object_list([None], 0, group=g)),
        "all_gather_object": (lambda: dist.all_gather_object([None, None], unpicklable, group=g),
                              lambda: dist.all_gather_object([None, None], 1, group=g)),
        "gather_object": (lambda: dist.gather_object(unpicklable, [None, None], dst=0, group=g),
                          lambda: dist.gather_object(1, None, dst=0, group=g)),
        "scatter_object_list": (
            lambda: dist.scatter_object_list([None], [unpicklable, 1], src=0, group=g),
            lambda: dist.scatter_object_list([None], None, src=0, group=g)),
        "send_object_list": (lambda: dist.send_object_list([unpicklable], 1, group=g),
                             lambda: dist.recv_object_list([None], 0, group=g)),
        "send": (lambda: dist.send("x", 1, group=g), lambda: dist.recv(x, 0, group=g)),
        "isend": (lambda: dist.isend("x", 1, group=g).wait(), lambda: dist.recv(x, 0, group=g)),
        "all_gather": (lambda: dist.all_gather(out, "x", group=g),
                       lambda: dist.all_gather(out, x, group=g)),
    }[case]


P2P_CASES = ("send_object_list", "send", "isend")
FRONT_DOOR_CASES = ("broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier",
                    "broadcast_object_list", "all_gather_object", "gather_object",
                    "scatter_object_list", *P2P_CASES, "all_gather")


def _refused_by_torch(ctx, case, functions=None):
    g = dist.new_group(backend="tpcomm")
    dist.all_reduce(torch.ones(1), group=g)
    bad, good = _front_door_calls(case, functions or dist, g)
    start = time.monotonic()
    msg = error_message(bad if ctx.rank == 0 else good)
    seconds = time.monotonic() - start
    later = error_message(lambda: dist.all_reduce(torch.ones(2), group=g))
    return msg, seconds, later


def _check_refused_by_torch(results, case):
    bad, peer = results
    assert bad[0] is not None and "the group is unusable" not in bad[0], bad
    msg, seconds, later = peer
    assert msg is not None, f"{case}: the peer did not raise"
    # torch 2.15 logs the two deprecated names as the functions they call;
    # send refuses inside the isend it calls.
    names = {case, {"all_gather_into_tensor": "all_gather_single",
                    "reduce_scatter_tensor": "reduce_scatter_single",
                    "send": "isend"}.get(case, case)}
    mark = " (" if case in P2P_CASES else " #"
    assert any(f"rank 0 refused {n}{mark}" in msg for n in names), msg
    assert seconds < 1.5, (case, seconds)  # the watchdog's 200 ms and a store read
    for _, _, later in results:
        assert later is not None and "the group is unusable" in later, later


@pytest.mark.torch_version
@pytest.mark.parametrize("case", FRONT_DOOR_CASES)
def test_a_call_torch_refuses_on_one_rank_reaches_the_peer(groups, case):
    _check_refused_by_torch(groups(2).run(_refused_by_torch, case), case)


PRE_IMPORTED = {}


def import_before_tpcomm():
    """harness before_import: names taken from torch.distributed before
    tpcomm is imported, as a program's own imports do under autoload."""
    import types

    from torch.distributed import (all_gather_object, barrier, broadcast,  # noqa: F401
                                   broadcast_object_list, recv, send)

    PRE_IMPORTED["dist"] = types.SimpleNamespace(**{
        name: value for name, value in locals().items() if callable(value)})


def _refused_through_names_imported_before(ctx, case):
    import types

    # Only the names imported before tpcomm; the rest (unused) from dist.
    names = dict(vars(dist))
    names.update(vars(PRE_IMPORTED["dist"]))
    return _refused_by_torch(ctx, case, types.SimpleNamespace(**names))


@pytest.mark.torch_version
def test_names_imported_before_tpcomm_report_their_refusals():
    from harness import Group

    group = Group(2, before_import=("test_faults", "import_before_tpcomm"))
    try:
        for case in ("broadcast", "barrier", "broadcast_object_list", "all_gather_object", "send"):
            _check_refused_by_torch(group.run(_refused_through_names_imported_before, case), case)
    finally:
        group.close()
