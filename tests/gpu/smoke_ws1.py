"""Minimal world-size-1 smoke run (device debugging aid): prints each step."""
import socket
import sys

import torch
import torch.distributed as dist

import tpcomm  # noqa: F401

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
print("init ok", flush=True)
be = dist.group.WORLD._get_backend(torch.device("cpu"))
print("backend", type(be).__name__, flush=True)
w = be.allreduce([torch.ones(4)])
print("issued", flush=True)
w.wait()
print("direct allreduce ok", flush=True)
x = torch.ones(4)
dist.all_reduce(x)
print("all_reduce ok", x, flush=True)
if torch.cuda.is_available():
    y = torch.ones(4, device="cuda")
    dist.all_reduce(y)
    print("cuda all_reduce ok", y.cpu(), flush=True)
dist.destroy_process_group()
sys.exit(0)
