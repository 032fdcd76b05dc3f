"""python -m tpcomm.bench window: torch's one-sided windows on tpcomm
(dist._new_window, backend/window/tpcomm_window.hpp), 2 ranks of one host,
alternated round after round in one run, the best round of each:

- a 4 B put + signal + the peer's wait_signal, one way (half a round trip
  of rank 0's put, signal, wait and rank 1's answer), against a 4 B
  dist.all_reduce on the same group (shared memory);
- a put of 64 KiB to 16 MiB into the peer's window against a copy of the
  same bytes inside the process (torch's copy_ between two preallocated
  tensors on one thread, as a put copies: the memcpy bandwidth), as GB/s
  and their ratio."""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks
from tpcomm.bench.cpu.peers import _cpu_name

PUT_SIZES = [64 << 10, 1 << 20, 4 << 20, 16 << 20]


def _best(best, key, seconds):
    best[key] = min(best.get(key, float("inf")), seconds)


def _worker(rank, world, port, rounds, iters, sizes, results):
    import tpcomm  # noqa: F401

    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    torch.set_num_threads(1)  # copy_ on one thread, as a put copies
    peer = 1 - rank
    target = torch.zeros(max(sizes) // 4)
    window = dist._new_window(target)
    small = torch.ones(1)
    # Every buffer made and touched once, before any round.
    sources = {nbytes: torch.ones(nbytes // 4) for nbytes in sizes}
    copies = {nbytes: torch.zeros(nbytes // 4) for nbytes in sizes}
    best = {}
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            if rank == 0:
                window.put(small, peer, 0, False)
                window.signal(peer, False)
                window.wait_signal(peer, False)
            else:
                window.wait_signal(peer, False)
                window.put(small, peer, 0, False)
                window.signal(peer, False)
        _best(best, "put_signal_wait", (time.perf_counter() - start) / iters / 2)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(small)
        _best(best, "allreduce", (time.perf_counter() - start) / iters)
        for nbytes in sizes:
            n = max(5, min(iters, (256 << 20) // nbytes))
            src, local = sources[nbytes], copies[nbytes]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(n):
                if rank == 0:
                    window.put(src, peer, 0, False)
            _best(best, ("put", nbytes), (time.perf_counter() - start) / n)
            dist.barrier()  # the peer idles meanwhile, as during the puts
            start = time.perf_counter()
            for _ in range(n):
                if rank == 0:
                    local.copy_(src)
            _best(best, ("copy", nbytes), (time.perf_counter() - start) / n)
    if rank == 0:
        results.put(best)
    dist.barrier()
    dist.destroy_process_group()


def run(rounds=5, quick=False, sizes=None):
    sizes = sizes or PUT_SIZES
    iters = 500 if quick else 5000
    best = run_ranks(_worker, 2, lambda r: (rounds, iters, sizes), timeout_s=1200)
    if best is None:
        print("window benchmark failed", file=sys.stderr)
        return 1
    print(f"CPU: {_cpu_name()}; torch {torch.__version__}; 2 ranks of one host, best of "
          f"{rounds} alternated rounds")
    ps, ar = best["put_signal_wait"] * 1e6, best["allreduce"] * 1e6
    print(f"4 B put + signal + wait_signal, one way: {ps:.2f} us; 4 B all_reduce: {ar:.2f} us; "
          f"ratio {ps / ar:.2f}")
    print(f"{'bytes':>10} {'put GB/s':>10} {'copy GB/s':>10} {'put/copy':>9}")
    for nbytes in sizes:
        put = nbytes / best[("put", nbytes)] / 1e9
        copy = nbytes / best[("copy", nbytes)] / 1e9
        print(f"{nbytes:>10} {put:>10.2f} {copy:>10.2f} {put / copy:>9.2f}")
    return 0
