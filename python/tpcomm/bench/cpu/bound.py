"""python -m tpcomm.bench cpu --bound: the shared-memory allreduce of a large
float32 message at 2 ranks against the memory bandwidth the two cores have
together, measured in the same run: both ranks copy a buffer of the same size
at once (read + write bytes per second, summed over the ranks).

Two models of the bytes the engine moves, per rank, for a message of S bytes
at n ranks (two-phase, as every allreduce from TPCOMM_CPU_SHM_TWO_PHASE_BYTES
on):
- memory: the input read once and the output written once, 2S: the chunk
  buffers (2 x TPCOMM_CPU_SHM_BUFFER_BYTES a rank) stay in the caches, so
  the copies through them do not reach memory. The concurrent copy moves
  the same 2S a rank, so its time is the bound.
- every byte touched: copy in (S read, S written), reduce its slice
  (n x S/n read, S/n written), copy every slice out (S read, S written):
  3S read + (2 + 1/n)S written, at the same bandwidth (an upper bound of
  the time: cache traffic counted as memory traffic).
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks
from tpcomm.bench.cpu import best_interleaved


def _worker(rank, world, port, mib, iters, results):
    torch.set_num_threads(1)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    control = dist.new_group(backend="gloo")
    nbytes = mib << 20
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    x = torch.ones(nbytes // 4)
    dst.copy_(src)
    dist.all_reduce(x)
    calls = {"copy": lambda: dst.copy_(src), "allreduce": lambda: dist.all_reduce(x)}
    best = best_interleaved(calls, 1, iters, control, lead=False)
    if rank == 0:
        results.put((best["copy"], best["allreduce"]))
    dist.destroy_process_group()


def run(mib=64, iters=10, world=2):
    got = run_ranks(_worker, world, lambda r: (mib, iters), 1800)
    if got is None:
        print("a rank failed", file=sys.stderr)
        return 1
    copy_s, reduce_s = got
    s = mib << 20
    bandwidth = world * 2 * s / copy_s  # read + write bytes/s of the ranks copying at once
    print(f"{world} ranks, float32 allreduce of {mib} MiB, best of {iters}:")
    print(f"  concurrent copy: {copy_s * 1e3:.2f} ms per rank, {bandwidth / 1e9:.1f} GB/s "
          "read + written by the ranks together")
    print(f"  allreduce: {reduce_s * 1e3:.2f} ms")
    for name, per_rank in (("memory (2S a rank)", 2 * s),
                           ("every byte touched ((5 + 1/n)S a rank)", (5 + 1 / world) * s)):
        moved = world * per_rank
        bound_s = moved / bandwidth
        print(f"  model {name}: {moved / 2**20:.0f} MiB, bound {bound_s * 1e3:.2f} ms: allreduce "
              f"at {100 * bound_s / reduce_s:.0f}% of the bandwidth bound")
    return 0
