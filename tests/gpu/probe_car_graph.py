"""Where a graph-replayed custom allreduce's time goes, ranks as streams of one
GPU: the kernels' own durations (the profiler's CUDA activity) against the
replay's wall time, for tpcomm's kernel, vLLM's (with --peer-vllm DIR) and
empty kernels, with and without an external event wait and record around each
launch (what tpcomm's launch order adds to a captured call with
TPCOMM_CAR_GRAPH_ORDER=event).

    python tests/gpu/probe_car_graph.py [--peer-vllm DIR] [--world-sizes 2 4 8]
"""

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from tpcomm import _C
from tpcomm.bench.car import _graph_of, _time_ms
from tpcomm.custom_allreduce import LocalGroup


def _fork(streams, launch, events=None):
    current = torch.cuda.current_stream()
    for r, s in enumerate(streams):
        s.wait_stream(current)
        if events is not None:
            s.wait_event(events[r])
        launch(r, s)
        if events is not None:
            events[r].record(s)
    for s in streams:
        current.wait_stream(s)


def _kernel_us(graph, replays=50):
    """Mean duration per kernel name over `replays` replays (us)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.split("<")[0].split("(")[0][-40:]
            total[name] += e.device_time
            count[name] += 1
    return {k: (total[k] / count[k], count[k]) for k in total}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--peer-vllm", default=None)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    vlib = None
    if args.peer_vllm:
        from tpcomm.bench import peer_vllm as pv

        vlib = pv.build(args.peer_vllm)
    for n in args.world_sizes:
        group = LocalGroup(n, max_bytes=1 << 20, timeout_ms=10000)
        ordered = LocalGroup(n, max_bytes=1 << 20, timeout_ms=10000, graph_order="event")
        pdl = LocalGroup(n, max_bytes=1 << 20, timeout_ms=10000)
        pdl.pdl = True
        xs = [torch.randn(4, device="cuda") for _ in range(n)]
        outs = [torch.empty_like(x) for x in xs]
        ext = [torch.cuda.Event(external=True) for _ in range(n)]
        cases = {
            "empty": lambda: _fork(group.streams,
                                   lambda r, s: _C.car_launch_empty_kernel(s.cuda_stream)),
            "empty+ext events": lambda: _fork(
                group.streams, lambda r, s: _C.car_launch_empty_kernel(s.cuda_stream), ext),
            "tpcomm 16 B": lambda: group.all_reduce(xs, outs),
            "tpcomm 16 B push": lambda: group.all_reduce(xs, outs, algorithm="push"),
            "tpcomm 16 B one-shot": lambda: group.all_reduce(xs, outs, algorithm="oneshot"),
            "tpcomm barrier-only": lambda: group.barrier_only(1),
            "tpcomm 16 B, event order": lambda: ordered.all_reduce(xs, outs),
        }
        if torch.cuda.get_device_capability()[0] >= 9:
            cases["tpcomm 16 B push, PDL"] = lambda: pdl.all_reduce(xs, outs, algorithm="push")
        if vlib is not None and n in (2, 4, 8):
            vg = pv.VllmGroup(vlib, n, 1 << 20, streams=group.streams)
            vouts = [torch.empty_like(x) for x in xs]
            vg.register(xs)
            cases["vllm 16 B"] = lambda: vg.all_reduce(xs, vouts)
            cases["vllm 16 B+ext events"] = lambda: _fork_vllm(vg, xs, vouts, ext)
        print(f"\nN={n}")
        for name, fn in cases.items():
            graph = _graph_of(fn, reps=10)
            if name.startswith("vllm"):
                vg.register_graph()
            wall = _time_ms(graph.replay, 200) * 1e3 / 10
            kernels = _kernel_us(graph)
            ks = ", ".join(f"{k} {us:.2f} us x{c}" for k, (us, c) in kernels.items())
            print(f"  {name:>22}: replay {wall:6.2f} us per call; kernels: {ks}")
        group.check()


def _fork_vllm(vg, xs, outs, events):
    current = torch.cuda.current_stream()
    for s, e in zip(vg.streams, events):
        s.wait_stream(current)
        s.wait_event(e)
    vg.all_reduce(xs, outs)
    for s, e in zip(vg.streams, events):
        e.record(s)
        current.wait_stream(s)


if __name__ == "__main__":
    main()
