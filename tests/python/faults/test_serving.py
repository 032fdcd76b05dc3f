"""Safe inside a serving process: breaking a group shuts down only the
group's own Gloo connections (coordinator/faults/gloo_sockets.hpp), never one of
the program's, whichever thread opened it and whenever.

Each rank runs an echo server and a thread that keeps opening connections
to every rank's server (tpcomm.bench.serving) while a group is made: the
world group, new_group, a split, and (test_hosts.py) the lazy set-up
across hosts. Rank 0 then aborts the group while rank 1 waits in one of
its Gloo calls; afterwards every one of the program's connections still
answers, and every connection of the group's Gloo group is shut down.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

from harness import Group, _free_port, error_message
from tpcomm.bench.serving import EchoTraffic, inode_of, shut_down

CPU = torch.device("cpu")
# The connections the client thread opens in each phase (two ends each).
LIMIT = 300
EVERY_S = 0.0005
BOUND_S = 10

ECHO = {}


def start_echo_before_init():
    """Called before `import tpcomm` on each rank (harness before_import):
    the echo traffic starts before the world group is made, and the world
    group's creation records how many connections opened meanwhile.

    The traffic started here may have reached its limit by the time the
    group is made (importing tpcomm under load takes longer than LIMIT
    connections): the group's creation starts a phase of its own, as
    new_group's and split's do."""
    ports = [int(p) for p in os.environ["TEST_ECHO_PORTS"].split(",")]
    echo = EchoTraffic(port=ports[int(os.environ["TEST_ECHO_RANK"])])
    ECHO["echo"], ECHO["ports"] = echo, ports
    original = dist.init_process_group

    def init_process_group(*args, **kwargs):
        echo.stop_clients()
        _, ECHO["during_world"] = _made_during_traffic(lambda: original(*args, **kwargs))

    dist.init_process_group = init_process_group
    echo.start_clients(ports=ports, every_s=EVERY_S, limit=LIMIT)


def _made_during_traffic(make):
    """make() while the client thread opens connections; the group and how
    many opened meanwhile."""
    echo = ECHO["echo"]
    echo.start_clients(ports=ECHO["ports"], every_s=EVERY_S, limit=echo.opened + LIMIT)
    time.sleep(0.02)
    before = echo.opened
    group = make()
    during = echo.opened - before
    echo.stop_clients()
    return group, during


def _wait_shut(inodes, bound_s=BOUND_S):
    """Whether every connection (descriptor: inode, taken before the break)
    was shut down within `bound_s`."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if all(shut_down(fd, inode) for fd, inode in inodes.items()):
            return True
        time.sleep(0.01)
    return False


def _break_and_check(ctx, group, during):
    """Rank 0 aborts `group` while rank 1 waits in a Gloo recv on it."""
    echo = ECHO["echo"]
    echo.stop_clients()
    backend = group._get_backend(CPU)
    fds, problem = backend._gloo_connections
    inodes = {fd: inode_of(fd) for fd in fds}
    program = echo.fds()
    out = {"during": during, "gloo": len(fds), "problem": problem,
           "overlap": sorted(set(fds) & program), "program": len(program)}
    registered = group in dist.distributed_c10d._world.pg_map

    def all_reduce(t):
        # A split group is not in torch's group map: its methods, then.
        dist.all_reduce(t, group=group) if registered else group.allreduce([t]).wait()

    def recv(t):
        dist.recv(t, 0, group=group) if registered else group.recv([t], 0, 0).wait()

    x = torch.ones(8)
    all_reduce(x)  # the group works before the break
    if ctx.rank == 0:
        time.sleep(0.3)
        backend.abort()
        out["error"] = None
    else:
        start = time.monotonic()
        out["error"] = error_message(lambda: recv(torch.empty(4)))
        out["error_s"] = time.monotonic() - start
    out["shut"] = _wait_shut(inodes)
    out["broken"] = echo.broken()
    out["server_errors"] = list(echo.server_errors)
    out["later"] = error_message(lambda: all_reduce(torch.ones(2)))
    return out


def _check(results, min_gloo=1):
    for r, out in enumerate(results):
        assert out["during"] > 0, f"rank {r}: no connection opened while the group was made"
        assert out["problem"] == "", out["problem"]
        assert out["gloo"] >= min_gloo, out
        assert out["overlap"] == [], f"rank {r}: the program's sockets taken as Gloo's: {out}"
        assert out["shut"], f"rank {r}: the group's Gloo connections were not shut down"
        assert out["broken"] == [], f"rank {r}: the program's connections broke: {out['broken']}"
        assert out["server_errors"] == [], out["server_errors"]
        assert out["later"] is not None and "rank 0 aborted the group" in out["later"], out
    err = results[1]["error"]
    assert err is not None and "rank 0 aborted the group" in err, err
    assert results[1]["error_s"] < BOUND_S, results[1]["error_s"]


@pytest.fixture
def serving_group():
    ports = [_free_port() for _ in range(2)]
    env = {"TEST_ECHO_PORTS": ",".join(map(str, ports))}
    group = Group(2, env=env, env_per_rank={r: {"TEST_ECHO_RANK": str(r)} for r in range(2)},
                  before_import=("test_serving", "start_echo_before_init"))
    yield group
    group.close()


def _world(ctx):
    return _break_and_check(ctx, dist.group.WORLD, ECHO["during_world"])


def _new_group(ctx):
    group, during = _made_during_traffic(lambda: dist.new_group(backend="tpcomm"))
    return _break_and_check(ctx, group, during)


def _split(ctx):
    # ProcessGroup.split_group: the backend's own split (the coordinator's).
    world = dist.group.WORLD
    group, during = _made_during_traffic(
        lambda: world.split_group([0, 1], group_name="serving_split"))
    return _break_and_check(ctx, group, during)


@pytest.mark.parametrize("how", ["world", "new_group", "split"])
def test_a_break_shuts_down_only_the_groups_gloo_connections(serving_group, how):
    results = serving_group.run({"world": _world, "new_group": _new_group,
                                 "split": _split}[how], timeout_s=120)
    _check(results)
    # Two ranks: one connection per Gloo group.
    assert [out["gloo"] for out in results] == [1, 1], results


# ------------------------------------------------------------ a group's lives
def _lives_worker(rank, port, paths, results):
    """Life 1: the world group, a new group and a split, all broken by rank
    0's abort; then, on the same store object, life 2: the same groups made
    again under the same names must start clean."""
    import sys
    import traceback
    from datetime import timedelta

    sys.path[:0] = paths
    out = {}
    try:
        import torch
        import torch.distributed as dist

        import tpcomm  # noqa: F401
        from harness import error_message

        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))

        def make():
            dist.init_process_group("tpcomm", store=store, rank=rank, world_size=2,
                                    timeout=timedelta(seconds=60))
            world = dist.group.WORLD
            groups = {"world": world, "new_group": dist.new_group([0, 1]),
                      "split": world.split_group([0, 1], group_name="lives_split")}
            return groups, {k: g.group_name for k, g in groups.items()}

        def use(groups):
            sums = {}
            for name, g in groups.items():
                x = torch.full((4,), float(rank + 1))
                dist.all_reduce(x, group=g)
                sums[name] = x.tolist()
            return sums

        groups, out["names1"] = make()
        out["sums1"] = use(groups)
        if rank == 0:
            for g in groups.values():
                g._get_backend(torch.device("cpu")).abort()
        else:
            out["errors1"] = {name: error_message(lambda g=g: g.allreduce([torch.ones(2)]).wait())
                              for name, g in groups.items()}
        out["faults1"] = {name: g._get_backend(torch.device("cpu")).fault
                          for name, g in groups.items()}
        dist.destroy_process_group()

        groups, out["names2"] = make()
        out["sums2"] = use(groups)
        # A Gloo call of each group, too.
        got = {}
        for name, g in groups.items():
            t = torch.full((3,), float(rank))
            # (the split group is not in torch's group map: its methods)
            if rank == 0:
                g.send([t + 10], 1, 0).wait()
            else:
                g.recv([t], 0, 0).wait()
            got[name] = t.tolist()
        out["p2p2"] = got
        out["faults2"] = {name: g._get_backend(torch.device("cpu")).fault
                          for name, g in groups.items()}
        dist.destroy_process_group()
    except BaseException:
        out["error"] = traceback.format_exc()
    results.put((rank, out))


def test_a_group_made_again_under_its_name_starts_clean():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    here = os.path.dirname(os.path.abspath(__file__))
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_lives_worker, args=(r, port, [here, os.path.dirname(here)],
                                                     results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    outs = {}
    try:
        for _ in procs:
            rank, out = results.get(timeout=180)
            outs[rank] = out
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    for rank in range(2):
        out = outs[rank]
        assert "error" not in out, out["error"]
        # The same names, so the same store keys but for the life.
        assert out["names1"] == out["names2"], (out["names1"], out["names2"])
        for name in ("world", "new_group", "split"):
            assert out["sums1"][name] == [3.0] * 4
            assert "rank 0 aborted the group" in out["faults1"][name], (rank, out["faults1"])
            assert out["sums2"][name] == [3.0] * 4, (rank, name, out)
            assert out["p2p2"][name] == ([0.0] * 3 if rank == 0 else [10.0] * 3)
            assert out["faults2"][name] == "", (rank, out["faults2"])
    for name, msg in outs[1]["errors1"].items():
        assert msg is not None and "rank 0 aborted the group" in msg, (name, msg)
