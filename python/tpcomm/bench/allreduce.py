"""`python -m tpcomm.bench allreduce`: dist.all_reduce on CUDA tensors through
the tpcomm backend, per route (custom one-shot, custom two-shot, NCCL), eager
and graph-replayed, with nccl-tests columns, on whatever GPUs are present:
one process per GPU when there are several, else 2 and 4 processes sharing
the one GPU (then NCCL, which refuses two ranks on one GPU, is left out and
the custom routes run in time slices of the shared GPU, unless an MPS
control daemon runs: then the processes' kernels run at once and the figures
are the kernel's across processes, as on separate GPUs but for the links).

Also the host overhead per call: the CPU time of enqueuing one 4 KiB
allreduce through dist.all_reduce, and through tpcomm.all_reduce_into,
against launching the custom kernel directly (tpcomm.custom_allreduce).
Goal: at most 3 us more than the direct launch.
"""

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks

ROUTES = ("oneshot", "twoshot", "nccl")


TIME_SLICE_NOTE = (
    "ranks are processes sharing one GPU: without MPS the GPU runs one process's kernels at a "
    "time, so a collective's kernels wait for the time slice between processes (about 4.4 ms a "
    "call on an H100); these times measure that scheduling, not the kernel. The kernel alone: "
    "`python -m tpcomm.bench car` (ranks as streams of one process)")

MPS_NOTE = (
    "ranks are processes sharing one GPU through MPS: their kernels run at once, so these are "
    "the kernels' times across processes (IPC memory, flags in the GPU's own memory), as on "
    "separate GPUs but without the links between them")


def mps_running():
    """Whether an MPS control daemon serves this process's CUDA clients (its
    control pipe exists where CUDA looks for it)."""
    pipes = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipes, "control"))


def shared_gpu_note():
    return MPS_NOTE if mps_running() else TIME_SLICE_NOTE


def _time_us(fn, iters):
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1000 / iters


def _graph_us(fn, iters, reps=10):
    fn()  # warm-up (NCCL's communicator must exist before capture)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return _time_us(g.replay, max(1, iters // reps)) / reps


def _host_us(fn, calls=200):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def _worker(rank, world, port, device, sizes, quick, shared, results):
    import tpcomm
    from tpcomm.custom_allreduce import IpcCommunicator

    torch.cuda.set_device(device)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    backend = tpcomm._backend_of(None)
    max_bytes = tpcomm.describe()["custom_allreduce"]["max_bytes"]
    rows = []
    x0 = torch.empty(max(sizes) // 2, dtype=torch.bfloat16, device="cuda").normal_()
    for route in ROUTES:
        if route == "nccl" and shared:
            continue
        backend.set_route_mode(route)
        for nbytes in sizes:
            if route != "nccl" and nbytes > max_bytes:
                continue
            x = x0[: nbytes // 2]
            iters = 20 if quick else (200 if nbytes <= 1 << 20 else 40)
            eager = _time_us(lambda: dist.all_reduce(x), iters)
            graph = _graph_us(lambda: dist.all_reduce(x), iters)
            rows.append((route, nbytes, eager, graph))
        dist.barrier()
    backend.set_route_mode("auto")
    # Host overhead: the CPU time of enqueueing a 4 KiB allreduce.
    small = torch.ones(2048, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(small)
    direct = IpcCommunicator.create(dist.new_group(backend="gloo"))
    overhead = {}
    if direct.eligible:
        for name, fn in (("direct kernel launch", lambda: direct.all_reduce(small, out)),
                         ("tpcomm.all_reduce_into", lambda: tpcomm.all_reduce_into(small, out)),
                         ("dist.all_reduce", lambda: dist.all_reduce(small))):
            _host_us(fn, 50)
            overhead[name] = min(_host_us(fn) for _ in range(3))
            dist.barrier()
    if rank == 0:
        results.put((rows, overhead, tpcomm.describe()))
    dist.destroy_process_group()


def _print_table(world, rows):
    print(f"\n# world size {world}, bfloat16, sum")
    print(f"{'route':>8s} {'size':>10s} {'count':>10s} {'type':>5s} | {'eager us':>9s} "
          f"{'algbw':>7s} {'busbw':>7s} | {'graph us':>9s} {'algbw':>7s} {'busbw':>7s}")
    factor = 2 * (world - 1) / world
    for route, nbytes, eager, graph in rows:
        cols = []
        for us in (eager, graph):
            algbw = nbytes / us / 1e3  # GB/s
            cols.append(f"{us:9.2f} {algbw:7.2f} {algbw * factor:7.2f}")
        print(f"{route:>8s} {nbytes:10d} {nbytes // 2:10d} {'bf16':>5s} | {cols[0]} | {cols[1]}")


def run(max_mib, quick):
    if not torch.cuda.is_available():
        print("no CUDA GPU on this machine: the allreduce benchmark needs one")
        return 1
    gpus = torch.cuda.device_count()
    shared = gpus < 2
    worlds = [2, 4] if shared else [w for w in (2, 4, 8) if w <= gpus]
    top = max_mib << 20
    sizes = []
    s = 16
    while s <= top:
        sizes.append(s)
        s *= 4 if quick else 2
    print(f"GPUs: {gpus} x {torch.cuda.get_device_name(0)}; "
          + ("ranks share GPU 0 (NCCL left out)" if shared else "one rank per GPU"))
    if shared and mps_running():
        print("note: " + MPS_NOTE)
    elif shared:
        print("note: " + TIME_SLICE_NOTE + "; so only up to 1 MiB, few iterations")
        sizes, quick = [s for s in sizes if s <= 1 << 20], True
    for world in worlds:
        result = run_ranks(_worker, world, lambda r: (0 if shared else r, sizes, quick, shared),
                           1800)
        if result is None:
            print(f"world size {world}: a worker failed")
            return 1
        rows, overhead, described = result
        print(f"routing table in force: {described['cuda_allreduce_routes']}")
        _print_table(world, rows)
        if overhead:
            base = overhead["direct kernel launch"]
            print("host time per call (4 KiB, enqueue only): " + ", ".join(
                f"{k} {v:.2f} us (+{v - base:.2f})" for k, v in overhead.items()))
    return 0
