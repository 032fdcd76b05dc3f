"""python -m tpcomm.bench mq: broadcast of tensor dicts from one writer to N
readers on this host, through tpcomm.MessageQueue and, in the same run,
through the Gloo path (metadata with broadcast_object_list, then one
dist.broadcast per tensor); plus single-thread memcpy bandwidth as the
ceiling. The round trips are tpcomm.bench.mq_round_trip.
"""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks


def payloads(quick):
    step = {f"t{i}": torch.arange(64, dtype=torch.int64) + i for i in range(4)}
    step.update(step=7, temperature=0.7, greedy=True)
    sizes = [("step dict (4 x int64[64] + scalars)", step, 300 if quick else 3000),
             ("1 KB", {"x": torch.ones(1 << 10, dtype=torch.uint8)}, 300 if quick else 3000),
             ("1 MB", {"x": torch.ones(1 << 20, dtype=torch.uint8)}, 30 if quick else 300),
             ("64 MB", {"x": torch.ones(64 << 20, dtype=torch.uint8)}, 3 if quick else 10)]
    return sizes


def _nbytes(d):
    return sum(v.numel() * v.element_size() for v in d.values() if isinstance(v, torch.Tensor))


def gloo_broadcast_dict(d, src, group):
    """The collective path: metadata as an object, then one broadcast per tensor."""
    if dist.get_rank() == src:
        meta = [[(k, (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else None,
                  None if isinstance(v, torch.Tensor) else v) for k, v in d.items()]]
    else:
        meta = [None]
    dist.broadcast_object_list(meta, src=src, group=group)
    out = {}
    for k, spec, value in meta[0]:
        if spec is None:
            out[k] = value
            continue
        t = d[k] if dist.get_rank() == src else torch.empty(spec[1], dtype=spec[0])
        if t.numel():
            dist.broadcast(t, src=src, group=group)
        out[k] = t
    return out


def _mq_worker(rank, world, port, quick, chunk_mb, results):
    import tpcomm

    torch.set_num_threads(1)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    gloo = dist.new_group(backend="gloo")
    mq = tpcomm.MessageQueue.create_from_process_group(
        dist.group.WORLD, max_chunk_bytes=int(chunk_mb * (1 << 20)), max_chunks=8, writer_rank=0)
    rows = []
    for name, payload, iters in payloads(quick):
        d = payload if rank == 0 else None
        timings = {}
        for path in ("mq", "gloo"):
            for _ in range(max(1, iters // 10)):  # warm-up
                mq.broadcast_tensor_dict(d) if path == "mq" else gloo_broadcast_dict(
                    payload, 0, gloo)
            dist.barrier(group=gloo)
            start = time.perf_counter()
            for _ in range(iters):
                if path == "mq":
                    out = mq.broadcast_tensor_dict(d)
                else:
                    out = gloo_broadcast_dict(payload, 0, gloo)
            dist.barrier(group=gloo)
            timings[path] = (time.perf_counter() - start) / iters
            assert set(out) == set(payload)
        rows.append((name, _nbytes(payload), timings["mq"], timings["gloo"]))
    if rank == 0:
        results.put(rows)
    mq.shutdown()
    dist.destroy_process_group()


def _memcpy_gbps():
    torch.set_num_threads(1)
    src = torch.ones(64 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return src.numel() / best / 1e9


def run(readers_list, quick, chunk_mb):
    memcpy = _memcpy_gbps()
    print(f"single-thread memcpy (64 MB): {memcpy:.2f} GB/s; ring: 8 chunks of {chunk_mb} MB")
    print(f"{'payload':38s} {'readers':>7s} {'mq us/msg':>10s} {'gloo us/msg':>12s} "
          f"{'speed-up':>8s} {'mq GB/s/reader':>15s} {'% memcpy':>9s}")
    for readers in readers_list:
        rows = run_ranks(_mq_worker, readers + 1, lambda r: (quick, chunk_mb), 1200)
        if rows is None:
            print(f"readers={readers}: a worker failed", file=sys.stderr)
            return 1
        for name, nbytes, t_mq, t_gloo in rows:
            gbps = nbytes / t_mq / 1e9 if nbytes else 0.0
            print(f"{name:38s} {readers:7d} {t_mq * 1e6:10.1f} {t_gloo * 1e6:12.1f} "
                  f"{t_gloo / t_mq:7.1f}x {gbps:15.2f} {100 * gbps / memcpy:8.0f}%")
    return 0
