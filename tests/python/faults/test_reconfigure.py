"""Re-forming a group with a new set of members: dist._reconfigure on
tpcomm (backend/reconfigure.cpp), in torch's reconfigure regime
(init_process_group(..., enable_reconfigure=True): no member until the first
reconfigure) and on a formed group. The survivors of a lost rank and a
process that joins in its place form one group from their handles; bad
handles are refused on the calling rank, naming what is wrong, and a
member whose handles differ makes every member raise at once. Test
test_shrink.py's reconfigure cases compare a re-formed group with a group of
the survivors made apart, bit for bit, and count what is left behind."""

import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from harness import error_message, first_answers

# Not marked torch_version: these run on the newest torch only (2.15, which
# has dist._reconfigure); test_backend_hooks.py checks that a build against
# an older torch says reconfigure is off.

FIRST = 3      # members of the first forming
LOST = 1       # the first members' rank that is killed
CALLS = 1000


def _handles(store, key, ranks):
    return [store.get(f"{key}/{r}").decode() for r in ranks]


def _sums(n, ranks, size):
    """Member r's input of call n, and the float64 sum over `size` members."""
    inputs = [torch.randn(257 + n % 7, generator=torch.Generator().manual_seed(n * 16 + r),
                          dtype=torch.float64) for r in range(size)]
    return [x.float() for x in inputs], sum(inputs)


def _member(role, rank, port, env, conn):
    """role "first": one of the first members (rank: its place among them);
    "joiner": the process that joins after the loss."""
    try:
        os.environ.clear()
        os.environ.update(env)
        import tpcomm

        out = {}
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        base = dist.PrefixStore("w", store)
        if role == "joiner":
            store.wait(["joiner-go"])
        dist.init_process_group("tpcomm", store=base, rank=rank if role == "first" else 0,
                                world_size=FIRST if role == "first" else 1,
                                timeout=timedelta(seconds=20), enable_reconfigure=True)
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        out["formed_before"] = backend._formed
        out["call_before"] = error_message(lambda: dist.all_reduce(torch.ones(4)))
        me = "joiner" if role == "joiner" else str(rank)
        if role == "first":
            # The first forming: a set of handles; ranks by the group each
            # member served, then its rank there (here the nominal ones).
            store.set(f"h1/{rank}", dist._get_reconfigure_handle())
            handles = _handles(store, "h1", range(FIRST))
            dist._reconfigure(uuid=1, handles=set(handles)).wait()
            out["first"] = (dist.get_rank(), dist.get_world_size(), rank)
            for i in range(100000):
                if rank == LOST and i == 50:
                    conn.send(("killed", time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
                x = torch.full((1024,), float(dist.get_rank() + i))
                failure = error_message(lambda: dist.all_reduce(x))
                if failure is not None:
                    out["failure"] = (failure, time.time())
                    break
                assert x[0].item() == sum(range(FIRST)) + FIRST * i, (i, x[0].item())
            store.set("joiner-go", "1")
        # The second forming: the survivors in their first order, then the
        # joiner; a list of handles.
        store.set(f"h2/{me}", dist._get_reconfigure_handle())
        members = [str(r) for r in range(FIRST) if r != LOST] + ["joiner"]
        handles = _handles(store, "h2", members)
        start = time.monotonic()
        dist._reconfigure(uuid=2, handles=handles).wait()
        out["second_s"] = time.monotonic() - start
        out["second"] = (dist.get_rank(), dist.get_world_size(), members.index(me))
        tpcomm.reset_stats(dist.group.WORLD)
        differ = 0
        for n in range(CALLS):
            inputs, expected = _sums(n, members, len(members))
            x = inputs[dist.get_rank()].clone()
            dist.all_reduce(x)
            differ += not torch.allclose(x.double(), expected, rtol=1e-5, atol=1e-5)
        out["differ"] = differ
        stats = tpcomm.stats(dist.group.WORLD)
        out["calls"] = (stats.get("cpu_shm", {}).get("calls", 0),
                        stats.get("gloo", {}).get("calls", 0))
        dist.destroy_process_group()
        conn.send(("ok", out))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        conn.send(("error", traceback.format_exc() + f"\n{type(e).__name__}: {e}"))


def test_survivors_and_a_joiner_form_a_group_from_their_handles(monkeypatch):
    monkeypatch.setenv("TPCOMM_CPU_SHM", "1")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    roles = [("first", r) for r in range(FIRST)] + [("joiner", 0)]
    answers = dict(enumerate(first_answers(
        _member, [(role, r, store.port) for role, r in roles])))
    for i, (status, value) in answers.items():
        print(f"member {i}: {status}: {value}")
    for i, (status, value) in answers.items():
        assert status == ("killed" if i == LOST else "ok"), (i, value)
    killed_at = answers[LOST][1]
    survivors = [i for i in range(FIRST) if i != LOST]
    for i in survivors + [FIRST]:
        out = answers[i][1]
        # Before its first reconfigure the group has no member, and says so.
        assert out["formed_before"] is False, out
        assert "reconfigure regime" in out["call_before"] and "_reconfigure" in out["call_before"]
        if i < FIRST:
            # A set of handles: the members in their nominal order.
            assert out["first"][0] == out["first"][2] and out["first"][1] == FIRST, out
            failure, failed_at = out["failure"]
            assert "PeerLost" in failure and failed_at - killed_at < 1.0, (failure, failed_at)
        # A list: ranks by position; the joiner last.
        assert out["second"] == (out["second"][2], FIRST, out["second"][2]), out
        assert out["differ"] == 0, out
        # Every allreduce of the re-formed group on shared memory.
        assert out["calls"] == (CALLS, 0), out
    assert answers[FIRST][1]["second"][0] == FIRST - 1
    # The lost member's part of the first forming was ended by the second,
    # everything else by its members: no key of tpcomm's left.
    assert sorted(k for k in store.list_keys() if "tpcomm" in k) == [], store.list_keys()


def _misuse(ctx):
    g = dist.new_group(backend="tpcomm")
    backend = g._get_backend(torch.device("cpu"))
    mine = dist._get_reconfigure_handle(g)
    handles = [None] * ctx.world_size
    dist.all_gather_object(handles, mine, group=ctx.ref)
    other = handles[1 - ctx.rank]
    fields = mine.split(";")
    elsewhere = ";".join(fields[:2] + ["tcp:10.9.9.9:1"] + fields[3:])
    out = {"supports": backend.supports_reconfigure}
    bad = {
        "garbage": lambda: dist._reconfigure(uuid=11, handles=["not a handle", mine], group=g),
        "damaged": lambda: dist._reconfigure(uuid=12, handles=[mine, mine[:-3] + "x;y"], group=g),
        "none": lambda: dist._reconfigure(uuid=13, handles=[], group=g),
        "missing": lambda: dist._reconfigure(uuid=14, handles=[other], group=g),
        "twice": lambda: dist._reconfigure(uuid=15, handles=[mine, mine], group=g),
        "store": lambda: dist._reconfigure(uuid=16, handles=[mine, elsewhere.replace(
            fields[1], "0123456789abcdef")], group=g),
        "hint": lambda: dist._reconfigure(uuid=17, handles=handles, group=g,
                                          hints={"nccl_config": "x"}),
    }
    for name, call in bad.items():
        out[name] = error_message(call)
    # A valid reconfigure of both; then the handles taken before it, and the
    # same uuid again with fresh ones.
    dist._reconfigure(uuid=5, handles=handles, group=g).wait()
    out["stale"] = error_message(lambda: dist._reconfigure(uuid=8, handles=handles, group=g))
    fresh = [None] * ctx.world_size
    dist.all_gather_object(fresh, dist._get_reconfigure_handle(g), group=ctx.ref)
    handles = fresh
    out["again"] = error_message(lambda: dist._reconfigure(uuid=5, handles=handles, group=g))
    # A member that never comes: both give up after the options' timeout,
    # naming how many came; the group keeps its own timeout after a
    # reconfigure bounded by another.
    first = handles[0].split(";")
    absent = ";".join(first[:1] + ["fedcba9876543210"] + first[2:])
    start = time.monotonic()
    out["absent"] = error_message(lambda: dist._reconfigure(
        uuid=9, handles=handles + [absent], group=g, timeout=timedelta(seconds=1)))
    out["absent_s"] = time.monotonic() - start
    before = backend.options._timeout
    fresh = [None] * ctx.world_size
    dist.all_gather_object(fresh, dist._get_reconfigure_handle(g), group=ctx.ref)
    handles = fresh
    dist._reconfigure(uuid=10, handles=handles, group=g, timeout=timedelta(seconds=7)).wait()
    out["timeouts"] = (before, backend.options._timeout)
    dist.all_gather_object(fresh, dist._get_reconfigure_handle(g), group=ctx.ref)
    handles = fresh
    # Handles that differ between the members (the order): both raise at
    # once, and the group they had goes on.
    start = time.monotonic()
    order = handles if ctx.rank == 0 else handles[::-1]
    out["differ"] = error_message(lambda: dist._reconfigure(uuid=6, handles=order, group=g))
    out["differ_s"] = time.monotonic() - start
    x = torch.full((4,), float(ctx.rank + 1))
    dist.all_reduce(x, group=g)
    out["after"] = x.tolist()
    dist.destroy_process_group(g)
    return out


def test_a_wrong_reconfigure_is_refused_naming_what_is_wrong(groups):
    for rank, out in enumerate(groups(2).run(_misuse)):
        assert out["supports"] is True, out
        assert "handle 0 ('not a handle') is not a tpcomm handle" in out["garbage"], out
        assert "handle 1" in out["damaged"] and "is damaged" in out["damaged"], out
        assert "no handle (one per member" in out["none"], out
        assert "this rank's own handle is not among the 1 handles" in out["missing"], out
        assert "handles 0 and 1 name the same member" in out["twice"], out
        assert "names store 'tcp:10.9.9.9:1'" in out["store"], out
        assert "every member must share one store" in out["store"], out
        assert "hint 'nccl_config' is not one tpcomm knows" in out["hint"], out
        assert "uuid 5 was used before on this group" in out["again"], out
        assert f"this rank's handle {rank} is one it gave before the group changed" in \
            out["stale"], out
        assert "passed other handles than the first one" in out["differ"], out
        assert "gave up after 1000 ms: 2 of the 3 members came" in out["absent"], out
        assert out["absent_s"] < 10, out
        assert out["timeouts"][0] == out["timeouts"][1] != timedelta(seconds=7), out
        # Neither member waited out the group's timeout (60 s here).
        assert out["differ_s"] < 10, out
        assert out["after"] == [3.0] * 4, out
