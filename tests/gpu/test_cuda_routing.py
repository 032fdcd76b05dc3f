"""The backend's CUDA allreduce routed to the custom kernel, through
dist.all_reduce: 2 and 4 processes sharing this GPU through CUDA IPC (NCCL
refuses two ranks on one GPU, so these tests keep to the custom routes and
check with stats() that NCCL was never used). Results are compared bitwise
with the kernel's arithmetic done by torch (float32 sums in rank order) and
against a float64 reference; plain torch.cuda.graph capture without warm-up,
graph_capture() zero-copy, async Work and futures, mismatched captures, the
expandable-segments allocator, and a withheld rank."""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU on this machine: CUDA routing tests need one",
                allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
from harness import Group  # noqa: E402

MAX_BYTES = 1 << 20
ENV = {"TPCOMM_CAR_MAX_BYTES": str(MAX_BYTES), "TPCOMM_CAR_TIMEOUT_MS": "3000"}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _input(rank, count, dtype, seed):
    g = torch.Generator().manual_seed(seed * 131 + rank)
    return (torch.randn(count, generator=g) * (rank + 1)).to(dtype).cuda()


def _kernel_reference(xs, scale):
    """What the kernel computes: float32 sum in rank order, times scale, cast."""
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return (acc * scale).to(xs[0].dtype)


def _same_on_every_rank(ctx, tensor):
    import torch.distributed as dist
    every = [None] * ctx.world_size
    dist.all_gather_object(every, tensor.cpu().view(torch.uint8).numpy().tobytes(), group=ctx.ref)
    return all(e == every[0] for e in every)


def _routes_results_and_stats(ctx):
    import torch.distributed as dist

    import tpcomm
    torch.cuda.set_device(0)
    n = ctx.world_size
    tpcomm.reset_stats()
    calls = 0
    for dtype in DTYPES:
        most = MAX_BYTES // torch.tensor([], dtype=dtype).element_size()
        for count in (0, 1, 7, 1000, 65537, most):
            xs = [_input(r, count, dtype, count) for r in range(n)]
            for op, scale in ((dist.ReduceOp.SUM, 1.0), (dist.ReduceOp.AVG, 1.0 / n)):
                x = xs[ctx.rank].clone()
                x_before = x.data_ptr()
                dist.all_reduce(x, op=op)
                calls += 1
                assert x.data_ptr() == x_before
                assert torch.equal(x, _kernel_reference(xs, scale)), (dtype, count, op)
                want = sum(t.double() for t in xs) * scale if count else x.double()
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                assert torch.allclose(x.double(), want, rtol=tol, atol=tol * n), (dtype, count)
                assert _same_on_every_rank(ctx, x)
    # A view that is not 16-byte aligned goes through an aligned copy.
    base = torch.arange(1 + 1000, device="cuda", dtype=torch.float32) * (ctx.rank + 1)
    view = base[1:]
    dist.all_reduce(view)
    calls += 1
    want = torch.arange(1, 1001, device="cuda", dtype=torch.float32) * (n * (n + 1) / 2)
    assert torch.equal(view, want)
    s = tpcomm.stats()
    assert s["nccl"]["calls"] == 0, s
    assert s["custom_oneshot"]["calls"] + s["custom_twoshot"]["calls"] == calls, s
    if n > 2:
        assert s["custom_twoshot"]["calls"] > 0, s  # 1 MiB is above 512 KiB at 3-4 ranks
    d = tpcomm.describe()
    assert d["custom_allreduce"]["available"], d
    assert d["device"] == "cuda:0" and d["device_backend"] == "nccl (not created)"


def _async_work_and_future(ctx):
    import torch.distributed as dist
    torch.cuda.set_device(0)
    n = ctx.world_size
    x = torch.full((4096,), float(ctx.rank + 1), device="cuda")
    work = dist.all_reduce(x, async_op=True)
    work.wait()  # the current stream now waits for the call
    assert torch.equal(x, torch.full_like(x, n * (n + 1) / 2))
    y = torch.ones(1 << 16, device="cuda", dtype=torch.bfloat16)
    fut = dist.all_reduce(y, async_op=True).get_future()
    done = fut.then(lambda f: f.value()[0] * 2)
    assert torch.equal(done.wait(), torch.full_like(y, 2 * n))


def _plain_graph_without_warm_up(ctx):
    """The first CUDA call of a fresh group happens inside the capture."""
    import torch.distributed as dist
    torch.cuda.set_device(0)
    n = ctx.world_size
    group = dist.new_group(backend="tpcomm")
    x = torch.zeros(4096, device="cuda")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        y = x * 2
        dist.all_reduce(y, group=group)
        y += 1
    torch.cuda.current_stream().wait_stream(side)
    base = torch.arange(4096, device="cuda", dtype=torch.float32)
    for i in range(1000):
        x.copy_(base * (ctx.rank + 1) + i)
        graph.replay()
        if i % 97 == 0 or i == 999:
            want = 2 * (base * (n * (n + 1) / 2) + n * i) + 1
            assert torch.equal(y, want), i
    import tpcomm
    assert tpcomm.stats(group)["nccl"]["calls"] == 0


def _zero_copy_graph_capture(ctx):
    import tpcomm
    torch.cuda.set_device(0)
    n = ctx.world_size
    c = tpcomm.GroupCoordinator([list(range(n))], local_rank=0, group_name="zc")
    small = torch.zeros(2048, device="cuda", dtype=torch.float16)
    c.all_reduce(small)  # eager first call: set-up outside the capture
    with c.graph_capture() as gctx:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=gctx.stream):
            out_small = c.all_reduce(small * 2)
            # 768 KiB: one-shot at 2 ranks, two-shot at 4.
            mid = torch.zeros(192 << 10, device="cuda") + small[:1].float()
            out_mid = c.all_reduce(mid)
    zc = tpcomm.describe(c)["custom_allreduce"]["zero_copy"]
    assert zc["registered"] == 2 and zc["staged"] == 0, zc
    for i in range(200):
        small.copy_(torch.full_like(small, float(ctx.rank + i % 7)))
        graph.replay()
        torch.cuda.synchronize()
        expect = sum(2.0 * (r + i % 7) for r in range(n))
        assert torch.equal(out_small, torch.full_like(out_small, expect)), i
        assert torch.equal(out_mid, torch.full_like(out_mid, sum(float(r + i % 7) for r in range(n))))
    c.destroy()


def _mismatched_captures_raise_everywhere(ctx):
    import tpcomm
    torch.cuda.set_device(0)
    n = ctx.world_size
    c = tpcomm.GroupCoordinator([list(range(n))], local_rank=0, group_name="mismatch")
    x = torch.ones(1024, device="cuda")
    c.all_reduce(x)
    with pytest.raises(ValueError, match="ranks captured different numbers of custom allreduces"):
        with c.graph_capture() as gctx:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=gctx.stream):
                for _ in range(2 if ctx.rank == 0 else 1):
                    c.all_reduce(x)
    # The group still works eagerly.
    assert torch.equal(c.all_reduce(x), torch.full_like(x, n))
    c.destroy()


def _expandable_segments_stage_instead(ctx):
    import tpcomm
    torch.cuda.set_device(0)
    n = ctx.world_size
    c = tpcomm.GroupCoordinator([list(range(n))], local_rank=0, group_name="expandable")
    x = torch.full((4096,), float(ctx.rank), device="cuda")
    c.all_reduce(x)
    with c.graph_capture() as gctx:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=gctx.stream):
            out = c.all_reduce(x)
    zc = tpcomm.describe(c)["custom_allreduce"]["zero_copy"]
    assert zc["staged"] == 1 and "expandable" in zc["last_staged_reason"], zc
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, sum(range(n))))
    c.destroy()


def _withheld_rank(ctx):
    import torch.distributed as dist
    torch.cuda.set_device(0)
    group = dist.new_group(backend="tpcomm")
    x = torch.ones(4096, device="cuda")
    dist.all_reduce(x, group=group)  # set up on both ranks
    torch.cuda.synchronize()
    if ctx.rank == 0:
        dist.all_reduce(x, group=group)  # rank 1 never comes
        torch.cuda.synchronize()  # the kernel gives up after TPCOMM_CAR_TIMEOUT_MS
        with pytest.raises(RuntimeError, match="rank 1 did not arrive"):
            dist.all_reduce(x, group=group)
    dist.barrier(group=ctx.ref)
    # The process stays usable: CPU collectives and a new group's kernel work.
    fresh = dist.new_group(backend="tpcomm")
    y = torch.ones(4096, device="cuda")
    dist.all_reduce(y, group=fresh)
    assert torch.equal(y, torch.full_like(y, ctx.world_size))


def _autotune(ctx, cache_dir):
    import torch.distributed as dist

    import tpcomm
    torch.cuda.set_device(0)
    first = dist.new_group(backend="tpcomm")
    x = torch.ones(4096, device="cuda")
    dist.all_reduce(x, group=first)  # set-up measures the crossovers
    d = tpcomm.describe(first)
    assert d["autotune"].startswith("measured"), d["autotune"]
    assert "NCCL not measured (ranks share a GPU)" in d["autotune"]
    rows = d["cuda_allreduce_routes"]
    assert rows[-1]["route"] == "nccl" and rows[0]["route"].startswith("custom"), rows
    second = dist.new_group(backend="tpcomm")
    dist.all_reduce(x, group=second)
    assert tpcomm.describe(second)["autotune"].startswith(f"cache {cache_dir}/"), \
        tpcomm.describe(second)["autotune"]
    assert torch.equal(x, torch.full_like(x, ctx.world_size ** 2))
    return rows


@pytest.fixture(scope="module", params=[2, 4])
def shared_gpu(request):
    group = Group(request.param, env=ENV, extra_paths=[HERE], start_timeout_s=240)
    yield group
    group.close()


def test_dist_all_reduce_routes_to_the_custom_kernel(shared_gpu):
    shared_gpu.run(_routes_results_and_stats, timeout_s=600)


def test_async_work_and_future(shared_gpu):
    shared_gpu.run(_async_work_and_future, timeout_s=300)


def test_plain_graph_capture_without_warm_up_replays_1000_times(shared_gpu):
    shared_gpu.run(_plain_graph_without_warm_up, timeout_s=600)


def test_graph_capture_zero_copy(shared_gpu):
    shared_gpu.run(_zero_copy_graph_capture, timeout_s=600)


def test_mismatched_captures_raise_on_every_rank(shared_gpu):
    shared_gpu.run(_mismatched_captures_raise_everywhere, timeout_s=300)


def test_expandable_segments_fall_back_to_staging():
    env = dict(ENV, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    group = Group(2, env=env, extra_paths=[HERE], start_timeout_s=240)
    try:
        group.run(_expandable_segments_stage_instead, timeout_s=300)
    finally:
        group.close()


def test_autotune_measures_once_then_reads_the_cache(tmp_path):
    env = dict(ENV, TPCOMM_AUTOTUNE="1", TPCOMM_AUTOTUNE_DIR=str(tmp_path))
    group = Group(2, env=env, extra_paths=[HERE], start_timeout_s=240)
    try:
        rows = group.run(_autotune, str(tmp_path), timeout_s=600)
    finally:
        group.close()
    assert rows[0] == rows[1]  # every rank routes by the same table
    cached = list(tmp_path.glob("*-ws2-max1048576.txt"))
    assert len(cached) == 1 and "oneshot_max_bytes=" in cached[0].read_text()


def test_withheld_rank_raises_and_the_process_stays_usable():
    group = Group(2, env=ENV, extra_paths=[HERE], start_timeout_s=240)
    try:
        group.run(_withheld_rank, timeout_s=300)
    finally:
        group.close()
