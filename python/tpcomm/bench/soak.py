"""python -m tpcomm.bench soak: a pair of ranks serving as an inference
server would, for up to ten minutes (--minutes).

Each rank runs an echo server and a client thread that keeps its
connections open (tpcomm.bench.serving), and a message queue over the
world group carries every cycle's step object. Each cycle makes a group
(new_group), uses it (allreduce, broadcast, send/recv, checked against
closed forms), breaks it one of three ways and destroys it:

- abort: rank 0 aborts the group while rank 1 waits in a recv on it;
- refusal: rank 0 makes a scatter torch refuses, rank 1 the good one;
- killed peer: rank 1 starts a process that joins a pair group with rank 0
  through a store of its own; rank 0 waits in an allreduce the process
  never joins and rank 1 kills it (SIGKILL).

Each break's time from its cause (the abort, the bad call, the kill) to
the error on the other rank is taken. After a first cycle of each kind
(warm-up) and at the end, each rank counts its descriptors, threads,
memory mappings and resident memory; the table shows both and the
difference, the cycles of each kind, the slowest break, and whether every
one of the program's connections still answers.
"""

import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tpcomm._net import free_port, run_ranks

KINDS = ("abort", "refusal", "killed peer")


def _resources():
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    return {"descriptors": len(os.listdir("/proc/self/fd")),
            "threads": int(status["Threads"].strip()),
            "mappings": maps,
            "rss_mib": int(status["VmRSS"].split()[0]) / 1024}


def _pair(store, rank):
    """A tpcomm group of two through `store`, made as torch's creator makes
    it (the pair has no default group of its own on rank 0)."""
    from tpcomm._registration import _create_backend

    class _Options:
        pass

    opts = _Options()
    opts.store, opts.group_rank, opts.group_size = store, rank, 2
    opts.timeout, opts.group_id, opts.global_ranks_in_group = timedelta(seconds=60), "pair", [0, 1]
    return _create_backend(opts, None)


def _pair_child(port, ready, kill_me):
    """The process rank 1 starts for a killed-peer cycle: rank 1 of a pair
    group with rank 0, through a store of its own."""
    import tpcomm  # noqa: F401

    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=60))
    pair = _pair(store, 1)
    pair.allreduce([torch.ones(4)]).wait()
    ready.set()
    kill_me.wait(120)
    time.sleep(120)  # killed here


def _use(g, rank, step):
    x = torch.full((1024,), float(rank + 1))
    dist.all_reduce(x, group=g)
    assert torch.all(x == 3.0), x[:4]
    y = torch.full((16,), float(step if rank == 0 else -1))
    dist.broadcast(y, 0, group=g)
    assert torch.all(y == float(step)), y[:4]
    t = torch.zeros(300)
    if rank == 0:
        dist.send(torch.arange(300, dtype=torch.float32) + step, 1, group=g)
    else:
        dist.recv(t, 0, group=g)
        assert torch.equal(t, torch.arange(300, dtype=torch.float32) + step)


def _break(kind, g, rank, world_group):
    """Breaks `g` as `kind`: rank 0 causes it (aborts the group, or makes a
    scatter torch refuses: no list where it is the source) while rank 1
    waits in a call on it. On rank 1, the seconds from the cause to its
    error; None on rank 0."""
    if kind == "abort":
        cause = lambda: g._get_backend(torch.device("cpu")).abort()  # noqa: E731
        wait = lambda: dist.recv(torch.empty(4), 0, group=g)  # noqa: E731
    else:
        def cause():
            try:
                dist.scatter(torch.empty(4), None, src=0, group=g)
            except ValueError:
                return
            raise AssertionError("torch took a scatter without a list")

        wait = lambda: dist.scatter(torch.empty(4), None, src=0, group=g)  # noqa: E731
    if rank == 0:
        time.sleep(0.2)  # rank 1 waits by then
        at = time.time()
        cause()
        dist.broadcast_object_list([at], 0, group=world_group)
        return None
    try:
        wait()
    except RuntimeError:
        ended = time.time()
    else:
        raise AssertionError(f"rank 1's call on a group broken by {kind} returned")
    at = [None]
    dist.broadcast_object_list(at, 0, group=world_group)
    return ended - at[0]


def _killed_peer(rank, world_group):
    """Rank 0 and a process of rank 1's: the process is killed while rank 0
    waits on their pair group. Rank 0's error time from the kill."""
    if rank == 0:
        port = free_port()
        dist.broadcast_object_list([port], 0, group=world_group)
        store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=60))
        pair = _pair(store, 0)
        pair.allreduce([torch.ones(4)]).wait()
        dist.barrier(group=world_group)  # the process is ready
        err = None
        try:
            pair.allreduce([torch.ones(4)]).wait()
        except RuntimeError as e:
            err = str(e)
        ended = time.time()
        got = [None]
        dist.broadcast_object_list(got, 1, group=world_group)
        assert err is not None and ("died" in err or "lost" in err.lower() or "closed" in err
                                    or "exited" in err or "gone" in err), err
        del pair
        del store
        return ended - got[0]
    got = [None]
    dist.broadcast_object_list(got, 0, group=world_group)
    ctx = mp.get_context("spawn")
    ready, kill_me = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_pair_child, args=(got[0], ready, kill_me), daemon=True)
    child.start()
    assert ready.wait(120), "the pair's process did not start"
    dist.barrier(group=world_group)
    time.sleep(0.3)  # rank 0 waits in its allreduce
    cause = time.time()
    os.kill(child.pid, signal.SIGKILL)
    child.join(30)
    dist.broadcast_object_list([cause], 1, group=world_group)
    return None


def _worker(rank, world, port, seconds, results):
    import tpcomm
    from tpcomm.bench.serving import EchoTraffic
    from tpcomm.message_queue import MessageQueue

    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    control = dist.new_group(backend="gloo")
    echo = EchoTraffic()
    ports = [None, None]
    dist.all_gather_object(ports, echo.port, group=control)
    echo.start_clients(ports=ports, every_s=0.005, limit=200)
    mq = MessageQueue.create_from_process_group(dist.group.WORLD, writer_rank=0)
    counts = {k: 0 for k in KINDS}
    slowest = {k: 0.0 for k in KINDS}
    start_res = None
    deadline = time.monotonic() + seconds
    step = 0
    while True:
        step += 1
        kind = KINDS[(step - 1) % len(KINDS)]
        obj = mq.broadcast_object({"step": step, "kind": kind} if rank == 0 else None)
        assert obj == {"step": step, "kind": kind}, obj
        if kind == "killed peer":
            took = _killed_peer(rank, control)
        else:
            g = dist.new_group(backend="tpcomm")
            _use(g, rank, step)
            took = _break(kind, g, rank, control)
            dist.destroy_process_group(g)
        if took is not None:
            slowest[kind] = max(slowest[kind], took)
        counts[kind] += 1
        if step == len(KINDS):
            dist.barrier(group=control)
            start_res = _resources()
        stop = [time.monotonic() > deadline and step >= 2 * len(KINDS) and step % len(KINDS) == 0]
        dist.broadcast_object_list(stop, 0, group=control)
        if stop[0]:
            break
    echo.stop_clients()
    dist.barrier(group=control)
    end_res = _resources()
    broken = echo.broken()
    out = {"rank": rank, "start": start_res, "end": end_res, "counts": counts,
           "slowest": slowest, "connections": echo.opened, "broken": len(broken),
           "server_errors": len(echo.server_errors)}
    everyone = [None, None]
    dist.all_gather_object(everyone, out, group=control)
    if rank == 0:
        results.put(everyone)
    mq.shutdown() if hasattr(mq, "shutdown") else None
    echo.close()
    os._exit(0)


def run(minutes=10.0):
    seconds = max(10.0, minutes * 60)
    outs = run_ranks(_worker, 2, lambda r: (seconds,), timeout_s=seconds + 600)
    if outs is None:
        print("soak failed", file=sys.stderr)
        return 1
    cycles = outs[0]["counts"]
    print(f"soak: {sum(cycles.values())} cycles in about {seconds / 60:.1f} min ("
          + ", ".join(f"{k}: {v}" for k, v in cycles.items()) + ")")
    print(f"{'rank':>4} {'what':>12} {'after warm-up':>14} {'at the end':>11} {'growth':>8}")
    for out in outs:
        for key in ("descriptors", "threads", "mappings", "rss_mib"):
            a, b = out["start"][key], out["end"][key]
            print(f"{out['rank']:>4} {key:>12} {a:>14.1f} {b:>11.1f} {b - a:>+8.1f}")
    for kind in KINDS:
        worst = max(o["slowest"][kind] for o in outs)
        print(f"slowest break seen, {kind}: {worst * 1000:.0f} ms")
    for out in outs:
        print(f"rank {out['rank']}: {out['connections']} client connections, "
              f"{out['broken']} broken, {out['server_errors']} server errors")
    return 0
