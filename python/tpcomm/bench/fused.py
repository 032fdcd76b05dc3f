"""python -m tpcomm.bench fused: GroupCoordinator.all_reduce_add_rms_norm
against the three separate operations it replaces (all_reduce, the residual
add, rms_norm), interleaved in one process set, for hidden sizes 1024..8192
and 1..128 tokens. On CPU through the shared-memory path; on a GPU (--device
cuda) with every rank on GPU 0, so the custom kernel runs (NCCL refuses two
ranks on one GPU). Prints us/call per path and fused / separate.
"""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks

EPS = 1e-6


def _shapes(quick):
    if quick:
        return [(1024, 1), (4096, 16)]
    return [(h, t) for h in (1024, 2048, 4096, 8192) for t in (1, 4, 16, 64, 128)]


def _iters(nbytes, device):
    if device == "cuda":
        return 200
    return 200 if nbytes <= 64 << 10 else 50 if nbytes <= 1 << 20 else 10


def _worker(rank, world, port, device, dtype_name, quick, rounds, results):
    import tpcomm

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    control = dist.new_group(backend="gloo")  # barriers and the max of the timings
    c = tpcomm.GroupCoordinator([list(range(world))], rank, group_name="bench_fused",
                                device=f"{device}:0" if device == "cuda" else "cpu")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for hidden, tokens in _shapes(quick):
        x = torch.randn(tokens, hidden, dtype=dtype, device=c.device)
        residual = torch.randn(tokens, hidden, dtype=dtype, device=c.device)
        weight = torch.randn(hidden, dtype=dtype, device=c.device)

        def fused():
            return c.all_reduce_add_rms_norm(x, residual, weight, EPS)

        def separate():
            r = c.all_reduce(x) + residual
            return torch.nn.functional.rms_norm(r, (hidden,), weight, EPS), r

        calls = {"fused": fused, "separate": separate}
        for fn in calls.values():
            fn()  # warm-up (and set-up)
        sync()
        path = c.last_fused_path
        best = {k: float("inf") for k in calls}
        iters = _iters(x.numel() * x.element_size(), device)
        for _ in range(rounds):
            for name, fn in calls.items():
                dist.barrier(group=control)
                start = time.perf_counter()
                for _ in range(iters):
                    fn()
                sync()
                elapsed = torch.tensor([(time.perf_counter() - start) / iters])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=control)
                best[name] = min(best[name], elapsed.item())
        rows.append((hidden, tokens, x.numel() * x.element_size(), path, best["fused"],
                     best["separate"]))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def run(world_sizes=(2,), device="cpu", dtype="bfloat16", quick=False, rounds=3):
    import os

    if device == "cuda" and not torch.cuda.is_available():
        print("bench fused --device cuda: no CUDA GPU on this machine", file=sys.stderr)
        return 1
    print(f"all_reduce_add_rms_norm vs all_reduce + add + rms_norm, {dtype}, {device} "
          f"({os.cpu_count()} cores); best of {rounds} interleaved rounds; max over ranks")
    if device == "cuda" and torch.cuda.device_count() < max(world_sizes):
        from tpcomm.bench.allreduce import shared_gpu_note
        print("note: " + shared_gpu_note().replace("`python -m tpcomm.bench car`",
                                                 "tests/gpu/test_fused_norm_gpu.py"))
    worst = 0.0
    for world in world_sizes:
        rows = run_ranks(_worker, world, lambda r: (device, dtype, quick, rounds), 3600)
        if rows is None:
            print(f"world size {world}: a rank failed", file=sys.stderr)
            return 1
        print(f"\nworld size {world}")
        print(f"{'hidden':>7s} {'tokens':>6s} {'KB':>7s} {'path':>15s} {'fused us':>9s} "
              f"{'separate us':>12s} {'fused/sep':>9s}")
        for hidden, tokens, nbytes, path, fused, separate in rows:
            ratio = fused / separate
            if nbytes <= 64 << 10:
                worst = max(worst, ratio)
            print(f"{hidden:7d} {tokens:6d} {nbytes / 1024:7.1f} {path:>15s} {fused * 1e6:9.1f} "
                  f"{separate * 1e6:12.1f} {ratio:8.2f}x")
    print(f"\nworst fused/separate at <= 64 KB: {worst:.2f}x")
    return 0
