"""A plain torch.distributed script, written for Gloo, that runs on tpcomm by
its backend string alone (the backend registers itself at `import torch`):

    torchrun --standalone --nproc-per-node 2 examples/torchrun_collectives.py
    torchrun --standalone --nproc-per-node 2 examples/torchrun_collectives.py --backend gloo

Each rank prints what an allreduce, an all-gather and a broadcast gave it,
and which backend served them."""

import argparse

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="tpcomm")
    args = parser.parse_args()
    dist.init_process_group(args.backend)  # torchrun's environment: rank, world, store
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.arange(4, dtype=torch.float32) + rank
    dist.all_reduce(x)
    gathered = torch.empty(world, dtype=torch.int64)
    dist.all_gather_into_tensor(gathered, torch.tensor([rank * rank]))
    message = torch.tensor([7, 11]) if rank == 0 else torch.zeros(2, dtype=torch.int64)
    dist.broadcast(message, src=0)
    served = type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__
    print(f"rank {rank}/{world} on {dist.get_backend()} ({served}): all_reduce {x.tolist()}, "
          f"all_gather {gathered.tolist()}, broadcast {message.tolist()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
