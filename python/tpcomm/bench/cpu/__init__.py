"""python -m tpcomm.bench cpu: CPU collectives through plain Gloo, tpcomm with
its shared-memory path off, and tpcomm with it on, interleaved in one process
set per world size (so the three see the same machine load), for
all_reduce, all_gather_into_tensor and reduce_scatter_tensor from 4 B to
64 MB. Prints us/call, algorithm bandwidth and the ratio to Gloo, and saves a
plot of time against size when matplotlib is installed. --dtype sends
bfloat16 or float16 instead of float32 (same bytes); --threads N adds the
path with N worker threads per rank (TPCOMM_CPU_SHM_THREADS) beside the
default's. --dtypes, --paths, --late and --bound run the benchmarks of
dtypes.py, paths.py, late.py and bound.py beside this file instead (--hosts:
hosts.py).
"""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks

OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def sizes(max_mib, quick):
    sizes, n = [], 4
    while n <= max_mib << 20:
        sizes.append(n)
        n *= 4 if not quick else 16
    return sizes


def iters_for(nbytes, quick):
    if nbytes <= 64 << 10:
        iters = 100
    elif nbytes <= 1 << 20:
        iters = 20
    elif nbytes <= 4 << 20:
        iters = 8
    else:
        iters = 3
    return max(2, iters // 4) if quick else iters


def best_interleaved(calls, iters, rounds, control, lead=True):
    """{key: seconds per call}: each call run `iters` times in a row (an int,
    or {key: int}), the calls interleaved round after round (so they see the
    same machine load), the slowest rank's time kept per round and the best
    round kept. With `lead`, one untimed call opens each block: the ranks
    leave the barrier tens of us apart (loopback Gloo), and a first call that
    waits for its peer would otherwise count that in a block of 2 us calls."""
    best = {key: float("inf") for key in calls}
    for _ in range(rounds):
        for key, fn in calls.items():
            n = iters[key] if isinstance(iters, dict) else iters
            dist.barrier(group=control)
            if lead:
                fn()
            start = time.perf_counter()
            for _ in range(n):
                fn()
            elapsed = torch.tensor([(time.perf_counter() - start) / n])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=control)
            best[key] = min(best[key], elapsed.item())
    return best


def iters_by_time(calls, floor, control, block_s=2e-3, most=5000):
    """{key: iterations}: enough that a block of the call lasts block_s (at
    least `floor`, at most `most`), from the slowest rank's time of a block
    of 5 calls, the same on every rank."""
    took = best_interleaved(calls, 5, 1, control)
    return {key: max(floor, min(most, int(block_s / max(t, 1e-9)))) for key, t in took.items()}


def _call(op, group, world, nbytes, dtype=torch.float32):
    """A closure running one call of `op` whose per-rank payload is nbytes
    of `dtype` (at least one element per rank)."""
    n = max(1, nbytes // dtype.itemsize)
    if op == "all_reduce":
        x = torch.ones(n, dtype=dtype)
        return lambda: dist.all_reduce(x, group=group)
    if op == "all_gather_into_tensor":
        x = torch.ones(n, dtype=dtype)
        out = torch.empty(n * world, dtype=dtype)
        return lambda: dist.all_gather_into_tensor(out, x, group=group)
    x = torch.ones(n * world, dtype=dtype)
    out = torch.empty(n, dtype=dtype)
    return lambda: dist.reduce_scatter_tensor(out, x, group=group)


def _threaded(threads):
    return f"tpcomm shm on, {threads} threads"


def _worker(rank, world, port, max_mib, quick, rounds, dtype, threads, ops, results):
    import tpcomm

    torch.set_num_threads(1)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    control = dist.new_group(backend="gloo")  # barriers and the max of the timings
    groups = {"gloo": dist.new_group(backend="gloo"),
              "tpcomm shm off": dist.new_group(backend="tpcomm"),
              "tpcomm shm on": dist.new_group(backend="tpcomm")}
    tpcomm._backend_of(groups["tpcomm shm off"]).set_cpu_shm_mode("0")
    tpcomm._backend_of(groups["tpcomm shm on"]).set_cpu_shm_mode("auto")
    if threads:
        groups[_threaded(threads)] = dist.new_group(backend="tpcomm")
        tpcomm._backend_of(groups[_threaded(threads)]).set_cpu_shm_threads(threads)
    for g in groups.values():
        dist.barrier(group=g)  # sets the path up (or not)
    assert tpcomm.describe(groups["tpcomm shm on"])["cpu_shm"]["available"]
    rows = []
    for op in ops:
        for nbytes in sizes(max_mib, quick):
            calls = {p: _call(op, g, world, nbytes, dtype) for p, g in groups.items()}
            for fn in calls.values():
                fn()  # warm-up
            iters = iters_by_time(calls, iters_for(nbytes, quick), control)
            best = best_interleaved(calls, iters, rounds, control)
            rows.append((op, nbytes, best))
    if rank == 0:
        default = tpcomm.describe(groups["tpcomm shm on"])["cpu_shm"]["threads"]
        results.put((default, rows))
    dist.destroy_process_group()


def fmt_bytes(n):
    for unit, size in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"


def _save_plot(table, png):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    worlds = sorted(table)
    ops = sorted({r[0] for rows in table.values() for r in rows}, key=OPS.index)
    fig, axes = plt.subplots(len(worlds), len(ops), figsize=(5 * len(ops), 4 * len(worlds)),
                             squeeze=False)
    for i, world in enumerate(worlds):
        rows = table[world]
        for j, op in enumerate(ops):
            ax = axes[i][j]
            mine = [r for r in rows if r[0] == op]
            xs = [r[1] for r in mine]
            for path in mine[0][2]:
                ax.plot(xs, [r[2][path] * 1e6 for r in mine], marker="o", label=path)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{op}, {world} ranks")
            ax.set_xlabel("bytes per rank")
            ax.set_ylabel("us per call")
            ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"plot: {png}")


def run(world_sizes=(2, 4), max_mib=64, quick=False, png="cpu_bench.png", rounds=3,
        dtype="float32", threads=0, ops=OPS):
    import os

    dtype = getattr(torch, dtype)
    cores = os.cpu_count()
    print(f"CPU collectives of {str(dtype).replace('torch.', '')}, {cores} cores; best of "
          f"{rounds} interleaved rounds per size; bytes are per rank (all_gather input, "
          "reduce_scatter output); algbw = bytes / time")
    table = {}
    for world in world_sizes:
        got = run_ranks(_worker, world,
                        lambda r: (max_mib, quick, rounds, dtype, threads, tuple(ops)), 3600)
        if got is None:
            print(f"world size {world}: a rank failed", file=sys.stderr)
            return 1
        default, rows = got
        table[world] = rows
        extra = _threaded(threads) if threads else None
        for op in ops:
            print(f"\n{op}, world size {world} (shm on: {default} thread(s) per rank)")
            print(f"{'size':>8s} {'gloo us':>10s} {'shm off us':>11s} {'shm on us':>10s} "
                  f"{'on GB/s':>8s} {'off/gloo':>9s} {'gloo/on':>8s}" +
                  (f" {f'{threads} thr us':>10s} {'on/thr':>7s}" if extra else ""))
            for o, nbytes, best in rows:
                if o != op:
                    continue
                gloo, off, on = best["gloo"], best["tpcomm shm off"], best["tpcomm shm on"]
                line = (f"{fmt_bytes(nbytes):>8s} {gloo * 1e6:10.1f} {off * 1e6:11.1f} "
                        f"{on * 1e6:10.1f} {nbytes / on / 1e9:8.2f} {off / gloo:8.2f}x "
                        f"{gloo / on:7.1f}x")
                if extra:
                    line += f" {best[extra] * 1e6:10.1f} {on / best[extra]:6.2f}x"
                print(line)
    if png:
        _save_plot(table, png)
    return 0
