"""Benchmarks that print figures (never timed tests).

    python -m tpcomm.bench mq [--readers 1 3] [--quick] [--mode broadcast|round-trip|both]
    python -m tpcomm.bench car [--world-sizes 2 4 8] [--max-mib 64] [--png car_bench.png]
    python -m tpcomm.bench allreduce [--max-mib 64] [--quick]
    python -m tpcomm.bench cpu [--world-sizes 2 4] [--max-mib 64] [--quick] [--png cpu_bench.png]
                               [--dtypes | --paths | --late]
    python -m tpcomm.bench faults [--world-sizes 2 3] [--timeout 3] [--quick]
    python -m tpcomm.bench fused [--world-sizes 2 4] [--device cpu|cuda] [--dtype bfloat16]

mq: broadcast of tensor dicts from one writer to N readers on this host,
through tpcomm.MessageQueue and, in the same run, through the Gloo path
(metadata with broadcast_object_list, then one dist.broadcast per tensor);
plus single-thread memcpy bandwidth as the ceiling. Round trips (the writer
broadcasts, every reader acknowledges through a queue of its own) with the
queue's polling on and at spin 0, against Gloo, and a blocked reader's idle
CPU (see tpcomm._bench_mq_rt).

car: the custom allreduce on one GPU (see tpcomm._bench_car).

allreduce: dist.all_reduce over the tpcomm backend per route, and the host
overhead of its dispatch (see tpcomm._bench_allreduce).

cpu: CPU all_reduce, all_gather_into_tensor and reduce_scatter_tensor through
plain Gloo, tpcomm with its shared-memory path off and on, interleaved (see
tpcomm._bench_cpu).

faults: bad inputs, one-rank mistakes under TPCOMM_DEBUG and kill -9 of each
role, summarised as clear errors, timeouts, crashes and wrong results (see
tpcomm._bench_faults).

fused: all_reduce_add_rms_norm against all_reduce + add + rms_norm for
hidden 1024..8192 x 1..128 tokens, on CPU or with every rank on GPU 0 (see
tpcomm._bench_fused).
"""

import argparse
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks


def _payloads(quick):
    step = {f"t{i}": torch.arange(64, dtype=torch.int64) + i for i in range(4)}
    step.update(step=7, temperature=0.7, greedy=True)
    sizes = [("step dict (4 x int64[64] + scalars)", step, 300 if quick else 3000),
             ("1 KB", {"x": torch.ones(1 << 10, dtype=torch.uint8)}, 300 if quick else 3000),
             ("1 MB", {"x": torch.ones(1 << 20, dtype=torch.uint8)}, 30 if quick else 300),
             ("64 MB", {"x": torch.ones(64 << 20, dtype=torch.uint8)}, 3 if quick else 10)]
    return sizes


def _nbytes(d):
    return sum(v.numel() * v.element_size() for v in d.values() if isinstance(v, torch.Tensor))


def _gloo_broadcast_dict(d, src, group):
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
    for name, payload, iters in _payloads(quick):
        d = payload if rank == 0 else None
        timings = {}
        for path in ("mq", "gloo"):
            for _ in range(max(1, iters // 10)):  # warm-up
                mq.broadcast_tensor_dict(d) if path == "mq" else _gloo_broadcast_dict(
                    payload, 0, gloo)
            dist.barrier(group=gloo)
            start = time.perf_counter()
            for _ in range(iters):
                if path == "mq":
                    out = mq.broadcast_tensor_dict(d)
                else:
                    out = _gloo_broadcast_dict(payload, 0, gloo)
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


def bench_mq(readers_list, quick, chunk_mb):
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    mq = sub.add_parser("mq", help="message queue vs the Gloo path")
    mq.add_argument("--readers", type=int, nargs="+", default=[1, 3])
    mq.add_argument("--quick", action="store_true", help="fewer iterations")
    mq.add_argument("--chunk-mb", type=float, default=1.0, help="ring chunk size (default 1)")
    mq.add_argument("--mode", choices=("broadcast", "round-trip", "both"), default="both")
    car = sub.add_parser("car", help="custom allreduce, N ranks on N streams of one GPU")
    car.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    car.add_argument("--max-mib", type=int, default=64, help="largest size (default 64 MiB)")
    car.add_argument("--quick", action="store_true", help="fewer iterations")
    car.add_argument("--png", default="car_bench.png", help="plot of time vs size")
    ar = sub.add_parser("allreduce", help="dist.all_reduce per route on the GPUs present")
    ar.add_argument("--max-mib", type=int, default=64, help="largest size (default 64 MiB)")
    ar.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    cpu = sub.add_parser("cpu", help="CPU collectives: Gloo vs tpcomm shared memory off/on")
    cpu.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    cpu.add_argument("--max-mib", type=int, default=64, help="largest size (default 64 MiB)")
    cpu.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    cpu.add_argument("--rounds", type=int, default=3, help="interleaved rounds (best kept)")
    cpu.add_argument("--png", default="cpu_bench.png", help="plot of time vs size ('' for none)")
    cpu.add_argument("--dtypes", action="store_true",
                     help="all_reduce of float32/bfloat16/float16, best vs portable kernels")
    cpu.add_argument("--paths", action="store_true",
                     help="all_reduce through dist, async_op, functional, the coordinator op")
    cpu.add_argument("--late", action="store_true",
                     help="what a late peer costs under each waiting policy (2 ranks)")
    faults = sub.add_parser("faults", help="bad inputs, debug-mode mistakes, killed ranks")
    faults.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    faults.add_argument("--timeout", type=float, default=3.0, help="group timeout (s)")
    faults.add_argument("--quick", action="store_true", help="three of the five kill roles")
    fused = sub.add_parser("fused", help="fused allreduce + add + RMSNorm vs the three ops")
    fused.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    fused.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    fused.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    fused.add_argument("--quick", action="store_true", help="two shapes")
    fused.add_argument("--rounds", type=int, default=3, help="interleaved rounds (best kept)")
    args = parser.parse_args(argv)
    if args.what == "mq":
        rc = 0
        if args.mode in ("broadcast", "both"):
            rc = bench_mq(args.readers, args.quick, args.chunk_mb)
        if rc == 0 and args.mode in ("round-trip", "both"):
            from tpcomm._bench_mq_rt import run as run_round_trips

            rc = run_round_trips(args.readers, args.quick)
        return rc
    if args.what == "car":
        from tpcomm._bench_car import run

        return run(args.world_sizes, args.max_mib, args.quick, args.png)
    if args.what == "allreduce":
        from tpcomm._bench_allreduce import run as run_allreduce

        return run_allreduce(args.max_mib, args.quick)
    if args.what == "cpu":
        from tpcomm._bench_cpu import run as run_cpu
        from tpcomm._bench_cpu import run_dtypes, run_late, run_paths

        if args.paths:
            return run_paths(args.max_mib, args.quick, args.rounds)
        if args.late:
            return run_late()
        if args.dtypes:
            return run_dtypes(args.world_sizes, args.max_mib, args.quick, args.rounds)
        return run_cpu(args.world_sizes, args.max_mib, args.quick, args.png, args.rounds)
    if args.what == "faults":
        from tpcomm._bench_faults import run as run_faults

        return run_faults(args.world_sizes, args.timeout, args.quick)
    if args.what == "fused":
        from tpcomm._bench_fused import run as run_fused

        return run_fused(args.world_sizes, args.device, args.dtype, args.quick, args.rounds)
    return 2


if __name__ == "__main__":
    sys.exit(main())
