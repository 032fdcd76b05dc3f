"""python -m tpcomm.bench p2p: send/recv ping-pong between two ranks, a
plain Gloo group against a tpcomm group (whose CPU send/recv carries a
40-byte header before each payload, coordinator/cpu/framed_p2p.hpp), alternated
round after round in one run; microseconds per one-way message (half a
round trip), the best round of each."""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks

SIZES = [4, 64, 1024, 16 << 10, 256 << 10, 4 << 20]


def _worker(rank, world, port, rounds, iters, results):
    import tpcomm  # noqa: F401

    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    groups = {"gloo": dist.new_group(backend="gloo"), "tpcomm": dist.new_group(backend="tpcomm")}
    peer = 1 - rank
    best = {}
    for nbytes in SIZES:
        x = torch.ones(max(1, nbytes // 4))
        n = iters if nbytes <= (64 << 10) else max(20, iters // 10)
        for _ in range(rounds):
            for name, g in groups.items():
                dist.barrier(group=groups["gloo"])
                start = time.perf_counter()
                for _ in range(n):
                    if rank == 0:
                        dist.send(x, peer, group=g)
                        dist.recv(x, peer, group=g)
                    else:
                        dist.recv(x, peer, group=g)
                        dist.send(x, peer, group=g)
                us = (time.perf_counter() - start) / n / 2 * 1e6
                key = (nbytes, name)
                best[key] = min(best.get(key, float("inf")), us)
    if rank == 0:
        results.put(best)
    dist.destroy_process_group()


def run(rounds=5, quick=False):
    iters = 200 if quick else 1000
    best = run_ranks(_worker, 2, lambda r: (rounds, iters), timeout_s=1200)
    if best is None:
        print("p2p benchmark failed", file=sys.stderr)
        return 1
    print("send/recv, 2 ranks on one host: us per one-way message (best of "
          f"{rounds} alternated rounds)")
    print(f"{'bytes':>10} {'Gloo':>10} {'tpcomm':>10} {'tpcomm/Gloo':>12}")
    for nbytes in SIZES:
        g, t = best[(nbytes, "gloo")], best[(nbytes, "tpcomm")]
        print(f"{nbytes:>10} {g:>10.1f} {t:>10.1f} {t / g:>12.2f}")
    return 0
