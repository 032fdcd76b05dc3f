"""The fused allreduce + residual add + RMSNorm on a GPU: (a) the kernel with
N = 2..8 ranks on N streams of one process, both algorithms, the three
dtypes, hidden sizes that are and are not multiples of the pack, in place;
(b) captured in a CUDA graph and replayed on fresh inputs; (c)
GroupCoordinator.all_reduce_add_rms_norm in 2 processes sharing this GPU
(the custom route; stats show no NCCL), eagerly and under graph capture.

References: residual_out bitwise equal to torch's float32 rank-order sum
rounded to the dtype plus the residual; normed within float32 statistics and
one rounding of a float64 RMSNorm; every rank's outputs bitwise equal."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU on this machine: the fused kernel needs one",
                allow_module_level=True)

from tpcomm.custom_allreduce import LocalGroup  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
from harness import Group  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-5
SHAPES = [(1, 1024), (3, 13), (7, 4096), (16, 1000), (128, 2048)]


def _inputs(n, rows, hidden, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(rows, hidden, generator=g).to(dtype).cuda() for _ in range(n)]
    residual = torch.randn(rows, hidden, generator=g).to(dtype).cuda()
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype).cuda()
    return xs, residual, weight


def _expected(xs, residual):
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return acc.to(xs[0].dtype) + residual


def _check_normed(normed, residual_out, weight, where):
    ro = residual_out.double()
    ref = ro * torch.rsqrt(ro.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    rounding = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
    tol = ref.abs() * (2.0**-24 * (ro.shape[-1] / 8 + 8) + 2 * rounding[normed.dtype]) + 1e-6
    assert ((normed.double() - ref).abs() <= tol).all(), where


@pytest.fixture(scope="module")
def local_groups():
    groups = {n: LocalGroup(n, max_bytes=1 << 20, timeout_ms=5000) for n in range(2, 9)}
    yield groups
    torch.cuda.synchronize()


@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot"])
def test_streams_in_one_process(local_groups, n, algorithm):
    group = local_groups[n]
    for dtype in DTYPES:
        for i, (rows, hidden) in enumerate(SHAPES):
            xs, residual, weight = _inputs(n, rows, hidden, dtype, seed=i + 10 * n)
            residuals = [residual.clone() for _ in range(n)]
            in_place = i % 2 == 1
            normed, outs = group.all_reduce_add_rms_norm(xs, residuals, [weight] * n, EPS,
                                                         algorithm, in_place=in_place)
            group.check()
            want = _expected(xs, residual)
            for r in range(n):
                where = f"n={n} {algorithm} {dtype} {rows}x{hidden} rank {r}"
                assert torch.equal(outs[r], want), where
                assert torch.equal(normed[r], normed[0]), where
                _check_normed(normed[r], outs[r], weight, where)


def test_graph_capture_and_replay(local_groups):
    n, rows, hidden = 4, 8, 4096
    group = local_groups[n]
    xs, residual, weight = _inputs(n, rows, hidden, torch.bfloat16, seed=3)
    residuals = [residual.clone() for _ in range(n)]
    group.all_reduce_add_rms_norm(xs, residuals, [weight] * n, EPS)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, outs = group.all_reduce_add_rms_norm(xs, residuals, [weight] * n, EPS)
    for i in range(200):
        fresh, _, _ = _inputs(n, rows, hidden, torch.bfloat16, seed=100 + i)
        for x, f in zip(xs, fresh):
            x.copy_(f)
        graph.replay()
        if i % 37 == 0 or i == 199:
            group.check()
            want = _expected(xs, residual)
            for r in range(n):
                assert torch.equal(outs[r], want), (i, r)
                _check_normed(normed[r], outs[r], weight, f"replay {i} rank {r}")


def _coordinator_path(ctx):
    import tpcomm

    torch.cuda.set_device(0)
    c = tpcomm.GroupCoordinator([list(range(ctx.world_size))], ctx.rank, group_name="fused_gpu",
                                device="cuda:0")
    n = ctx.world_size
    for dtype in DTYPES:
        for rows, hidden in SHAPES:
            xs, residual, weight = _inputs(n, rows, hidden, dtype, seed=rows + hidden)
            normed, residual_out = c.all_reduce_add_rms_norm(xs[ctx.rank], residual, weight, EPS)
            torch.cuda.synchronize()
            assert c.last_fused_path.startswith("custom_"), c.last_fused_path
            assert torch.equal(residual_out, _expected(xs, residual)), (dtype, rows, hidden)
            _check_normed(normed, residual_out, weight, f"{dtype} {rows}x{hidden}")
    # Under a plain graph capture: each replay is a fresh fused allreduce.
    xs, residual, weight = _inputs(n, 4, 2048, torch.bfloat16, seed=9)
    x = xs[ctx.rank].clone()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        normed, residual_out = c.all_reduce_add_rms_norm(x, residual, weight, EPS)
    torch.cuda.current_stream().wait_stream(side)
    for i in range(100):
        fresh, _, _ = _inputs(n, 4, 2048, torch.bfloat16, seed=200 + i)
        x.copy_(fresh[ctx.rank])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(residual_out, _expected(fresh, residual)), i
    assert tpcomm.stats(c.device_group)["nccl"]["calls"] == 0
    return normed.cpu()


@pytest.mark.parametrize("world_size", [2, 4])
def test_coordinator_on_the_custom_route(world_size):
    env = {"TPCOMM_CAR_MAX_BYTES": str(1 << 20), "TPCOMM_CAR_TIMEOUT_MS": "3000"}
    group = Group(world_size, env=env, extra_paths=[HERE], start_timeout_s=240)
    try:
        results = group.run(_coordinator_path, timeout_s=600)
    finally:
        group.close()
    for r in results[1:]:
        assert torch.equal(r, results[0])
