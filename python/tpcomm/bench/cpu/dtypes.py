"""python -m tpcomm.bench cpu --dtypes: the shared-memory all_reduce of
float32, bfloat16 and float16 at the same bytes per rank, with the
reductions' best kernels and with the portable ones
(TPCOMM_CPU_REDUCE_ISA=portable), interleaved in one run.
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks
from tpcomm.bench.cpu import best_interleaved, fmt_bytes, iters_for, sizes


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
    for nbytes in sizes(max_mib, quick):
        if nbytes < 16:
            continue
        calls = {}
        for level, dtype in DTYPE_PATHS:
            x = torch.ones(max(1, nbytes // dtype.itemsize), dtype=dtype)
            calls[(level, dtype)] = (lambda x=x, g=groups[level]: dist.all_reduce(x, group=g))
        for fn in calls.values():
            fn()
        best = best_interleaved(calls, iters_for(nbytes, quick), rounds, control)
        rows.append((nbytes, [best[p] for p in DTYPE_PATHS]))
    if rank == 0:
        results.put((levels, rows))
    dist.destroy_process_group()


def run(world_sizes=(2,), max_mib=64, quick=False, rounds=3):
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
            print(f"{fmt_bytes(nbytes):>8s} {f32:9.1f} {bf16:9.1f} {f16:9.1f} "
                  f"{bf16 / f32:8.2f}x {f16 / f32:7.2f}x | {pf32:9.1f} {pbf16:9.1f} "
                  f"{pf16:9.1f} {pbf16 / bf16:8.2f}x {pf16 / f16:8.2f}x")
    return 0
