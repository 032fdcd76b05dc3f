"""python -m tpcomm.bench mq: broadcast from one writer to N readers on this
host, back to back, in the same run:

  dict          tpcomm.MessageQueue.broadcast_tensor_dict
  dict before   the tensor-dict format before frames (tpcomm.bench.mq_legacy)
  object        broadcast_object of the same dict (its tensors out of band)
  object before the same object pickled by torch, as the queue did before
  gloo          metadata with broadcast_object_list, one dist.broadcast per tensor

plus zero copy (a tensor of the queue's arena) against the same bytes copied
through the ring, and single-thread memcpy bandwidth as the ceiling. Variants
run in rounds, each round starting at another variant; the best round counts.
The round trips are tpcomm.bench.mq_round_trip.
"""

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks


def payloads(quick):
    """(name, dict, iterations) of what the benchmark broadcasts."""
    step = {f"t{i}": torch.arange(64, dtype=torch.int64) + i for i in range(4)}
    step.update(step=7, temperature=0.7, greedy=True)

    def tensors(total):
        return {f"w{i}": torch.ones(total // 16, dtype=torch.float32) for i in range(4)}

    q = 10 if quick else 1
    return [("step dict (4 x int64[64] + scalars)", step, 3000 // q),
            ("1 KB", {"x": torch.ones(1 << 10, dtype=torch.uint8)}, 3000 // q),
            ("1 MiB in 4 tensors", tensors(1 << 20), 300 // q),
            ("1 MB", {"x": torch.ones(1 << 20, dtype=torch.uint8)}, 300 // q),
            ("16 MiB in 4 tensors", tensors(16 << 20), max(3, 30 // q)),
            ("64 MB", {"x": torch.ones(64 << 20, dtype=torch.uint8)}, max(3, 10 // q))]


VARIANTS = ("dict", "dict before", "object", "object before", "gloo")
ARENA_MB = (16, 64)


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


def _timed(iters, call):
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - start) / iters


def _mq_worker(rank, world, port, quick, chunk_mb, results):
    import tpcomm
    from tpcomm.bench import mq_legacy

    torch.set_num_threads(1)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    gloo = dist.new_group(backend="gloo")
    mq = tpcomm.MessageQueue.create_from_process_group(
        dist.group.WORLD, max_chunk_bytes=int(chunk_mb * (1 << 20)), max_chunks=8, writer_rank=0,
        arena_bytes=4 * (max(ARENA_MB) << 20))
    writer = rank == 0
    rounds = 2 if quick else len(VARIANTS)
    rows = []
    for name, payload, iters in payloads(quick):
        d = payload if writer else None
        calls = {"dict": lambda: mq.broadcast_tensor_dict(d),
                 "dict before": lambda: mq_legacy.broadcast_tensor_dict(mq, d),
                 "object": lambda: mq.broadcast_object(d),
                 "object before": lambda: mq_legacy.broadcast_object(mq, d),
                 "gloo": lambda: gloo_broadcast_dict(payload, 0, gloo)}
        best = {v: float("inf") for v in VARIANTS}
        for r in range(rounds):
            for variant in VARIANTS[r:] + VARIANTS[:r]:  # each round starts elsewhere
                n = iters if variant != "object before" else max(1, iters // 3)
                for _ in range(max(2, n // 10)):  # warm-up
                    out = calls[variant]()
                assert set(out) == set(payload)
                dist.barrier(group=gloo)
                best[variant] = min(best[variant], _timed(n, calls[variant]))
                dist.barrier(group=gloo)
        rows.append((name, _nbytes(payload), best))
    # Zero copy: the writer fills a tensor of the arena and sends it, against
    # the same bytes copied through the ring; each reader reads one element.
    arena = []
    for mb in ARENA_MB:
        numel = (mb << 20) // 4
        copied = torch.ones(numel) if writer else None
        iters = 3 if quick else 10
        state = {"t": None}

        def send_copy():
            out = mq.broadcast_tensor_dict({"x": copied} if writer else None)
            return float(out["x"][-1])

        def send_arena():
            if writer:
                state["t"] = None  # the previous message's tensor dies first
                state["t"] = mq.empty((numel,), torch.float32)
                state["t"][-1] = 1.0
            out = mq.broadcast_tensor_dict({"x": state["t"]} if writer else None)
            return float(out["x"][-1])

        best = {"copy": float("inf"), "arena": float("inf")}
        for _ in range(rounds):
            for variant, call in (("copy", send_copy), ("arena", send_arena)):
                call()
                dist.barrier(group=gloo)
                best[variant] = min(best[variant], _timed(iters, call))
                dist.barrier(group=gloo)
        state["t"] = None
        arena.append((f"{mb} MiB tensor", mb << 20, best))
    if writer:
        results.put((rows, arena))
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
    print("Broadcast back to back, us per message, best of interleaved rounds. 'dict': "
          "broadcast_tensor_dict; 'object': broadcast_object of the same dict; 'before': the "
          "formats before frames (tensor dict header pickled and sliced in Python; tensors in "
          "objects pickled by torch); 'gloo': metadata object + one broadcast per tensor.")
    print(f"{'payload':36s} {'readers':>7s} {'dict':>9s} {'before':>9s} {'object':>9s} "
          f"{'before':>9s} {'gloo':>10s} {'dict/bef':>8s} {'obj/dict':>8s} {'GB/s/rd':>7s}")
    arenas = []
    for readers in readers_list:
        got = run_ranks(_mq_worker, readers + 1, lambda r: (quick, chunk_mb), 1800)
        if got is None:
            print(f"readers={readers}: a worker failed", file=sys.stderr)
            return 1
        rows, arena = got
        for name, nbytes, best in rows:
            t = [best[v] for v in VARIANTS]
            gbps = nbytes / t[0] / 1e9 if nbytes else 0.0
            print(f"{name:36s} {readers:7d} " + " ".join(f"{x * 1e6:9.1f}" for x in t[:4])
                  + f" {t[4] * 1e6:10.1f} {t[0] / t[1]:7.2f}x {t[2] / t[0]:7.2f}x {gbps:7.2f}")
        arenas.append((readers, arena))
    print("Zero copy: a tensor the writer filled in the arena (mq.empty) against the same "
          "bytes copied through the ring (us per message).")
    print(f"{'payload':20s} {'readers':>7s} {'copied':>10s} {'arena':>10s} {'arena/copied':>12s}")
    for readers, arena in arenas:
        for name, _, best in arena:
            print(f"{name:20s} {readers:7d} {best['copy'] * 1e6:10.1f} {best['arena'] * 1e6:10.1f} "
                  f"{best['arena'] / best['copy']:11.3f}x")
    return 0
