"""The push one-shot (custom_allreduce/push_kernels.cuh) on a GPU, ranks as
streams of one process: every dtype, world size and tail against the
rank-order sum bit for bit; zeros (read as +0); calls back to back with a
random rank held back (its peers run ahead into its next round), mixed with
the barrier kernels and sizes that grow and shrink; graph replays on fresh
inputs beside eager calls; the fused push; dependent launch (PDL) on and
off; a withheld rank named and the reset recovering."""

import random
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU on this machine: custom allreduce kernels need one",
                allow_module_level=True)

import tpcomm  # noqa: E402
from tpcomm import _C  # noqa: E402
from tpcomm.custom_allreduce import LocalGroup  # noqa: E402
from car_reference import inputs, rank_order_sum  # noqa: E402

MAX_BYTES = 1 << 20
HAS_PDL = torch.cuda.get_device_capability()[0] >= 9


@pytest.fixture(scope="module")
def groups():
    return {n: LocalGroup(n, max_bytes=MAX_BYTES, timeout_ms=10000) for n in range(2, 9)}


@pytest.mark.parametrize("n", range(2, 9))
def test_push_matches_the_rank_order_sum(groups, n):
    group = groups[n]
    slot = _C.car_push_slot_bytes(MAX_BYTES)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        size = torch.tensor([], dtype=dtype).element_size()
        for count in (1, 3, 8, 9, 1001, 4096, 65537 // size, slot // size):
            xs = inputs(n, count, seed=count + n, dtype=dtype)
            outs = [torch.full_like(x, float("nan")) for x in xs]
            group.all_reduce(xs, outs, algorithm="push")
            group.check()
            want = rank_order_sum(xs)
            for r, out in enumerate(outs):
                assert torch.equal(out, want), f"n={n} {dtype} count={count} rank {r}"
    xs = inputs(n, 777, seed=1)
    want = rank_order_sum(xs)
    group.all_reduce(xs, xs, algorithm="push")  # in place
    group.check()
    assert all(torch.equal(x, want) for x in xs)


def test_the_default_choice_is_a_push_up_to_its_limit(groups):
    for n in (2, 4, 8):
        limit = _C.car_push_limit(n, MAX_BYTES)
        assert _C.car_choose_algorithm(n, 16, MAX_BYTES) == "push"
        assert _C.car_choose_algorithm(n, limit, MAX_BYTES) == "push"
        assert _C.car_choose_algorithm(n, limit + 16, MAX_BYTES) != "push"


def test_zeros_are_read_as_positive_zero(groups):
    group = groups[3]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        count = 4096
        xs = [torch.randn(count, device="cuda").to(dtype) for _ in range(3)]
        for r, x in enumerate(xs):
            x[0::4] = -0.0  # -0 everywhere
            x[1::4] = -0.0 if r % 2 == 0 else 0.0
            if r == 0:
                x[2::4] = -0.0
            x[3::8] = 0.0
        pushed = group.all_reduce(xs, algorithm="push")
        barrier = group.all_reduce(xs, algorithm="oneshot")
        group.check()
        canonical = [torch.where(x == 0, torch.zeros_like(x), x) for x in xs]
        want = rank_order_sum(canonical)
        for r in range(3):
            assert torch.equal(pushed[r], want), (dtype, r)
            bits = pushed[r][0::4].view(torch.int16 if dtype != torch.float32 else torch.int32)
            assert torch.all(bits == 0), f"{dtype}: an all -0 element is not +0"
            # The barrier kernels add as IEEE does: -0 + -0 + -0 = -0.
            assert torch.all(torch.signbit(barrier[r][0::4])), dtype
            assert torch.equal(barrier[r], rank_order_sum(xs)), (dtype, r)


def _back_to_back(group, rounds, seed):
    """Calls issued with no synchronisation, a random rank held back before
    random ones; pushes mixed with barrier kernels, sizes up and down."""
    rng = random.Random(seed)
    n = group.world_size
    slot = _C.car_push_slot_bytes(group.max_bytes)
    calls = []
    for i in range(rounds):
        dtype = rng.choice([torch.float32, torch.bfloat16])
        size = torch.tensor([], dtype=dtype).element_size()
        kind = rng.choice(["push", "push", "push", "auto", "oneshot", "twoshot"])
        counts = [3, 8, 1000, 4096, 30_000, slot // size]
        if kind != "push":
            counts.append(200_000)
        count = rng.choice(counts)
        xs = inputs(n, count, seed=seed * 1000 + i, dtype=dtype)
        outs = [torch.full_like(x, float("nan")) for x in xs]
        late = rng.randrange(n)
        group.streams[late].wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(group.streams[late]):
            torch.cuda._sleep(rng.choice([0, 0, 20_000, 200_000]))  # GPU cycles
        group.all_reduce(xs, outs, algorithm=None if kind == "auto" else kind,
                         blocks=rng.choice([0, 1, 3, 8]))
        calls.append((xs, outs))
    return calls


@pytest.mark.parametrize("pdl", [False, True] if HAS_PDL else [False])
@pytest.mark.parametrize("n", [2, 3, 8])
def test_back_to_back_pushes_with_late_ranks(groups, n, pdl):
    group = groups[n]
    group.pdl = pdl
    try:
        calls = _back_to_back(group, 150, seed=n + 100 * pdl)
        group.check()
    finally:
        group.pdl = False
    for i, (xs, outs) in enumerate(calls):
        want = rank_order_sum(xs)
        for r, out in enumerate(outs):
            assert torch.equal(out, want), f"n={n} pdl={pdl} call {i} rank {r}"


@pytest.mark.parametrize("pdl", [False, True] if HAS_PDL else [False])
def test_graph_replays_of_pushes_beside_eager_calls(groups, pdl):
    n = 4
    group = groups[n]
    group.pdl = pdl
    xs = inputs(n, 4096, seed=7)
    ys = inputs(n, 1000, seed=8, dtype=torch.bfloat16)
    outs = [torch.empty_like(x) for x in xs]
    youts = [torch.empty_like(y) for y in ys]

    def step():  # two calls per replay: the rounds shift by two each replay
        group.all_reduce(xs, outs, algorithm="push")
        group.all_reduce(ys, youts)

    try:
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        eager = inputs(n, 333, seed=9)
        for i in range(400):
            for r in range(n):
                xs[r].normal_()
                ys[r].normal_()
            graph.replay()
            if i % 3 == 0:  # an eager push on the same streams, between replays
                got = group.all_reduce(eager, algorithm="push")
            if i % 40 == 0 or i == 399:
                torch.cuda.synchronize()
                for r in range(n):
                    assert torch.equal(outs[r], rank_order_sum(xs)), (i, r)
                    assert torch.equal(youts[r], rank_order_sum(ys)), (i, r)
                    assert torch.equal(got[r], rank_order_sum(eager)), (i, r)
        group.check()
    finally:
        group.pdl = False


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fused_push_matches_the_separate_operations(groups, n):
    group = groups[n]
    for hidden, tokens in ((4096, 1), (4096, 7), (1000, 3), (13, 5)):
        xs = [torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16) for _ in range(n)]
        res = [torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16) for _ in range(n)]
        ws = [torch.randn(hidden, device="cuda").to(torch.bfloat16) for _ in range(n)]
        normed, outs = group.all_reduce_add_rms_norm(xs, res, ws, eps=1e-5, algorithm="push")
        normed1, outs1 = group.all_reduce_add_rms_norm(xs, res, ws, eps=1e-5,
                                                       algorithm="oneshot")
        group.check()
        for r in range(n):
            want = (rank_order_sum(xs).float() + res[r].float()).to(torch.bfloat16)
            assert torch.equal(outs[r], want), (hidden, tokens, r)
            # The same epilogue as the barrier kernel: the same bits.
            assert torch.equal(outs[r], outs1[r]), (hidden, tokens, r)
            assert torch.equal(normed[r], normed1[r]), (hidden, tokens, r)


def test_a_withheld_rank_is_named_then_the_reset_recovers():
    group = LocalGroup(2, max_bytes=MAX_BYTES, timeout_ms=200)
    xs = inputs(2, 1024, seed=1)
    start = time.monotonic()
    group.all_reduce(xs, ranks=[0], algorithm="push")  # rank 1 never launches
    with pytest.raises(TimeoutError, match="rank 1 did not arrive .*its pushed values"):
        group.check()
    assert time.monotonic() - start < 5
    with pytest.raises(tpcomm.PeerLostError, match="an earlier call failed"):
        group.all_reduce(xs, algorithm="push")
    group.reset()
    for i in range(6):  # every round, after the reset
        ys = inputs(2, 1000 + i, seed=10 + i)
        outs = group.all_reduce(ys, algorithm="push" if i % 3 else "oneshot")
        group.check()
        assert all(torch.equal(o, rank_order_sum(ys)) for o in outs), i
