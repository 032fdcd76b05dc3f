"""`python -m tpcomm.bench car`: the custom allreduce on one GPU, N ranks as
N streams of this process, eager and graph-replayed (staged, and zero-copy
from a table of the inputs: the `zc` column), with nccl-tests columns, and in
the same run the baselines its goals are stated against (and, up to 1 MiB,
the same call forced to the push one-shot (`push`), to the barrier one-shot
(`1shot`) and, on GPUs that have it, launched with programmatic dependent
launch (`pdl`), each a graph replay side by side with the default): (i) a graph replay
of N empty kernels on the same N streams, (ii) one flag round trip (a call
that moves no data), (iii) device-to-device copy bandwidth, and with
`--peer-vllm DIR` (iv) vLLM's custom allreduce graph-replayed on the same
streams, sizes and inputs (tpcomm.bench.peer_vllm), every result checked
bit for bit.

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


def _reference(xs):
    """The rank-order float32 sum, rounded to the inputs' dtype: the bits
    tpcomm's kernel gives on every rank."""
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return acc.to(xs[0].dtype)


def _best_ms(fns, iters, rounds=3):
    """Each fn's best time of `rounds` alternated runs (ms per call), the
    order rotated each round so that no fn always follows the same one."""
    best = [float("inf")] * len(fns)
    for k in range(rounds):
        for j in range(len(fns)):
            i = (j + k) % len(fns)
            best[i] = min(best[i], _time_ms(fns[i], iters))
    return best


def run(world_sizes=(2, 4, 8), max_mib=64, quick=False, png="car_bench.png", peer_vllm=None,
        dtype="float32", blocks_sweep=(), fused=False):
    if not torch.cuda.is_available():
        print("no CUDA GPU: the custom allreduce benchmark needs one")
        return 1
    dt = getattr(torch, dtype)
    peer_lib = None
    if peer_vllm:
        from tpcomm.bench import peer_vllm as pv

        peer_lib = pv.build(peer_vllm)
        print(f"vLLM's kernel: harness built against {peer_vllm} ({peer_lib})")
    copy_gbs = _copy_bandwidth()
    has_pdl = torch.cuda.get_device_capability()[0] >= 9
    push_slot = _C.car_push_slot_bytes(max_mib << 20)
    print(f"device: {torch.cuda.get_device_name()}; D2D copy {copy_gbs:.0f} GB/s "
          f"(read + write); dtype {dtype}")
    sizes = [16 << (2 * i) for i in range(20) if 16 << (2 * i) <= max_mib << 20]
    rows, plot, breakdown = [], {}, []
    for n in world_sizes:
        group = LocalGroup(n, max_bytes=max_mib << 20, timeout_ms=10000)
        vgroup = None
        if peer_lib is not None and n in (2, 4, 6, 8):
            vgroup = pv.VllmGroup(peer_lib, n, max_mib << 20)
        empty_graph = _graph_of(lambda: _empty_kernels(group.streams), reps=10)
        flag_graph = _graph_of(lambda: group.barrier_only(1), reps=10)
        iters = 20 if quick else 200
        empty_ms, flag_ms = _best_ms([empty_graph.replay, flag_graph.replay], iters)
        empty_us, flag_us = empty_ms * 1e3 / 10, flag_ms * 1e3 / 10
        group.check()
        scope = "GPU" if group.device_scope else "system"
        print(f"\nN={n} (flags at {scope} scope): graph replay of {n} empty kernels "
              f"{empty_us:.2f} us; of {n} barrier-only calls (one flag round trip, 1 block) "
              f"{flag_us:.2f} us")
        head = (f"{'size':>10} {'algo':>8} {'eager us':>9} {'graph us':>9} {'zc us':>7} "
                f"{'busbw':>7} {'vs empty':>8} {'% copy':>7}")
        if vgroup is not None:
            head += f" {'vllm':>7} {'vllm us':>8} {'vllm/us':>8}"
        print(head)
        for nbytes in sizes:
            count = nbytes // torch.tensor([], dtype=dt).element_size()
            xs = [torch.randn(count, device="cuda").to(dt) for _ in range(n)]
            outs = [torch.empty_like(x) for x in xs]
            zc_outs = [torch.empty_like(x) for x in xs]
            algorithm = _C.car_choose_algorithm(n, nbytes, max_mib << 20)
            iters = 5 if quick else (200 if nbytes <= 1 << 20 else 20)
            table = group.register(xs)

            def call():
                group.all_reduce(xs, outs)

            def zero_copy():
                group.all_reduce(xs, zc_outs, registered=table)

            eager_ms = _time_ms(call, iters)
            graph = _graph_of(call, reps=10)
            zc_graph = _graph_of(zero_copy, reps=10)
            fns = [graph.replay, zc_graph.replay]
            v_outs = None
            if vgroup is not None:
                v_outs = [torch.empty_like(x) for x in xs]
                vgroup.register(xs)  # the eager warm-up call of _graph_of
                v_graph = _graph_of(lambda: vgroup.all_reduce(xs, v_outs), reps=10)
                vgroup.register_graph()
                fns.append(v_graph.replay)
            # The variants, side by side: forced push / barrier one-shot, PDL.
            variants = {}
            forced_outs = [torch.empty_like(x) for x in xs]
            if nbytes <= 1 << 20:
                if nbytes <= push_slot:
                    variants["push"] = _graph_of(
                        lambda: group.all_reduce(xs, forced_outs, algorithm="push"), reps=10)
                variants["1shot"] = _graph_of(
                    lambda: group.all_reduce(xs, forced_outs, algorithm="oneshot"), reps=10)
                if has_pdl:
                    group.pdl = True
                    variants["pdl"] = _graph_of(call, reps=10)
                    group.pdl = False
            fns += [g.replay for g in variants.values()]
            times = _best_ms(fns, iters)
            graph_ms, zc_ms = times[0] / 10, times[1] / 10
            first_variant = 3 if vgroup is not None else 2  # after the graph, zc (and vLLM)
            variant_us = {name: times[first_variant + i] / 10 * 1e3
                          for i, name in enumerate(variants)}
            group.check()
            want = _reference(xs)
            for r in range(n):
                assert torch.equal(outs[r], want), f"wrong result on rank {r} at N={n}, {nbytes} B"
                assert torch.equal(zc_outs[r], want), f"zero-copy: wrong result on rank {r}"
                if variants:  # the last variant replayed wrote forced_outs or outs
                    assert torch.equal(forced_outs[r], want), f"forced: wrong result on rank {r}"
            algbw = nbytes / (graph_ms * 1e-3) / 1e9
            busbw = algbw * 2 * (n - 1) / n
            # All N ranks share this GPU's memory: count every rank's traffic.
            moved = n * _traffic(algorithm, n, nbytes) / (graph_ms * 1e-3) / 1e9
            row = {"n": n, "bytes": nbytes, "algo": algorithm, "eager": eager_ms * 1e3,
                   "graph": graph_ms * 1e3, "zc": zc_ms * 1e3, "empty": empty_us,
                   "flag": flag_us, "copy": 100 * moved / copy_gbs}
            line = (f"{nbytes:>10} {algorithm:>8} {row['eager']:>9.2f} {row['graph']:>9.2f} "
                    f"{row['zc']:>7.2f} {busbw:>7.2f} {row['graph'] / empty_us:>7.2f}x "
                    f"{row['copy']:>6.0f}%")
            row.update({f"v_{name}": us for name, us in variant_us.items()})
            if vgroup is not None:
                torch.cuda.synchronize()
                v_us = times[2] / 10 * 1e3
                v_algo = pv.vllm_algorithm(n, nbytes)
                agree = all(torch.equal(v_outs[r], v_outs[0]) for r in range(n))
                assert agree, f"vLLM's kernel: ranks disagree at N={n}, {nbytes} B"
                exact = torch.equal(v_outs[0], want)
                if not exact:  # its two-stage adds in another order: close, not equal
                    torch.testing.assert_close(v_outs[0].float(), want.float(), rtol=2e-2,
                                               atol=1e-2)
                row.update(vllm=v_us, vllm_algo=v_algo, vllm_exact=exact)
                line += f" {v_algo:>7} {v_us:>8.2f} {v_us / row['graph']:>7.2f}x"
                if not exact:
                    line += " (vLLM: ranks agree, not the rank-order bits)"
            line += "".join(f"  {name} {us:.2f}" for name, us in variant_us.items())
            print(line)
            rows.append(row)
            plot.setdefault(n, []).append((nbytes, row["graph"], row["eager"], row.get("vllm")))
            if blocks_sweep and nbytes >= 1 << 20:
                _sweep_blocks(group, xs, outs, n, nbytes, iters, blocks_sweep, copy_gbs)
        if fused:
            _fused_vs_allreduce(group, n)
        breakdown.append((n, empty_us, flag_us,
                          min(r["graph"] for r in rows if r["n"] == n and r["bytes"] <= 8 << 10)))
        if vgroup is not None:
            vgroup.close()
        group = None  # frees the buffers before the next world size
    _summary(rows, breakdown)
    _save_plot(plot, png)
    return 0


def _fused_vs_allreduce(group, n, hidden=4096, dtype=torch.bfloat16):
    """Graph replay of the fused allreduce + add + RMSNorm against the
    allreduce alone (both staged, same rows): goal at most 1.1x up to 64 KB."""
    print(f"{'':>10} fused allreduce + add + RMSNorm vs allreduce alone, hidden {hidden}, bf16:")
    for tokens in (1, 2, 4, 8, 16, 32):
        xs = [torch.randn(tokens, hidden, device="cuda").to(dtype) for _ in range(n)]
        res = [torch.randn(tokens, hidden, device="cuda").to(dtype) for _ in range(n)]
        ws = [torch.randn(hidden, device="cuda").to(dtype) for _ in range(n)]
        outs = [torch.empty_like(x) for x in xs]
        ar = _graph_of(lambda: group.all_reduce(xs, outs), reps=10)
        fu = _graph_of(lambda: group.all_reduce_add_rms_norm(xs, res, ws), reps=10)
        ar_ms, fu_ms = _best_ms([ar.replay, fu.replay], 100)
        group.check()
        nbytes = tokens * hidden * 2
        print(f"{'':>10}   {tokens:>3} tokens ({nbytes // 1024} KB): allreduce "
              f"{ar_ms * 100:.2f} us, fused {fu_ms * 100:.2f} us, {fu_ms / ar_ms:.2f}x")


def _sweep_blocks(group, xs, outs, n, nbytes, iters, counts, copy_gbs):
    """The graph time of one size at each block count that fits."""
    results = []
    algorithm = _C.car_choose_algorithm(n, nbytes, group.max_bytes)
    for blocks in counts:
        try:
            graph = _graph_of(lambda: group.all_reduce(xs, outs, blocks=blocks), reps=10)
        except ValueError:  # more than the GPU holds for every rank at once
            continue
        us = _time_ms(graph.replay, iters) / 10 * 1e3
        share = 100 * n * _traffic(algorithm, n, nbytes) / (us * 1e-6) / 1e9 / copy_gbs
        results.append(f"{blocks}: {us:.1f} us ({share:.0f}%)")
    print(f"{'':>10} blocks sweep, {algorithm}: " + ", ".join(results))


def _summary(rows, breakdown):
    print("\nwhere the time goes (graph replay, us): N, empty kernels, one flag round trip, "
          "the fastest call up to 8 KB")
    for n, empty, flag, call in breakdown:
        print(f"  N={n}: {empty:.2f}, {flag:.2f}, {call:.2f}")
    small = [r for r in rows if r["bytes"] <= 64 << 10]
    large = [r for r in rows if r["bytes"] >= 4 << 20]
    if small:
        worst = max(small, key=lambda r: r["graph"] / r["empty"])
        print(f"16 B-64 KB: worst graph time / empty-kernel replay = "
              f"{worst['graph'] / worst['empty']:.2f}x at N={worst['n']}, {worst['bytes']} B "
              f"(goal <= 1.5x)")
    if large:
        low = min(large, key=lambda r: r["copy"])
        print(f">=4 MiB: lowest share of copy bandwidth = {low['copy']:.0f}% at N={low['n']}, "
              f"{low['bytes']} B (goal >= 85%)")
    peer = [r for r in rows if "vllm" in r and r["bytes"] <= 1 << 20]
    if peer:
        slow = min(peer, key=lambda r: r["vllm"] / r["graph"])
        print(f"16 B-1 MiB: lowest vLLM time / tpcomm time = {slow['vllm'] / slow['graph']:.2f}x "
              f"at N={slow['n']}, {slow['bytes']} B (goal >= 1.0x)")
        low = [r for r in peer if r["bytes"] <= 64 << 10]
        if low:
            slow = min(low, key=lambda r: r["vllm"] / r["graph"])
            print(f"16 B-64 KB: lowest vLLM time / tpcomm time = "
                  f"{slow['vllm'] / slow['graph']:.2f}x at N={slow['n']}, {slow['bytes']} B "
                  f"(goal >= 1.25x)")


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
        if all(p[3] is not None for p in points):
            ax.loglog(sizes, [p[3] for p in points], linestyle=":", marker="x",
                      label=f"N={n} vLLM graph")
    ax.set_xlabel("bytes per rank")
    ax.set_ylabel("time per allreduce (us)")
    ax.set_title("tpcomm custom allreduce, N ranks on one GPU")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"plot: {png}")
