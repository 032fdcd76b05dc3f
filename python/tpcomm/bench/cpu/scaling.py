"""python -m tpcomm.bench cpu --scaling: the shared-memory allreduce on a
many-core machine, at several world sizes and worker threads per rank,
against plain Gloo and against the machine's own memory bandwidth measured
in the same run.

For each world size (one process set) and each size from 4 B up, these run
interleaved, round after round, so that they see the same machine load:
- Gloo's allreduce;
- tpcomm's, one group per thread count (TPCOMM_CPU_SHM_THREADS, its chunk
  256 KiB a thread, at least 1 MiB up to 8 ranks);
- from 64 KiB on, a copy (dst = src) and a triad (a = b + 0.5 c) over
  buffers of the size, on every rank at once, with torch's threads set to
  each thread count.

The bound: an allreduce of S bytes a rank reads its input and writes its
output once from memory, 2S a rank (the chunk buffers between stay in the
caches), so it cannot take less than moving the ranks' 2S each at the best
bandwidth the copy or the triad reached at any of the thread counts (copy:
2S a rank, triad: 3S; "mem GB/s", summed over the ranks). "share" is that bound's time over the
allreduce's: 100% would be an allreduce as fast as the copy.
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks
from tpcomm.bench.cpu import best_interleaved, fmt_bytes, iters_for, sizes

BOUND_FROM = 64 << 10  # bytes: the copy and the triad run from this size on


def _threaded(fn, t):
    """fn run with torch's intra-op threads set to t (1 again after)."""
    def call():
        torch.set_num_threads(t)
        try:
            fn()
        finally:
            torch.set_num_threads(1)
    return call


def _worker(rank, world, port, thread_counts, max_mib, quick, rounds, results):
    import tpcomm

    torch.set_num_threads(1)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=1800))
    control = dist.new_group(backend="gloo")
    gloo = dist.new_group(backend="gloo")
    groups = {}
    for t in thread_counts:
        groups[t] = dist.new_group(backend="tpcomm")
        tpcomm._backend_of(groups[t]).set_cpu_shm_threads(t)
        dist.barrier(group=groups[t])  # sets the path up
        assert tpcomm.describe(groups[t])["cpu_shm"]["available"]
    places = {t: tpcomm.describe(groups[t])["cpu_shm"]["ranks"] for t in thread_counts}
    rows = []
    for nbytes in sizes(max_mib, quick):
        n = max(1, nbytes // 4)
        x = torch.ones(n)
        calls = {"gloo": lambda: dist.all_reduce(x, group=gloo)}
        for t, g in groups.items():
            calls[t] = lambda g=g: dist.all_reduce(x, group=g)
        if nbytes >= BOUND_FROM:
            a, b, c = torch.empty(n), torch.ones(n), torch.ones(n)

            for t in thread_counts:
                calls[("copy", t)] = _threaded(lambda: a.copy_(b), t)
                calls[("triad", t)] = _threaded(lambda: torch.add(b, c, alpha=0.5, out=a), t)
        for fn in calls.values():
            fn()  # warm-up
        rows.append((nbytes, best_interleaved(calls, iters_for(nbytes, quick), rounds, control)))
    if rank == 0:
        results.put((places, rows))
    dist.destroy_process_group()


def run(world_sizes=(2, 4, 8), thread_counts=(1, 2, 4, 8), max_mib=64, quick=False, rounds=3):
    print(f"shared-memory allreduce scaling, float32, {os.cpu_count()} CPUs online, "
          f"{len(os.sched_getaffinity(0))} usable; best of {rounds} interleaved rounds; "
          "bytes per rank; share = the memory-bandwidth bound's time / the allreduce's "
          "(python -m tpcomm.bench cpu --scaling; the model: tpcomm/bench/cpu/scaling.py)")
    for world in world_sizes:
        got = run_ranks(_worker, world,
                        lambda r: (tuple(thread_counts), max_mib, quick, rounds), 7200)
        if got is None:
            print(f"world size {world}: a rank failed", file=sys.stderr)
            return 1
        places, rows = got
        print(f"\n{world} ranks")
        for t in thread_counts:
            shares = "; ".join(f"rank {r}: CPUs {p['cpus'] or '-'} (node {p['node']}, "
                               f"{p['pinned_workers']} workers pinned)"
                               for r, p in enumerate(places[t]))
            print(f"  {t} thread(s) a rank: {shares}")
        head = f"{'size':>8s} {'gloo us':>10s}"
        for t in thread_counts:
            head += f" {f'{t}t us':>9s} {f'{t}t share':>9s}"
        head += f" {'best/gloo':>9s} {'best/1t':>8s} {'mem GB/s':>9s}"
        print(head)
        for nbytes, best in rows:
            s = max(1, nbytes // 4) * 4
            line = f"{fmt_bytes(nbytes):>8s} {best['gloo'] * 1e6:10.1f}"
            fastest = min(best[t] for t in thread_counts)
            bandwidth = max((max(world * 2 * s / best[("copy", t)],
                                 world * 3 * s / best[("triad", t)])
                             for t in thread_counts if ("copy", t) in best), default=0.0)
            for t in thread_counts:
                share = f"{100 * (world * 2 * s / bandwidth) / best[t]:8.0f}%" if bandwidth else ""
                line += f" {best[t] * 1e6:9.1f} {share:>9s}"
            one = best[thread_counts[0]] if thread_counts[0] == 1 else float("nan")
            line += f" {best['gloo'] / fastest:8.1f}x {one / fastest:7.2f}x"
            line += f" {bandwidth / 1e9:9.1f}" if bandwidth else f" {'':>9s}"
            print(line)
    return 0
