"""Locally started ranks: a free TCP port for their rendezvous, and a run of
one process per rank (the benchmarks)."""

import socket

import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, world, args_of, timeout_s):
    """Runs target(rank, world, port, *args_of(rank), results) in `world`
    spawned processes and returns what one of them put on `results`, or None
    when a process failed or nothing was put."""
    ctx = mp.get_context("spawn")
    port = free_port()
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args_of(r), results))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if any(p.exitcode != 0 for p in procs) or results.empty():
        return None
    return results.get()
