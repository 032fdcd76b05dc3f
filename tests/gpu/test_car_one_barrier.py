"""The one-barrier one-shot (staging by call parity, signal.hpp) and the
GPU-scope flags on a GPU, ranks as streams of one process: calls issued back
to back with no synchronisation, a random rank delayed before random calls
(so that its peers run ahead into the next call while it still reads), block
counts, algorithms and zero-copy mixed, eagerly and in a graph replayed on
fresh inputs; every rank's result bitwise against the rank-order sum. Then
the flag scope the set-up picks, the system scope by setting (in a fresh
process, as settings are read once), and the barrier-only call."""

import os
import random
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU on this machine: custom allreduce kernels need one",
                allow_module_level=True)

from tpcomm.custom_allreduce import LocalGroup  # noqa: E402
from car_reference import inputs, rank_order_sum  # noqa: E402

MAX_BYTES = 1 << 20


def _mixed_calls(group, rounds, seed):
    """`rounds` calls issued back to back; returns (inputs, outputs) per call."""
    rng = random.Random(seed)
    n = group.world_size
    calls = []
    for i in range(rounds):
        dtype = rng.choice([torch.float32, torch.bfloat16])
        count = rng.choice([8, 1000, 4096, 65536, 200_000])
        xs = inputs(n, count, seed=seed * 1000 + i, dtype=dtype)
        outs = [torch.full_like(x, float("nan")) for x in xs]
        late = rng.randrange(n)
        group.streams[late].wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(group.streams[late]):
            torch.cuda._sleep(rng.choice([0, 20_000, 200_000]))  # GPU cycles
        kind = rng.choice(["oneshot", "twoshot", "auto", "zero-copy"])
        blocks = rng.choice([0, 1, 3, 8])
        table = None  # kept alive until the kernels ran (another stream reads it)
        if kind == "zero-copy":
            table = group.register(xs)
            group.all_reduce(xs, outs, blocks=blocks, registered=table)
        else:
            group.all_reduce(xs, outs, algorithm=None if kind == "auto" else kind, blocks=blocks)
        calls.append((xs, outs, table))
    return calls


@pytest.mark.parametrize("n", [2, 3, 8])
def test_back_to_back_calls_with_late_ranks_match_the_reference(n):
    group = LocalGroup(n, max_bytes=MAX_BYTES, timeout_ms=10000)
    calls = _mixed_calls(group, 120, seed=n)
    group.check()
    for i, (xs, outs, _) in enumerate(calls):
        want = rank_order_sum(xs)
        for r, out in enumerate(outs):
            assert torch.equal(out, want), f"n={n} call {i} rank {r}"


def test_graph_replays_alternate_parity_on_fresh_inputs():
    n = 4
    group = LocalGroup(n, max_bytes=MAX_BYTES, timeout_ms=10000)
    xs = inputs(n, 4096, seed=7)
    ys = inputs(n, 100_000, seed=8, dtype=torch.bfloat16)
    outs = [torch.empty_like(x) for x in xs]
    youts = [torch.empty_like(y) for y in ys]

    def step():  # an odd number of calls per replay: each replay flips parity
        group.all_reduce(xs, outs, algorithm="oneshot")
        group.all_reduce(ys, youts, algorithm="twoshot")
        group.all_reduce(outs, outs, algorithm="oneshot")

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(300):
        for r in range(n):
            xs[r].normal_()
            ys[r].normal_()
        graph.replay()
        if i % 25 == 0 or i == 299:
            torch.cuda.synchronize()
            want = rank_order_sum([rank_order_sum(xs)] * n)
            for r in range(n):
                assert torch.equal(outs[r], want), (i, r)
                assert torch.equal(youts[r], rank_order_sum(ys)), (i, r)
    group.check()


def test_flag_scope_and_barrier_only():
    group = LocalGroup(2, max_bytes=MAX_BYTES, timeout_ms=5000)
    assert group.device_scope  # every rank on this GPU
    for blocks in (1, 4, 16):
        group.barrier_only(blocks)
    group.check()
    xs = inputs(2, 999, seed=3)
    assert all(torch.equal(o, rank_order_sum(xs)) for o in group.all_reduce(xs))
    script = (
        "import torch\n"
        "from tpcomm.custom_allreduce import LocalGroup\n"
        "from car_reference import inputs, rank_order_sum\n"
        "g = LocalGroup(3, max_bytes=1 << 20, timeout_ms=5000)\n"
        "assert not g.device_scope\n"
        "for i in range(20):\n"
        "    xs = inputs(3, 5000 + i, seed=i)\n"
        "    outs = g.all_reduce(xs, algorithm='oneshot' if i % 2 else 'twoshot')\n"
        "    g.check()\n"
        "    assert all(torch.equal(o, rank_order_sum(xs)) for o in outs), i\n"
        "print('system scope ok')\n")
    env = dict(os.environ, TPCOMM_CAR_FLAG_SCOPE="system",
               PYTHONPATH=os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "system scope ok" in done.stdout, done.stderr[-3000:]
