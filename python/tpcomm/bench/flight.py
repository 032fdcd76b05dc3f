"""python -m tpcomm.bench fr: what recording into torch's flight recorder
costs a small call. A 4-byte float32 dist.all_reduce on the shared-memory
route, 2 ranks, with TORCH_FR_BUFFER_SIZE=0 (recording off) and torch's
default (2000 entries, on), in alternating rounds; best round kept.
"""

import os
import time

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks

MODES = (("off", "0"), ("on", "2000"))


def _worker(rank, world, port, iters, results):
    import tpcomm  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    t = torch.ones(1)
    for _ in range(iters // 10):
        dist.all_reduce(t)
    best = float("inf")
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        best = min(best, (time.perf_counter() - start) / iters)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    results.put((best, backend.describe()["flight_recorder"]))
    dist.destroy_process_group()


def run(rounds, quick):
    iters = 2000 if quick else 20000
    best = {name: float("inf") for name, _ in MODES}
    status = {}
    for _ in range(rounds):
        for name, size in MODES:
            os.environ["TORCH_FR_BUFFER_SIZE"] = size
            got = run_ranks(_worker, 2, lambda r: (iters,), 600)
            if got is None:
                print(f"recorder {name}: a worker failed")
                return 1
            best[name] = min(best[name], got[0])
            status[name] = got[1]
    os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
    for name, _ in MODES:
        print(f"recorder {name:3s}: {best[name] * 1e6:6.2f} us per 4 B all_reduce ({status[name]})")
    print(f"added by recording: {(best['on'] - best['off']) * 1e6:.2f} us per call")
    return 0
