"""python -m tpcomm.bench cpu --paths: the same all_reduce through each way
callers reach it, side by side: dist.all_reduce, with async_op=True and
wait(), the functional collective (_c10d_functional.all_reduce +
wait_tensor, what DTensor and compiled code call), GroupCoordinator.all_reduce
(on a world-size-1 group, which all_reduce returns as it is, the route it
takes at larger sizes: the direct call, else torch.ops.tpcomm.all_reduce), the
ProcessGroup's and the Backend's own allreduce([t]).wait(); at 2 ranks and on
a world-size-1 group of each rank.
"""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks
from tpcomm.bench.cpu import best_interleaved, fmt_bytes, iters_for, sizes


CALL_PATHS = ("dist", "async_op", "functional", "coordinator", "process group", "backend")


def _call_paths(x, group, coordinator):
    functional = torch.ops._c10d_functional
    backend = group._get_backend(torch.device("cpu"))
    name = group.group_name
    op = coordinator._all_reduce_op  # all_reduce's route, also at world size 1
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
        for nbytes in sizes(max_mib, quick):
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
            iters = iters_for(nbytes, quick) * (5 if nbytes <= 4096 else 1)
            best = best_interleaved(cells, iters, rounds, control)
            rows.append((dtype, nbytes, best))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def run(max_mib=64, quick=False, rounds=3):
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
            print(f"{str(dtype).replace('torch.', ''):>9s} {fmt_bytes(nbytes):>8s} " +
                  " ".join(f"{best[(scope, p)] * 1e6:13.1f}" for p in CALL_PATHS))
    return 0
