"""python -m tpcomm.bench cpu --paths --cpp PROGRAM: a CPU all_reduce's cost
per call from C++ (examples/cpp's allreduce_latency, built against the
installed package: through c10d::ProcessGroup, and tpcomm::allReduce's
direct route)
beside Python's (dist.all_reduce, which takes the direct route, and the
backend's allreduce([t]).wait()), at 2 ranks, float32 SUM in place. The
Python run and the C++ program alternate round after round and the best of
each is kept, so both see the same machine."""

import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks
from tpcomm.bench.cpu import best_interleaved, fmt_bytes

SIZES = (4, 64, 1024, 16384)
ITERS = 2000


def _python_worker(rank, world, port, sizes, iters, results):
    import tpcomm  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    control = dist.new_group(backend="gloo")
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    rows = {}
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4))
        cells = {"dist": lambda: dist.all_reduce(x),
                 "backend": lambda: backend.allreduce([x]).wait()}
        for fn in cells.values():
            for _ in range(100):
                fn()
        rows[nbytes] = best_interleaved(cells, iters, 2, control)
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def _cpp(program, sizes, iters):
    done = subprocess.run([program, "--world-size", "2", "--sizes", ",".join(map(str, sizes)),
                           "--iters", str(iters), "--rounds", "2"],
                          capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"{program} failed ({done.returncode}): {done.stderr[-2000:]}")
    rows = {}
    for line in done.stdout.splitlines():
        fields = dict(f.split("=") for f in line.split())
        rows[int(fields["bytes"])] = {"c++ group": float(fields["process_group_us"]) * 1e-6,
                                      "c++ direct": float(fields["direct_us"]) * 1e-6}
    return rows


def measure(program, sizes=SIZES, iters=ITERS, rounds=3):
    """{(bytes, way): best seconds per call} for the ways "dist", "backend"
    (Python) and "c++ group", "c++ direct" (`program`), the Python run and
    the program alternated `rounds` times. Raises RuntimeError when either
    fails."""
    best = {}
    for _ in range(rounds):
        python = run_ranks(_python_worker, 2, lambda r: (tuple(sizes), iters), 1200)
        if python is None:
            raise RuntimeError("a Python rank failed")
        cpp = _cpp(program, sizes, iters)
        for nbytes in sizes:
            for key, seconds in {**python[nbytes], **cpp[nbytes]}.items():
                best[(nbytes, key)] = min(best.get((nbytes, key), float("inf")), seconds)
    return best


def run(program, rounds=3):
    try:
        best = measure(program, rounds=rounds)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"all_reduce SUM float32 in place at 2 ranks, us per call (slowest rank, best of "
          f"{rounds} alternated runs of {ITERS} calls); C++: {program}")
    cols = ("dist", "backend", "c++ group", "c++ direct")
    print(f"{'size':>8s} " + " ".join(f"{c:>12s}" for c in cols) +
          f" {'c++ direct/dist':>16s} {'c++ group/dist':>15s}")
    for nbytes in SIZES:
        cells = [best[(nbytes, c)] * 1e6 for c in cols]
        print(f"{fmt_bytes(nbytes):>8s} " + " ".join(f"{v:12.2f}" for v in cells) +
              f" {cells[3] / cells[0]:16.2f} {cells[2] / cells[0]:15.2f}")
    return 0
