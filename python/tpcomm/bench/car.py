"""`python -m tpcomm.bench car`: the custom allreduce on one GPU, N ranks as
N streams of this process, eager and graph-replayed, with nccl-tests columns,
and in the same run the two baselines its goals are stated against:
(i) a graph replay of N empty kernels on the same N streams and (ii)
device-to-device copy bandwidth.

Goals: up to 8 KB within 1.3x of (i); from 4 MiB at least 85% of (ii),
counting the bytes the algorithm reads and writes (one-shot per rank: the
staging copy, N reads and 1 write of the size; two-shot: the staging copy,
N reads of a 1/N part and its write, then N part reads and writes). The N
ranks share one GPU's memory here, so the share counts all N ranks' bytes.
"""

import torch

from tpcomm import _C
from tpcomm.custom_allreduce import LocalGroup


def _time_ms(fn, iters):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters


def _graph_of(fn, reps=1):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return g


def _empty_kernels(streams):
    current = torch.cuda.current_stream()
    for s in streams:
        s.wait_stream(current)
        _C.car_launch_empty_kernel(s.cuda_stream)
    for s in streams:
        current.wait_stream(s)


def _copy_bandwidth(nbytes=256 << 20):
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src), 20)
    return 2 * nbytes / (ms * 1e-3) / 1e9  # read + write GB/s


def _traffic(algorithm, n, nbytes):
    """Bytes one rank's kernel moves: staging copy (read + write), then the
    algorithm's reads and writes."""
    staging = 2 * nbytes
    if algorithm == "oneshot":
        return staging + n * nbytes + nbytes
    # reduce: N reads of a 1/N part, one write of it; gather: N part reads, N writes
    return staging + nbytes + nbytes // n + 2 * nbytes


def run(world_sizes=(2, 4, 8), max_mib=64, quick=False, png="car_bench.png"):
    if not torch.cuda.is_available():
        print("no CUDA GPU: the custom allreduce benchmark needs one")
        return 1
    copy_gbs = _copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}; D2D copy {copy_gbs:.0f} GB/s "
          f"(read + write)")
    sizes = [16 << (2 * i) for i in range(20) if 16 << (2 * i) <= max_mib << 20]
    rows, plot = [], {}
    for n in world_sizes:
        group = LocalGroup(n, max_bytes=max_mib << 20, timeout_ms=10000)
        empty_graph = _graph_of(lambda: _empty_kernels(group.streams), reps=10)
        empty_us = _time_ms(empty_graph.replay, 20 if quick else 200) * 1e3 / 10
        print(f"\nN={n}: graph replay of {n} empty kernels: {empty_us:.2f} us")
        print(f"{'size':>10} {'count':>10} {'type':>6} {'algo':>8} {'eager us':>9} "
              f"{'graph us':>9} {'algbw':>7} {'busbw':>7} {'vs empty':>8} {'% copy':>7}")
        for nbytes in sizes:
            count = nbytes // 4
            xs = [torch.randn(count, device="cuda") for _ in range(n)]
            outs = [torch.empty_like(x) for x in xs]
            algorithm = _C.car_choose_algorithm(n, nbytes, max_mib << 20)
            iters = 5 if quick else (200 if nbytes <= 1 << 20 else 20)

            def call():
                group.all_reduce(xs, outs)

            eager_ms = _time_ms(call, iters)
            graph = _graph_of(call, reps=10)
            graph_ms = _time_ms(graph.replay, iters) / 10
            group.check()
            want = xs[0].clone()
            for x in xs[1:]:
                want += x
            assert torch.equal(outs[0], want), f"wrong result at N={n}, {nbytes} B"
            algbw = nbytes / (graph_ms * 1e-3) / 1e9
            busbw = algbw * 2 * (n - 1) / n
            # All N ranks share this GPU's memory: count every rank's traffic.
            moved = n * _traffic(algorithm, n, nbytes) / (graph_ms * 1e-3) / 1e9
            row = (n, nbytes, count, algorithm, eager_ms * 1e3, graph_ms * 1e3, algbw, busbw,
                   graph_ms * 1e3 / empty_us, 100 * moved / copy_gbs)
            rows.append(row)
            plot.setdefault(n, []).append((nbytes, graph_ms * 1e3, eager_ms * 1e3))
            print(f"{nbytes:>10} {count:>10} {'float':>6} {algorithm:>8} {row[4]:>9.2f} "
                  f"{row[5]:>9.2f} {algbw:>7.2f} {busbw:>7.2f} {row[8]:>7.2f}x {row[9]:>6.0f}%")
        group = None  # frees the buffers before the next world size
    small = [r for r in rows if r[1] <= 8 << 10]
    large = [r for r in rows if r[1] >= 4 << 20]
    if small:
        print(f"\n<=8 KB: worst graph time / empty-kernel replay = "
              f"{max(r[8] for r in small):.2f}x (goal <= 1.3x)")
    if large:
        print(f">=4 MiB: lowest share of copy bandwidth = {min(r[9] for r in large):.0f}% "
              f"(goal >= 85%)")
    _save_plot(plot, png)
    return 0


def _save_plot(plot, png):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, points in sorted(plot.items()):
        sizes = [p[0] for p in points]
        ax.loglog(sizes, [p[1] for p in points], marker="o", label=f"N={n} graph")
        ax.loglog(sizes, [p[2] for p in points], linestyle="--", label=f"N={n} eager")
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("time per allreduce (us)")
    ax.set_title("tpcomm custom allreduce, N ranks on one GPU")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"plot: {png}")
