"""python -m tpcomm.bench faults: tpcomm probed as its worst users would.

Four kinds of probe, each in fresh local processes, and one summary table:

- bad inputs: every rank makes the same wrong call; each must raise a clear
  error (not a communication failure), and the group must work afterwards;
- one-rank mistakes under TPCOMM_DEBUG=1 (shapes, split sizes, a list
  refused on the root): every rank must raise naming the mistake;
- one-rank mistakes without TPCOMM_DEBUG (a bad argument on one rank only,
  refused by tpcomm or by torch's Python front door; an abort on one rank):
  on the shared-memory and the Gloo route, every other rank must raise
  within 1 s naming that rank (coordinator/faults/group_fault.hpp);
- kill -9 of one role during traffic (a Gloo collective, a shared-memory
  collective, a barrier, the queue's writer, a queue reader): every survivor
  must raise within twice the group's timeout of the kill.

Per probe it counts outcomes tried (a call on one rank, or one survivor of a
kill), clear errors, timeouts (a rank still waiting past the bound), crashes
(a survivor that died) and wrong results.
"""

import os
import signal
import time
import warnings
from datetime import timedelta

import torch
import torch.multiprocessing as mp

from tpcomm._net import free_port

COLUMNS = ("tried", "clear errors", "timeouts", "crashes", "wrong results")


def _error(call):
    """(type name, message) of what call() raised, or None."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - classified by the caller
        return type(e).__name__, str(e)
    return None


# The rank that makes each one-rank mistake with a bad argument (0 where the
# argument is the root's); the tests use the same cases.
ONE_RANK_MISTAKES = {
    "scatter_list_length": 0, "gather_list_length": 0, "split_sizes": 1, "split_count": 1,
    "all_to_all_lists": 1, "all_gather_list": 1, "reduce_scatter_list": 1,
    "into_tensor_size": 1, "bitwise_on_float": 1, "non_contiguous": 1,
    "scatter_list_missing": 0, "gather_list_on_a_non_root": 1,
}


def one_rank_mistake(case, world, rank, group):
    """The call of `case` as `rank` makes it on `group`: ONE_RANK_MISTAKES[case]
    with a bad argument, the others well. The last two are refused by torch's
    Python front door, before any backend is reached; the others by tpcomm."""
    import torch.distributed as dist

    w, r, g = world, rank, group
    x = torch.ones(4)
    mine = r == ONE_RANK_MISTAKES[case]
    calls = {
        "scatter_list_length": lambda: dist.scatter(
            torch.empty(4), [torch.ones(4)] * (w + 1) if r == 0 else None, src=0, group=g),
        "gather_list_length": lambda: dist.gather(
            x, [torch.empty(4)] * (w + 1) if r == 0 else None, dst=0, group=g),
        "split_sizes": lambda: dist.all_to_all_single(
            torch.empty(4 * w), torch.ones(4 * w),
            [5] + [4] * (w - 1) if mine else [4] * w, [4] * w, group=g),
        "split_count": lambda: dist.all_to_all_single(
            torch.empty(4 * w), torch.ones(4 * w), [4] * w,
            [4] * (w + 1) if mine else [4] * w, group=g),
        "all_to_all_lists": lambda: dist.all_to_all(
            [torch.empty(1) for _ in range(w)],
            [torch.ones(1) for _ in range(w + 1 if mine else w)], group=g),
        "all_gather_list": lambda: dist.all_gather(
            [torch.empty(4) for _ in range(w + 1 if mine else w)], x, group=g),
        "reduce_scatter_list": lambda: dist.reduce_scatter(
            torch.empty(4), [torch.ones(4) for _ in range(w + 2 if mine else w)], group=g),
        "into_tensor_size": lambda: dist.all_gather_into_tensor(
            torch.empty(4 * w + (1 if mine else 0)), x, group=g),
        "bitwise_on_float": lambda: dist.all_reduce(
            x, op=dist.ReduceOp.BAND if mine else dist.ReduceOp.SUM, group=g),
        "non_contiguous": lambda: dist.all_reduce(
            torch.ones(4, 3).t() if mine else torch.ones(3, 4), group=g),
        "scatter_list_missing": lambda: dist.scatter(torch.empty(4), None, src=0, group=g),
        "gather_list_on_a_non_root": lambda: dist.gather(
            x, [torch.empty(4)] * w if r in (0, ONE_RANK_MISTAKES[case]) else None, dst=0,
            group=g),
    }
    return calls[case]


# ------------------------------------------------------------------ probes
def _bad_inputs(rank, world, timeout_s, conn):
    import torch.distributed as dist

    R = dist.ReduceOp
    x = torch.ones(4)
    root = dist.BroadcastOptions()
    root.rootTensor = 3
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    calls = {
        "bitwise op on float": lambda: dist.all_reduce(x.clone(), op=R.BAND),
        "AVG on bool": lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool), op=R.AVG),
        "int16 allreduce": lambda: dist.all_reduce(torch.ones(3, dtype=torch.int16)),
        "float8 reduce_scatter": lambda: dist.reduce_scatter_tensor(
            torch.empty(2, dtype=torch.float8_e4m3fn),
            torch.ones(2 * world).to(torch.float8_e4m3fn)),
        "gather list length": lambda: dist.all_gather([torch.empty(4)] * (world + 1), x),
        "output size": lambda: dist.all_gather_into_tensor(torch.empty(4 * world + 1), x),
        "mixed dtypes": lambda: dist.all_gather_into_tensor(
            torch.empty(4 * world, dtype=torch.float64), x),
        "split sum": lambda: dist.all_to_all_single(torch.empty(4), torch.ones(4),
                                                    [5] + [0] * (world - 1)),
        "0-dim all_to_all": lambda: dist.all_to_all_single(torch.empty(()), torch.ones(())),
        "non-contiguous": lambda: dist.all_reduce(torch.ones(4, 3).t()),
        "root out of range": lambda: dist.broadcast(x, world + 3),
        "rootTensor out of range": lambda: backend.broadcast([x], root),
        "sparse AVG": lambda: dist.all_reduce(
            torch.sparse_coo_tensor([[0]], [1.0], (2,)), op=R.AVG),
        "sparse in a tensor dict": lambda: __import__("tpcomm")._tensor_dict.split(
            {"s": torch.sparse_coo_tensor([[0]], [1.0], (2,))}),
        "queue writer_rank as str": lambda: __import__("tpcomm").MessageQueue
        .create_from_process_group(dist.group.WORLD, writer_rank="0"),
    }
    rows = []
    for name, call in calls.items():
        err = _error(call)
        y = torch.ones(3)
        dist.all_reduce(y)  # the group must still work
        usable = torch.equal(y, torch.full((3,), float(world)))
        rows.append((name, err, usable))
    conn.send(("result", rows))


def _ring(rank, world, send, recv):
    """Sends to the next rank and receives from the previous one; raises the
    first error once both calls ended."""
    import torch.distributed as dist

    works = [dist.isend(send, (rank + 1) % world), dist.irecv(recv, (rank - 1) % world)]
    errors = []
    for work in works:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001 - the first is raised below
            errors.append(e)
    if errors:
        raise errors[0]


def _debug_mistakes(rank, world, timeout_s, conn):
    import torch.distributed as dist

    splits = [1] * world
    if rank == 0:
        splits[1] = 2
    calls = {
        "shapes differ": lambda: dist.all_reduce(torch.ones(4 + (rank == 1))),
        "split sizes disagree": lambda: dist.all_to_all_single(
            torch.empty(world), torch.ones(sum(splits)), [1] * world, splits),
        "scatter list refused on the root": lambda: dist.scatter(
            torch.empty(2), [torch.ones(2)] * (world + 1) if rank == 0 else None, src=0),
        # A ring in which every send is larger than the recv it meets.
        "send/recv sizes differ": lambda: _ring(rank, world, torch.ones(8), torch.empty(4)),
        "send/recv dtypes differ": lambda: _ring(
            rank, world, torch.ones(4), torch.empty(4, dtype=torch.int32)),
    }
    rows = []
    for name, call in calls.items():
        err = _error(call)
        y = torch.ones(3)
        dist.all_reduce(y)
        rows.append((name, err, torch.equal(y, torch.full((3,), float(world)))))
    conn.send(("result", rows))


def _one_rank(rank, world, timeout_s, conn):
    """Each one-rank mistake, then an abort by rank 0 while the others wait in
    an allreduce, each on a group of its own: what every rank raised and when
    (wall clock), with the time rank 0 aborted."""
    import torch.distributed as dist

    rows = []
    for case in list(ONE_RANK_MISTAKES) + ["abort"]:
        g = dist.new_group(backend="tpcomm")
        dist.all_reduce(torch.ones(1), group=g)  # the route is set up
        dist.barrier(group=g)
        start = time.time()
        if case == "abort":
            bad = 0
            if rank == 0:
                time.sleep(0.2)
                start = time.time()
                g._get_backend(torch.device("cpu")).abort()
                err = None
            else:
                err = _error(lambda: dist.all_reduce(torch.ones(4), group=g))
        else:
            bad = ONE_RANK_MISTAKES[case]
            err = _error(one_rank_mistake(case, world, rank, g))
        rows.append((case, bad, err, start, time.time()))
    conn.send(("result", rows))
    dist.barrier()  # rank 0 hosts the store the others read the causes from


def _one_rank_row(world, env, bound_s=1.0):
    """Every peer of the rank that made the mistake must raise within bound_s
    of it (of the abort), naming that rank; the note gives the slowest."""
    messages, codes = _launch(world, env, 60, "one_rank")
    row = dict.fromkeys(COLUMNS, 0)
    results = {}
    for r in range(world):
        found = [m[1] for m in messages[r] if m[0] == "result"]
        if codes[r] == "hung":
            row["timeouts"] += 1
        elif codes[r] != 0 or not found:
            row["crashes"] += 1
        else:
            results[r] = {case: rest for case, *rest in found[0]}
    took = []
    for r, cases in results.items():
        for case, (bad, err, _, end) in cases.items():
            if r == bad:
                continue
            row["tried"] += 1
            began = max(c[case][2] for c in results.values())  # the last rank's call
            took.append(end - began)
            if err is None and case == "gather_list_on_a_non_root" and r != 0:
                # A non-root's gather needs only the root: it completed.
                row["clear errors"] += 1
                continue
            if err is None or f"rank {bad} " not in err[1]:
                row["wrong results"] += 1
                print(f"  rank {r}, {case}: {err}")
            elif took[-1] > bound_s:
                row["timeouts"] += 1
                print(f"  rank {r}, {case}: raised after {took[-1]:.2f} s")
            else:
                row["clear errors"] += 1
    if took:
        row["note"] = f"peers raised after {min(took):.2f}-{max(took):.2f} s"
    return row


def _traffic(role, rank, world, dist):
    """One step of the role's traffic; returns False on a wrong result."""
    if role in ("allreduce (Gloo)", "allreduce (shared memory)"):
        t = torch.full((64,), float(rank))
        dist.all_reduce(t)
        return t[0].item() == sum(range(world))
    dist.barrier()
    return True


def _killed(role, rank, world, timeout_s, conn):
    import torch.distributed as dist

    import tpcomm

    victim = 0 if role == "queue writer" else world - 1
    mq = None
    if role.startswith("queue"):
        mq = tpcomm.MessageQueue.create_from_process_group(
            dist.group.WORLD, max_chunk_bytes=1 << 12, max_chunks=2, timeout=timeout_s)
    wrong = 0
    try:
        for step in range(1_000_000):
            if rank == victim and step == 20:
                conn.send(("kill", time.time()))
                time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)
            if mq is None:
                wrong += not _traffic(role, rank, world, dist)
            elif mq.is_writer:
                mq.enqueue(step)
            else:
                wrong += mq.dequeue() != step
    except Exception as e:  # noqa: BLE001 - the survivor's error is the result
        conn.send(("result", (time.time(), type(e).__name__, str(e)[:200], wrong)))


KILL_ROLES = {
    "allreduce (Gloo)": {"TPCOMM_CPU_SHM": "0"},
    "allreduce (shared memory)": {"TPCOMM_CPU_SHM": "1"},
    "barrier": {"TPCOMM_CPU_SHM": "1"},
    "queue writer": {},
    "queue reader": {},
}


def _rank_main(rank, world, port, env, timeout_s, probe, role, conn):
    os.environ.update(env)
    warnings.filterwarnings("ignore", message=".*[Ss]parse.*")  # torch's beta notice
    import torch.distributed as dist

    import tpcomm  # noqa: F401

    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    if probe == "kill":
        _killed(role, rank, world, timeout_s, conn)
    else:
        {"bad": _bad_inputs, "debug": _debug_mistakes,
         "one_rank": _one_rank}[probe](rank, world, timeout_s, conn)
    os._exit(0)  # a group whose peer died cannot be torn down politely


def _launch(world, env, timeout_s, probe, role=None, wait_s=120):
    """Runs one probe; returns {rank: [messages]} and {rank: exit code}."""
    ctx = mp.get_context("spawn")
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [ctx.Process(target=_rank_main,
                         args=(r, world, port, env, timeout_s, probe, role, pipes[r][1]))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    messages = {}
    for r, (recv, _) in enumerate(pipes):
        messages[r] = []
        while recv.poll(0):
            messages[r].append(recv.recv())
    codes = {}
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
            codes[r] = "hung"
        else:
            codes[r] = p.exitcode
    return messages, codes


def _count_calls(world, env, probe, clear_if):
    messages, codes = _launch(world, env, 20, probe)
    row = dict.fromkeys(COLUMNS, 0)
    for r in range(world):
        results = [m[1] for m in messages[r] if m[0] == "result"]
        if codes[r] == "hung":
            row["timeouts"] += 1
            continue
        if codes[r] != 0 or not results:
            row["crashes"] += 1
            continue
        for name, err, usable in results[0]:
            row["tried"] += 1
            if err is not None and clear_if(err) and usable:
                row["clear errors"] += 1
            else:
                row["wrong results"] += 1
                print(f"  rank {r}, {name}: {err} (group usable: {usable})")
    return row


def _kill_row(role, world, timeout_s):
    messages, codes = _launch(world, KILL_ROLES[role], timeout_s, "kill", role,
                              wait_s=4 * timeout_s + 60)
    killed_at = [m[1] for ms in messages.values() for m in ms if m[0] == "kill"]
    row = dict.fromkeys(COLUMNS, 0)
    row["tried"] = world - 1  # one outcome per survivor
    took = []
    for r in range(world):
        results = [m[1] for m in messages[r] if m[0] == "result"]
        if any(m[0] == "kill" for m in messages[r]):
            continue  # the victim
        if codes[r] == "hung":
            row["timeouts"] += 1
        elif codes[r] != 0 or not results or not killed_at:
            row["crashes"] += 1
        else:
            raised_at, _, _, wrong = results[0]
            took.append(raised_at - killed_at[0])
            if wrong:
                row["wrong results"] += 1
            elif took[-1] <= 2 * timeout_s:
                row["clear errors"] += 1
            else:
                row["timeouts"] += 1
    row["note"] = "survivors raised after " + ", ".join(f"{t:.1f}" for t in took) + " s"
    return row


def _clear_usage_error(err):
    kind, message = err
    return kind in ("RuntimeError", "ValueError", "TypeError") and "DistBackend" not in kind \
        and len(message) > 20


def _debug_error(err):
    return err[0] == "RuntimeError" and ("TPCOMM_DEBUG" in err[1] or "refused" in err[1])


def run(world_sizes=(2, 3), timeout_s=3.0, quick=False):
    """Prints one table; returns 0 when every probe ended in clear errors."""
    rows = []
    for world in world_sizes:
        rows.append((f"bad inputs, every rank ({world} ranks)",
                     _count_calls(world, {}, "bad", _clear_usage_error)))
    debug_world = max(world_sizes)
    rows.append((f"one-rank mistakes, TPCOMM_DEBUG=1 ({debug_world} ranks)",
                 _count_calls(debug_world, {"TPCOMM_DEBUG": "1"}, "debug", _debug_error)))
    for route, env in (("shared memory", {"TPCOMM_CPU_SHM": "1"}),
                       ("Gloo", {"TPCOMM_CPU_SHM": "0"})):
        for world in ((2,) if quick else world_sizes):
            rows.append((f"one-rank mistakes and an abort, {route} ({world} ranks)",
                         _one_rank_row(world, env)))
    roles = list(KILL_ROLES)[:2] + ["queue writer"] if quick else list(KILL_ROLES)
    for role in roles:
        rows.append((f"kill -9: {role} (3 ranks)", _kill_row(role, 3, timeout_s)))
    print(f"\ntpcomm fault probes (group timeout {timeout_s:g} s; a survivor must raise "
          f"within {2 * timeout_s:g} s of a kill)")
    print("(one-rank mistakes: every other rank must raise within 1 s, naming the rank)")
    print(f"{'probe':48s} " + " ".join(f"{c:>13s}" for c in COLUMNS))
    total = dict.fromkeys(COLUMNS, 0)
    for name, row in rows:
        print(f"{name:48s} " + " ".join(f"{row[c]:13d}" for c in COLUMNS) +
              (f"   {row['note']}" if "note" in row else ""))
        for c in COLUMNS:
            total[c] += row[c]
    print(f"{'total':48s} " + " ".join(f"{total[c]:13d}" for c in COLUMNS))
    bad = total["timeouts"] + total["crashes"] + total["wrong results"]
    return 0 if bad == 0 and total["clear errors"] > 0 else 1
