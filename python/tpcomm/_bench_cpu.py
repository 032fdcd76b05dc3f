"""python -m tpcomm.bench cpu: CPU collectives through plain Gloo, tpcomm with
its shared-memory path off, and tpcomm with it on, interleaved in one process
set per world size (so the three see the same machine load), for
all_reduce, all_gather_into_tensor and reduce_scatter_tensor from 4 B to
64 MB. Prints us/call, algorithm bandwidth and the ratio to Gloo, and saves a
plot of time against size when matplotlib is installed.

With --late: what a peer that arrives late costs, per waiting policy: rank 1
calls a 4-byte all_reduce a set time after rank 0; printed are rank 0's time
beyond that lateness and rank 1's time in its call (the wake-up it may owe).

With --paths: the same all_reduce through each way callers reach it, side by
side: dist.all_reduce, with async_op=True and wait(), the functional
collective (_c10d_functional.all_reduce + wait_tensor, what DTensor and
compiled code call), GroupCoordinator.all_reduce (its op,
torch.ops.tpcomm.all_reduce, on a world-size-1 group), the ProcessGroup's and
the Backend's own allreduce([t]).wait(); at 2 ranks and on a world-size-1
group of each rank.

With --dtypes: the shared-memory all_reduce of float32, bfloat16 and float16
at the same bytes per rank, with the reductions' best kernels and with the
portable ones (TPCOMM_CPU_REDUCE_ISA=portable), interleaved in one run.
"""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks

PATHS = ("gloo", "tpcomm shm off", "tpcomm shm on")
OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def _sizes(max_mib, quick):
    sizes, n = [], 4
    while n <= max_mib << 20:
        sizes.append(n)
        n *= 4 if not quick else 16
    return sizes


def _iters(nbytes, quick):
    if nbytes <= 64 << 10:
        iters = 100
    elif nbytes <= 1 << 20:
        iters = 20
    elif nbytes <= 4 << 20:
        iters = 8
    else:
        iters = 3
    return max(2, iters // 4) if quick else iters


def _call(op, group, world, nbytes):
    """A closure running one call of `op` whose per-rank payload is nbytes
    of float32 (at least one element per rank)."""
    n = max(1, nbytes // 4)
    if op == "all_reduce":
        x = torch.ones(n)
        return lambda: dist.all_reduce(x, group=group)
    if op == "all_gather_into_tensor":
        x = torch.ones(n)
        out = torch.empty(n * world)
        return lambda: dist.all_gather_into_tensor(out, x, group=group)
    x = torch.ones(n * world)
    out = torch.empty(n)
    return lambda: dist.reduce_scatter_tensor(out, x, group=group)


def _worker(rank, world, port, max_mib, quick, rounds, results):
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
    for g in groups.values():
        dist.barrier(group=g)  # sets the path up (or not)
    assert tpcomm.describe(groups["tpcomm shm on"])["cpu_shm"]["available"]
    rows = []
    for op in OPS:
        for nbytes in _sizes(max_mib, quick):
            calls = {p: _call(op, g, world, nbytes) for p, g in groups.items()}
            for fn in calls.values():
                fn()  # warm-up
            best = {p: float("inf") for p in PATHS}
            iters = _iters(nbytes, quick)
            for _ in range(rounds):
                for path in PATHS:
                    dist.barrier(group=control)
                    start = time.perf_counter()
                    for _ in range(iters):
                        calls[path]()
                    elapsed = torch.tensor([(time.perf_counter() - start) / iters])
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=control)
                    best[path] = min(best[path], elapsed.item())
            rows.append((op, nbytes, best["gloo"], best["tpcomm shm off"], best["tpcomm shm on"]))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_PATHS = tuple((level, dtype) for level in ("best", "portable") for dtype in DTYPES)


def _dtype_worker(rank, world, port, max_mib, quick, rounds, results):
    import tpcomm

    torch.set_num_threads(1)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    control = dist.new_group(backend="gloo")
    groups = {"best": dist.new_group(backend="tpcomm"),
              "portable": dist.new_group(backend="tpcomm")}
    tpcomm._backend_of(groups["portable"]).set_cpu_reduce_isa("portable")
    for g in groups.values():
        dist.barrier(group=g)
    levels = {k: tpcomm.describe(g)["cpu_shm"]["reduce_isa"] for k, g in groups.items()}
    rows = []
    for nbytes in _sizes(max_mib, quick):
        if nbytes < 16:
            continue
        calls = {}
        for level, dtype in DTYPE_PATHS:
            x = torch.ones(max(1, nbytes // dtype.itemsize), dtype=dtype)
            calls[(level, dtype)] = (lambda x=x, g=groups[level]: dist.all_reduce(x, group=g))
        for fn in calls.values():
            fn()
        best = {p: float("inf") for p in DTYPE_PATHS}
        iters = _iters(nbytes, quick)
        for _ in range(rounds):
            for path in DTYPE_PATHS:
                dist.barrier(group=control)
                start = time.perf_counter()
                for _ in range(iters):
                    calls[path]()
                elapsed = torch.tensor([(time.perf_counter() - start) / iters])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=control)
                best[path] = min(best[path], elapsed.item())
        rows.append((nbytes, [best[p] for p in DTYPE_PATHS]))
    if rank == 0:
        results.put((levels, rows))
    dist.destroy_process_group()


def run_dtypes(world_sizes=(2,), max_mib=64, quick=False, rounds=3):
    print("shared-memory all_reduce by dtype, same bytes per rank; best of "
          f"{rounds} interleaved rounds; us per call")
    for world in world_sizes:
        got = run_ranks(_dtype_worker, world, lambda r: (max_mib, quick, rounds), 3600)
        if got is None:
            print(f"world size {world}: a rank failed", file=sys.stderr)
            return 1
        levels, rows = got
        print(f"\nworld size {world}: kernels '{levels['best']}' against "
              f"'{levels['portable']}'")
        print(f"{'size':>8s} {'f32':>9s} {'bf16':>9s} {'f16':>9s} {'bf16/f32':>9s} "
              f"{'f16/f32':>8s} | {'f32 port':>9s} {'bf16 port':>9s} {'f16 port':>9s} "
              f"{'bf16 gain':>9s} {'f16 gain':>9s}")
        for nbytes, t in rows:
            f32, bf16, f16, pf32, pbf16, pf16 = (v * 1e6 for v in t)
            print(f"{_fmt_bytes(nbytes):>8s} {f32:9.1f} {bf16:9.1f} {f16:9.1f} "
                  f"{bf16 / f32:8.2f}x {f16 / f32:7.2f}x | {pf32:9.1f} {pbf16:9.1f} "
                  f"{pf16:9.1f} {pbf16 / bf16:8.2f}x {pf16 / f16:8.2f}x")
    return 0


CALL_PATHS = ("dist", "async_op", "functional", "coordinator", "process group", "backend")


def _call_paths(x, group, coordinator):
    functional = torch.ops._c10d_functional
    backend = group._get_backend(torch.device("cpu"))
    name = group.group_name
    op = (coordinator.all_reduce if coordinator.world_size > 1 else
          lambda t: torch.ops.tpcomm.all_reduce(t, coordinator.unique_name))
    return {
        "dist": lambda: dist.all_reduce(x, group=group),
        "async_op": lambda: dist.all_reduce(x, group=group, async_op=True).wait(),
        "functional": lambda: functional.wait_tensor(functional.all_reduce(x, "sum", name)),
        "coordinator": lambda: op(x),
        "process group": lambda: group.allreduce([x]).wait(),
        "backend": lambda: backend.allreduce([x]).wait(),
    }


def _paths_worker(rank, world, port, max_mib, quick, rounds, results):
    import tpcomm

    torch.set_num_threads(1)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    control = dist.new_group(backend="gloo")
    whole = tpcomm.GroupCoordinator([list(range(world))], rank, group_name="bench", device="cpu")
    alone = tpcomm.GroupCoordinator([[r] for r in range(world)], rank, group_name="alone",
                                    device="cpu")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for nbytes in _sizes(max_mib, quick):
            if nbytes < dtype.itemsize:
                continue
            x = torch.ones(nbytes // dtype.itemsize, dtype=dtype)
            cells = {}
            for scope, c in (("2 ranks", whole), ("1 rank", alone)):
                if scope == "1 rank" and nbytes > (64 << 10):
                    continue
                for name, fn in _call_paths(x, c.device_group, c).items():
                    cells[(scope, name)] = fn
            for fn in cells.values():
                fn()
            best = {k: float("inf") for k in cells}
            iters = _iters(nbytes, quick) * (5 if nbytes <= 4096 else 1)
            for _ in range(rounds):
                for key, fn in cells.items():
                    dist.barrier(group=control)
                    start = time.perf_counter()
                    for _ in range(iters):
                        fn()
                    elapsed = torch.tensor([(time.perf_counter() - start) / iters])
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=control)
                    best[key] = min(best[key], elapsed.item())
            rows.append((dtype, nbytes, best))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def run_paths(max_mib=64, quick=False, rounds=3):
    rows = run_ranks(_paths_worker, 2, lambda r: (max_mib, quick, rounds), 3600)
    if rows is None:
        print("a rank failed", file=sys.stderr)
        return 1
    print("all_reduce SUM in place, us per call by the way it is called; best of "
          f"{rounds} interleaved rounds; '1 rank': each rank's own world-size-1 group")
    for scope in ("2 ranks", "1 rank"):
        print(f"\n{scope}")
        print(f"{'dtype':>9s} {'size':>8s} " + " ".join(f"{p:>13s}" for p in CALL_PATHS))
        for dtype, nbytes, best in rows:
            if (scope, "dist") not in best:
                continue
            print(f"{str(dtype).replace('torch.', ''):>9s} {_fmt_bytes(nbytes):>8s} " +
                  " ".join(f"{best[(scope, p)] * 1e6:13.1f}" for p in CALL_PATHS))
    return 0


LATENESS_US = (0, 20, 100, 300, 1000, 3000)
SPIN_POLICIES = ((-1, "auto"), (50, "50 us"))


def _late_worker(rank, world, port, iters, results):
    import statistics

    import tpcomm

    torch.set_num_threads(1)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    groups = {}
    for spin, name in SPIN_POLICIES:
        groups[name] = dist.new_group(backend="tpcomm")
        tpcomm._backend_of(groups[name]).set_cpu_shm_spin_us(spin)
        dist.barrier(group=groups[name])
    policy = {name: tpcomm.describe(g)["cpu_shm"] for name, g in groups.items()}
    x = torch.ones(1)
    rows = []
    for late in LATENESS_US:
        for _, name in SPIN_POLICIES:
            g = groups[name]
            waits, calls = [], []
            for _ in range(iters):
                dist.barrier(group=g)
                start = time.perf_counter()
                if rank == 1:
                    while (time.perf_counter() - start) * 1e6 < late:
                        pass
                    start = time.perf_counter()
                dist.all_reduce(x, group=g)
                took = (time.perf_counter() - start) * 1e6
                (calls if rank == 1 else waits).append(took)
            mine = torch.tensor([statistics.median(waits or calls)])
            both = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(both, mine, group=g)
            rows.append((late, name, both[0].item() - late, both[1].item()))
    if rank == 0:
        results.put((policy, rows))
    dist.destroy_process_group()


def run_late(iters=200):
    got = run_ranks(_late_worker, 2, lambda r: (iters,), 1800)
    if got is None:
        print("a rank failed", file=sys.stderr)
        return 1
    policy, rows = got
    print("a late peer, 2 ranks, 4-byte all_reduce, median of "
          f"{iters} calls per cell (us)")
    for name, p in policy.items():
        print(f"  {name}: polls {p['spin_us']} us, {'yielding' if p['yields'] else 'not yielding'} "
              "the core, then sleeps")
    print(f"{'late by':>8s} {'policy':>7s} {'early rank beyond the lateness':>31s} "
          f"{'late rank in its call':>22s}")
    for late, name, beyond, call in rows:
        print(f"{late:8d} {name:>7s} {beyond:31.1f} {call:22.1f}")
    return 0


def _fmt_bytes(n):
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
    fig, axes = plt.subplots(len(worlds), len(OPS), figsize=(5 * len(OPS), 4 * len(worlds)),
                             squeeze=False)
    for i, world in enumerate(worlds):
        rows = table[world]
        for j, op in enumerate(OPS):
            ax = axes[i][j]
            mine = [r for r in rows if r[0] == op]
            sizes = [r[1] for r in mine]
            for k, path in enumerate(PATHS):
                ax.plot(sizes, [r[2 + k] * 1e6 for r in mine], marker="o", label=path)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{op}, {world} ranks")
            ax.set_xlabel("bytes per rank")
            ax.set_ylabel("us per call")
            ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"plot: {png}")


def run(world_sizes=(2, 4), max_mib=64, quick=False, png="cpu_bench.png", rounds=3):
    import os

    cores = os.cpu_count()
    print(f"CPU collectives, {cores} cores; best of {rounds} interleaved rounds per size; "
          "bytes are per rank (all_gather input, reduce_scatter output); algbw = bytes / time")
    table = {}
    for world in world_sizes:
        rows = run_ranks(_worker, world, lambda r: (max_mib, quick, rounds), 3600)
        if rows is None:
            print(f"world size {world}: a rank failed", file=sys.stderr)
            return 1
        table[world] = rows
        for op in OPS:
            print(f"\n{op}, world size {world}")
            print(f"{'size':>8s} {'gloo us':>10s} {'shm off us':>11s} {'shm on us':>10s} "
                  f"{'on GB/s':>8s} {'off/gloo':>9s} {'gloo/on':>8s}")
            for o, nbytes, gloo, off, on in rows:
                if o != op:
                    continue
                print(f"{_fmt_bytes(nbytes):>8s} {gloo * 1e6:10.1f} {off * 1e6:11.1f} "
                      f"{on * 1e6:10.1f} {nbytes / on / 1e9:8.2f} {off / gloo:8.2f}x "
                      f"{gloo / on:7.1f}x")
    if png:
        _save_plot(table, png)
    return 0
