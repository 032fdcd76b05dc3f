"""python -m tpcomm.bench cpu --reuse: why the shared-memory path moves a
small call's chunk on through its slot (docs/cpu-shm.md, "Places in a
slot"). Two processes share a buffer each; every round each writes S bytes
into the next of P places of its own buffer, both meet, and each reads the
peer's S bytes back. With P = 2 a process rewrites lines the peer's core has
just read (as the path did with the same two places for every call); with
P places filling 2 MiB it rewrites them only after a whole buffer. Printed:
the median write and read of a round, per size and number of places; every
read's first and last byte are checked against what the peer wrote
that round.
"""

import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks
from tpcomm.bench.cpu import fmt_bytes

SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20)
SPAN = 2 << 20  # the bytes the places of a size fill, where P > 2
FLAGS = 4096  # a page of meeting counters: one cache line a process
MEET_TIMEOUT_S = 10.0


def places_for(nbytes):
    """The numbers of places each size runs with: 2, and SPAN's worth."""
    return sorted({2, max(2, SPAN // nbytes)})


def _worker(rank, world, port, sizes, rounds, path, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    per_rank = max(n * max(places_for(n)) for n in sizes)
    shared = torch.from_file(path, shared=True, size=FLAGS + world * per_rank, dtype=torch.uint8)
    flags = shared[:FLAGS].view(torch.int64)
    met = [0]

    def meet():
        met[0] += 1
        flags[rank * 8] = met[0]
        deadline = time.monotonic() + MEET_TIMEOUT_S
        while flags[(1 - rank) * 8].item() < met[0]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {1 - rank} did not meet within {MEET_TIMEOUT_S} s")

    rows, wrong = [], 0
    for nbytes in sizes:
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        for places in places_for(nbytes):
            def at(r, p):
                start = FLAGS + r * per_rank + p * nbytes
                return shared[start:start + nbytes]
            writes, reads = [], []
            for i in range(rounds + places):  # the first pass over the places warms them
                p = i % places
                src.fill_((7 * rank + i) % 256)
                t0 = time.perf_counter()
                at(rank, p).copy_(src)
                t1 = time.perf_counter()
                meet()
                t2 = time.perf_counter()
                dst.copy_(at(1 - rank, p))
                t3 = time.perf_counter()
                meet()
                theirs = (7 * (1 - rank) + i) % 256
                wrong += int(dst[0].item() != theirs or dst[-1].item() != theirs)
                if i >= places:
                    writes.append(t1 - t0)
                    reads.append(t3 - t2)
            rows.append((nbytes, places, statistics.median(writes), statistics.median(reads)))
    got = [None] * world
    dist.all_gather_object(got, (rows, wrong))
    if rank == 0:
        results.put(got)
    dist.destroy_process_group()


def run(rounds=2000, sizes=SIZES):
    where = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.NamedTemporaryFile(dir=where, prefix="tpcomm-reuse-") as f:
        got = run_ranks(_worker, 2, lambda r: (sizes, rounds, f.name), 1800)
    if got is None:
        print("a rank failed", file=sys.stderr)
        return 1
    print("2 processes, each writes S bytes into the next of P places of its buffer, both "
          "meet, each reads the peer's S bytes; medians of "
          f"{rounds} rounds, the slower process's, µs")
    print(f"  {'S':>8s} {'P':>4s} {'buffer':>8s} {'write':>9s} {'read':>9s}")
    status = 0
    for i, (nbytes, places, _, _) in enumerate(got[0][0]):
        write = max(r[0][i][2] for r in got)
        read = max(r[0][i][3] for r in got)
        print(f"  {fmt_bytes(nbytes):>8s} {places:4d} {fmt_bytes(nbytes * places):>8s} "
              f"{write * 1e6:9.2f} {read * 1e6:9.2f}")
    for rank, (_, wrong) in enumerate(got):
        if wrong:
            print(f"rank {rank}: {wrong} read(s) differ from what the peer wrote", file=sys.stderr)
            status = 1
    return status
