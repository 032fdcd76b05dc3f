"""Mistakes across ranks that neither kill a process nor wait out the
timeout, without TPCOMM_DEBUG:

- a send and its recv that differ in size or dtype (Gloo alone kills the
  receiving process on a larger send and fills part of the tensor silently
  on a smaller one): the recv raises naming both sides, and the sender's
  send (or, when it had completed, its next call) raises the same
  (coordinator/cpu/framed_p2p.hpp);
- a root that differs between ranks (broadcast, reduce, gather, scatter):
  every rank raises naming the roots within about the watchdog's interval
  (coordinator/faults/group_fault.hpp).

Each case runs on a group of its own (new_group), broken afterwards. The
group's timeout is 60 s; every bound here is far below it.
"""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import error_message

BOUND_S = 5


def _p2p_mismatch(ctx, case):
    g = dist.new_group(backend="tpcomm")
    dist.all_reduce(torch.ones(1), group=g)
    big = (1 << 20) // 4  # past the first part: a second message
    sent = {"larger_send": torch.ones(8), "smaller_send": torch.ones(4),
            "dtype": torch.ones(4), "any_source": torch.ones(8),
            "larger_big": torch.ones(big + 8), "smaller_big": torch.ones(big)}[case]
    wanted = {"larger_send": torch.zeros(4), "smaller_send": torch.zeros(8),
              "dtype": torch.zeros(4, dtype=torch.int32), "any_source": torch.zeros(4),
              "larger_big": torch.zeros(big), "smaller_big": torch.zeros(big + 8)}[case]
    start = time.monotonic()
    if ctx.rank == 0:
        msg = error_message(lambda: dist.send(sent, 1, group=g))
    elif case == "any_source":
        msg = error_message(lambda: g.recv_anysource([wanted], 0).wait())
    else:
        msg = error_message(lambda: dist.recv(wanted, 0, group=g))
    seconds = time.monotonic() - start
    later = error_message(lambda: dist.all_reduce(torch.ones(2), group=g))
    return msg, seconds, later, bool(wanted.any())


SIDES = {"larger_send": ("4 elements of float32 (16 B)", "8 elements of float32 (32 B)"),
         "smaller_send": ("8 elements of float32 (32 B)", "4 elements of float32 (16 B)"),
         "dtype": ("4 elements of int32 (16 B)", "4 elements of float32 (16 B)"),
         "any_source": ("4 elements of float32 (16 B)", "8 elements of float32 (32 B)"),
         "larger_big": ("262144 elements of float32 (1048576 B)",
                        "262152 elements of float32 (1048608 B)"),
         "smaller_big": ("262152 elements of float32 (1048608 B)",
                         "262144 elements of float32 (1048576 B)")}


@pytest.mark.parametrize("case", list(SIDES))
def test_a_mismatched_send_and_recv_raise_on_both_ranks(groups, case):
    expected, sent = SIDES[case]
    why = f"rank 1's recv from rank 0 (tag 0) expected {expected}; rank 0 sent {sent}"
    results = groups(2).run(_p2p_mismatch, case)
    for rank, (msg, seconds, later, _) in enumerate(results):
        # The recv raises; the send raises too, or had completed already
        # (its message was whole in the recv's buffer): then the sender's
        # next call does.
        assert (msg is None and rank == 0) or (msg is not None and why in msg), (rank, msg)
        assert seconds < BOUND_S, (rank, seconds)
        assert later is not None and "the group is unusable" in later and why in later, later
    # Nothing of the payload was written into the receiver's tensor.
    assert results[1][3] is False, "the receiver's tensor was written"


def _exchanges(ctx):
    """Sends and recvs that match: an irecv both ranks leave pending while
    they block in their send to each other (the progress thread posts the
    payloads), tags taken out of order, a dtype Gloo has no kernels for,
    recv from any source, and an empty tensor."""
    g = dist.new_group(backend="tpcomm")
    r, peer = ctx.rank, 1 - ctx.rank
    out = {}
    for n in (1000, 200000):  # within the first part, and past it
        got = torch.zeros(n)
        req = dist.irecv(got, peer, group=g)
        dist.send(torch.arange(n, dtype=torch.float32) + 1000 * r, peer, group=g)
        req.wait()
        out["crossed"] = out.get("crossed", True) and torch.equal(
            got, torch.arange(n, dtype=torch.float32) + 1000 * peer)
    if r == 0:
        dist.send(torch.full((3,), 1.0), 1, group=g, tag=1)
        dist.send(torch.full((5,), 2.0), 1, group=g, tag=2)
        dist.send(torch.full((6,), 1.5, dtype=torch.bfloat16), 1, group=g)
        dist.send(torch.full((2,), 7.0), 1, group=g)
        dist.send(torch.zeros(0), 1, group=g)
        dist.send(torch.arange(300000, dtype=torch.float64), 1, group=g)
    else:
        second, first = torch.zeros(5), torch.zeros(3)
        w2 = dist.irecv(second, 0, group=g, tag=2)
        w1 = dist.irecv(first, 0, group=g, tag=1)
        w2.wait()
        w1.wait()
        out["tags"] = first.tolist() == [1.0] * 3 and second.tolist() == [2.0] * 5
        bf = torch.zeros(6, dtype=torch.bfloat16)
        dist.recv(bf, 0, group=g)
        out["bf16"] = bf.float().tolist() == [1.5] * 6
        anyone = torch.zeros(2)
        src = dist.recv(anyone, group=g)
        out["any"] = (src, anyone.tolist())
        empty = torch.zeros(0)
        dist.recv(empty, 0, group=g)
        out["empty"] = empty.numel() == 0
        big = torch.zeros(300000, dtype=torch.float64)
        dist.recv(big, 0, group=g)
        out["big"] = torch.equal(big, torch.arange(300000, dtype=torch.float64))
    x = torch.ones(2)
    dist.all_reduce(x, group=g)
    out["after"] = x.tolist()
    return out


def test_matching_sends_and_recvs_deliver_everything(groups):
    rank0, rank1 = groups(2).run(_exchanges)
    assert rank0 == {"crossed": True, "after": [2.0, 2.0]}, rank0
    assert rank1 == {"crossed": True, "tags": True, "bf16": True, "any": (0, [7.0, 7.0]),
                     "empty": True, "big": True, "after": [2.0, 2.0]}, rank1


def _pending(ctx):
    """Recvs left pending on one tag and waited out of order: two past the
    first part from one rank (each rest must land in its own recv), one
    from any rank between them, a small one among them; then an isend and an
    irecv nobody waits on, which complete by themselves."""
    g = dist.new_group(backend="tpcomm")
    n = 200000  # 800 KB: past the 256 KiB first part
    sent = [torch.arange(n, dtype=torch.float32) + k * 1e6 for k in range(3)]
    small = torch.arange(10, dtype=torch.float32)
    out = {}
    if ctx.rank == 0:
        for t in (sent[0], small, sent[1], sent[2]):
            dist.send(t, 1, group=g)
    else:
        a, s, b, c = torch.zeros(n), torch.zeros(10), torch.zeros(n), torch.zeros(n)
        wa = dist.irecv(a, 0, group=g)
        ws = dist.irecv(s, 0, group=g)
        wb = g.recv_anysource([b], 0)
        wc = dist.irecv(c, 0, group=g)
        for w in (wc, wb, ws, wa):  # the last first
            w.wait()
        # Gloo hands a message to a recv from its rank before one from any
        # rank: b and c take sent[1] and sent[2] in either order.
        out["order"] = [torch.equal(a, sent[0]), torch.equal(s, small),
                        sorted([b[0].item(), c[0].item()]) == [1e6, 2e6],
                        torch.equal(b, sent[1]) or torch.equal(b, sent[2]),
                        torch.equal(c, sent[1]) or torch.equal(c, sent[2])]
        out["source"] = wb.source_rank()
    dist.barrier(group=g)
    # Never waited on: they complete on their own.
    if ctx.rank == 0:
        req = dist.isend(torch.full((n,), 3.0), 1, group=g)
    else:
        got = torch.zeros(n)
        req = dist.irecv(got, 0, group=g)
    deadline = time.monotonic() + BOUND_S
    while not req.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    out["completed"] = req.is_completed()
    if ctx.rank == 1:
        out["unwaited"] = torch.equal(got, torch.full((n,), 3.0))
    x = torch.ones(2)
    dist.all_reduce(x, group=g)
    out["after"] = x.tolist()
    return out


def test_pending_recvs_on_one_tag_each_get_their_own_message(groups):
    rank0, rank1 = groups(2).run(_pending)
    assert rank0 == {"completed": True, "after": [2.0, 2.0]}, rank0
    assert rank1 == {"order": [True] * 5, "source": 0, "completed": True, "unwaited": True,
                     "after": [2.0, 2.0]}, rank1


def _late(ctx):
    """An isend and an irecv that rank 0 waits on only after longer than the
    group's timeout (2 s), whose peer comes after 2.5 s, complete: the
    timeout bounds a wait, counted from the wait, as Gloo's own does."""
    g = dist.new_group(backend="tpcomm", timeout=timedelta(seconds=2))
    n = 100000  # past the first part
    if ctx.rank == 0:
        got = torch.zeros(n)
        sent = dist.isend(torch.full((n,), 5.0), 1, group=g)
        req = dist.irecv(got, 1, group=g)
        time.sleep(3)
        sent.wait()
        req.wait()
        return torch.equal(got, torch.full((n,), 7.0))
    time.sleep(2.5)
    got = torch.zeros(n)
    dist.recv(got, 0, group=g)
    dist.send(torch.full((n,), 7.0), 0, group=g)
    return torch.equal(got, torch.full((n,), 5.0))


def test_a_send_and_recv_waited_on_after_the_groups_timeout_still_complete(groups):
    assert groups(2).run(_late) == [True, True]


def _tag_too_large(ctx):
    g = dist.new_group(backend="tpcomm")
    small, big = torch.ones(4), torch.ones(100000)
    return (error_message(lambda: dist.send(small, 1 - ctx.rank, group=g, tag=1 << 29)),
            error_message(lambda: dist.irecv(big, 1 - ctx.rank, group=g, tag=1 << 20)),
            error_message(lambda: dist.all_reduce(small, group=g)))


def test_a_tag_past_the_range_is_refused_before_anything_is_sent(groups):
    for small, big, later in groups(2).run(_tag_too_large):
        assert small is not None and "tag 536870912 is out of range" in small, small
        assert "from 0 to 536870911 (larger tags are tpcomm's own" in small, small
        assert big is not None and "tag 1048576 is out of range" in big, big
        assert "from 0 to 1048575 for a message past 262144 B" in big, big
        assert later is None, later


def _roots_differ(ctx, op):
    g = dist.new_group(backend="tpcomm")
    dist.all_reduce(torch.ones(1), group=g)
    r, w = ctx.rank, ctx.world_size
    root = r  # every rank names itself: no two agree
    x = torch.full((1000,), float(r))
    start = time.monotonic()
    if op == "broadcast":
        msg = error_message(lambda: dist.broadcast(x, root, group=g))
    elif op == "reduce":
        msg = error_message(lambda: dist.reduce(x, root, group=g))
    elif op == "gather":
        msg = error_message(lambda: dist.gather(x, [torch.zeros(1000) for _ in range(w)],
                                                dst=root, group=g))
    else:
        msg = error_message(lambda: dist.scatter(x, [torch.zeros(1000) for _ in range(w)],
                                                 src=root, group=g))
    seconds = time.monotonic() - start
    later = error_message(lambda: dist.all_reduce(torch.ones(2), group=g))
    return msg, seconds, later


@pytest.mark.parametrize("op", ["broadcast", "reduce", "gather", "scatter"])
def test_a_root_that_differs_between_ranks_raises_on_every_rank(groups, op):
    for rank, (msg, seconds, later) in enumerate(groups(2).run(_roots_differ, op)):
        assert msg is not None and "every rank must give a rooted collective the same root" in msg, \
            (rank, msg)
        assert f"called {op} #2 with root" in msg, msg
        assert seconds < BOUND_S, (rank, seconds)
        assert later is not None and "the group is unusable" in later, later
