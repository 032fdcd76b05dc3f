"""python -m tpcomm.bench cpu --late: what a peer that arrives late costs,
per waiting policy: rank 1 calls a 4-byte all_reduce a set time after rank
0; printed are rank 0's time beyond that lateness and rank 1's time in its
call (the wake-up it may owe).
"""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks


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


def run(quick=False):
    iters = 20 if quick else 200
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
