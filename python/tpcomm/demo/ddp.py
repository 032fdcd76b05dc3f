"""A training example: a short DDP run over backend "tpcomm".

    python -m tpcomm.demo.ddp [--nproc 2] [--steps 60]

Starts --nproc local processes on CPU, trains a small regression MLP with
DistributedDataParallel (gradients allreduced through tpcomm), prints the loss
as it goes and the final loss, and checks that every rank ends with identical
parameters. Exits non-zero if training did not converge or the replicas differ.
"""

import argparse
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from tpcomm._net import free_port


def _dataset(rank, world_size, n=4096):
    """A fixed linear-plus-sine target; each rank trains on its own shard."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    y = x @ w + 0.5 * torch.sin(3 * x[:, :1])
    return x[rank::world_size], y[rank::world_size]


def _worker(rank, world_size, port, steps, result):
    import tpcomm  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                          nn.Linear(64, 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=3e-3)
    x, y = _dataset(rank, world_size)
    batch = 64
    start = time.perf_counter()
    first = loss = None
    for step in range(steps):
        i = (step * batch) % (x.shape[0] - batch)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x[i:i + batch]), y[i:i + batch])
        loss.backward()
        opt.step()
        # The mean loss across ranks, through tpcomm as well.
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        first = mean.item() if first is None else first
        if rank == 0 and (step % max(1, steps // 10) == 0 or step == steps - 1):
            print(f"step {step:4d}/{steps}  mean loss {mean.item():.5f}", flush=True)
    elapsed = time.perf_counter() - start

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(replicas, flat)
    in_sync = all(torch.equal(r, flat) for r in replicas)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    if rank == 0:
        result.put((first, mean.item(), in_sync, elapsed, backend.device_backend_created))
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="local processes (default 2)")
    parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    args = parser.parse_args(argv)
    if args.nproc < 1 or args.steps < 1:
        parser.error("--nproc and --steps must be positive")

    ctx = mp.get_context("spawn")
    result = ctx.SimpleQueue()
    port = free_port()
    print(f"tpcomm demo: DDP on CPU, {args.nproc} processes, {args.steps} steps", flush=True)
    procs = [ctx.Process(target=_worker, args=(r, args.nproc, port, args.steps, result))
             for r in range(args.nproc)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
    if failed or result.empty():
        print(f"FAILED: ranks {failed} did not finish cleanly", file=sys.stderr)
        return 1
    first, final, in_sync, elapsed, device_used = result.get()
    print(f"final loss {final:.5f} (first step {first:.5f}); "
          f"{args.steps / elapsed:.1f} steps/s; replicas identical: {in_sync}; "
          f"NCCL created: {device_used}")
    if not in_sync:
        print("FAILED: ranks ended with different parameters", file=sys.stderr)
        return 1
    if not final < first:
        print("FAILED: the loss did not go down", file=sys.stderr)
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
