"""python -m tpcomm.bench fr-hook: what torch 2.15's flight-recorder hook
would cost a tpcomm group. torch 2.15 attaches a recording hook to every
group whose backend is not in its set of backends that record their own
calls; tpcomm records its own and declares so at registration, so its
groups carry no hook. This makes one group without the hook and one with it
(tpcomm taken out of the set while it is made) and times a 4-byte CPU
allreduce through the ProcessGroup (the dispatcher, where the hook fires),
alternating round after round; best round kept. A torch without the set
(2.11-2.14) has no such hook: the benchmark says so and stops."""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks

NAMES = ("without torch's hook (tpcomm)", "with torch's hook")


def _worker(rank, world, port, rounds, iters, results):
    import torch.distributed.distributed_c10d as c10d

    import tpcomm  # noqa: F401  (registers the backend, declares it self-recording)

    torch.set_num_threads(1)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    plain = dist.new_group(backend="tpcomm")
    c10d._FR_SELF_RECORDING_BACKENDS.discard("tpcomm")
    try:
        hooked = dist.new_group(backend="tpcomm")
    finally:
        c10d._FR_SELF_RECORDING_BACKENDS.add("tpcomm")
    hooks = c10d._world.pg_flight_recorder_hooks
    assert hooked in hooks and plain not in hooks, "the hook is not where it should be"
    t = torch.ones(1)
    best = dict.fromkeys(NAMES, float("inf"))
    for _ in range(rounds):
        for name, group in zip(NAMES, (plain, hooked)):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                group.allreduce([t]).wait()
            best[name] = min(best[name], (time.perf_counter() - start) / iters * 1e6)
    if rank == 0:
        results.put(best)
    dist.destroy_process_group()


def run(rounds=7, quick=False):
    import torch.distributed.distributed_c10d as c10d

    if not isinstance(getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", None), set):
        print(f"torch {torch.__version__} attaches no flight-recorder hook to other backends' "
              "groups: nothing to compare")
        return 0
    best = run_ranks(_worker, 2, lambda r: (rounds, 300 if quick else 3000), timeout_s=600)
    if best is None:
        print("fr-hook benchmark failed", file=sys.stderr)
        return 1
    print(f"4-byte CPU allreduce through ProcessGroup.allreduce(...).wait(), 2 ranks, torch "
          f"{torch.__version__}: us per call (best of {rounds} alternated rounds)")
    for name in NAMES:
        print(f"  {name:>30}: {best[name]:6.2f}")
    return 0
