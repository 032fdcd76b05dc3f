"""Device debugging aid: how the CPU backend looks from Python and through tpcomm."""
import socket

import torch
import torch.distributed as dist

import tpcomm  # noqa: F401

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
be = dist.group.WORLD._get_backend(torch.device("cpu"))
print("tpcomm backend:", type(be), type(be).__mro__, flush=True)
gb = be.cpu_backend
print("cpu backend:", type(gb), gb.name(), gb.rank(), gb.size(), flush=True)
w = gb.allreduce([torch.ones(4)])
print("gloo from python:", w, flush=True)
w.wait()
print("gloo ok", flush=True)
w = be.allreduce([torch.ones(4)])
print("tpcomm work:", w, flush=True)
