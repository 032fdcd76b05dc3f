"""The custom allreduce's hardening on a GPU (the items the CPU emulation and
the fake-GPU set-up tests cover on CPU): launches of one rank on several
streams and graph replays beside eager calls are serialised; a timeout
poisons the group (queued and late kernels stop at once with the cause) and
the collective reset makes it usable again; explicit block counts that cannot
be resident together are refused; two-shot sequences with changing block
counts (no end barrier); set-up inside torch.cuda.graph on its default
stream; launch settings compared across ranks; teardown with kernels in
flight; partly overlapping views refused; more captured calls than one
table chunk holds. Results are compared with the kernel's arithmetic done by
torch (float32 sums in rank order)."""

import gc
import os
import sys
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU on this machine: the custom allreduce hardening tests need one",
                allow_module_level=True)

import tpcomm  # noqa: E402
from tpcomm.custom_allreduce import LocalGroup  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
from harness import Group  # noqa: E402
from car_reference import inputs, rank_order_sum  # noqa: E402

MAX_BYTES = 1 << 20
ENV = {"TPCOMM_CAR_MAX_BYTES": str(MAX_BYTES), "TPCOMM_CAR_TIMEOUT_MS": "3000"}


# ------------------------------------------------------------ one process
def test_two_streams_per_rank_without_joins_are_serialised():
    """Rank r launches call A on one stream and call B on another that does
    not wait for A: without the launch order both kernels of a rank run at
    once on the same epochs and staging buffer."""
    n = 4
    group = LocalGroup(n, max_bytes=MAX_BYTES, timeout_ms=5000)
    first = [torch.cuda.Stream() for _ in range(n)]
    second = [torch.cuda.Stream() for _ in range(n)]
    current = torch.cuda.current_stream()
    for i in range(200):
        a = inputs(n, 16384 + i, seed=i)
        b = inputs(n, 16384 + i, seed=10_000 + i)
        out_a = [torch.full_like(x, float("nan")) for x in a]
        out_b = [torch.full_like(x, float("nan")) for x in b]
        for s in first + second:
            s.wait_stream(current)
        for r in range(n):
            group.ranks[r].all_reduce(a[r], out_a[r], "", 2, first[r].cuda_stream)
        for r in range(n):
            group.ranks[r].all_reduce(b[r], out_b[r], "", 2, second[r].cuda_stream)
        torch.cuda.synchronize()
        group.check()
        assert all(torch.equal(o, rank_order_sum(a)) for o in out_a), i
        assert all(torch.equal(o, rank_order_sum(b)) for o in out_b), i


def test_graph_replays_beside_eager_calls_are_serialised():
    """With external event nodes (TPCOMM_CAR_GRAPH_ORDER=event) a replay on
    one stream and eager calls on others are serialised."""
    n = 2
    group = LocalGroup(n, max_bytes=MAX_BYTES, timeout_ms=5000, graph_order="event")
    static = [torch.zeros(8192, device="cuda") for _ in range(n)]
    static_out = [torch.zeros(8192, device="cuda") for _ in range(n)]
    group.all_reduce(static, static_out)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        group.all_reduce(static, static_out)
    torch.cuda.current_stream().wait_stream(side)
    replay_stream = torch.cuda.Stream()
    eager_streams = [torch.cuda.Stream() for _ in range(n)]
    for i in range(300):
        for r in range(n):
            static[r].fill_(float(r + i))
        eager = inputs(n, 8192, seed=i)
        eager_out = [torch.empty_like(x) for x in eager]
        replay_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(replay_stream):
            graph.replay()
        group.all_reduce(eager, eager_out, streams=eager_streams)
        torch.cuda.synchronize()
        group.check()
        want = float(sum(r + i for r in range(n)))
        assert all(torch.equal(o, torch.full_like(o, want)) for o in static_out), i
        assert all(torch.equal(o, rank_order_sum(eager)) for o in eager_out), i


def test_timeout_poisons_queued_and_late_kernels_then_reset_recovers():
    group = LocalGroup(2, max_bytes=MAX_BYTES, timeout_ms=300)
    xs = inputs(2, 4096, seed=3)
    queued = [torch.full_like(x, float("nan")) for x in xs]
    start = time.monotonic()
    group.all_reduce(xs, ranks=[0])             # rank 1 never launches
    group.all_reduce(xs, queued, ranks=[0])     # queued behind it: stops at once
    torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    assert elapsed < 0.3 * 1.8, f"the queued kernel waited out its own timeout ({elapsed:.2f} s)"
    assert torch.isnan(queued[0]).all()
    with pytest.raises(TimeoutError, match="rank 1 did not arrive"):
        group.check()
    # Rank 1 comes late: it finds the poison at entry instead of pairing with
    # rank 0's next call, and stops at once.
    late = [torch.full_like(x, float("nan")) for x in xs]
    start = time.monotonic()
    group.all_reduce(xs, late, ranks=[1])
    torch.cuda.synchronize()
    assert time.monotonic() - start < 0.25
    assert torch.isnan(late[1]).all()
    assert "the group is poisoned: rank 0 gave up because rank 1 did not arrive" in \
        tpcomm._C.car_describe_error(group.ranks[1].error_code)
    group.reset()
    for i in range(20):
        ys = inputs(2, 4096 + i, seed=100 + i)
        outs = group.all_reduce(ys)
        group.check()
        assert all(torch.equal(o, rank_order_sum(ys)) for o in outs), i


def test_explicit_blocks_that_cannot_be_resident_together_are_refused():
    group = LocalGroup(8, max_bytes=MAX_BYTES, timeout_ms=2000)
    xs = inputs(8, 4096, seed=4)
    # One block per rank more than the GPU holds (an H100 holds 4 blocks of
    # 512 threads per SM: 528, so 8 x 66 does not fit).
    resident = tpcomm._C.car_max_resident_blocks("float32", "oneshot", 8)
    with pytest.raises(ValueError, match="must all be resident at once on one GPU"):
        group.all_reduce(xs, algorithm="oneshot", blocks=resident // 8 + 1)
    outs = group.all_reduce(xs)  # the chosen count fits
    group.check()
    assert all(torch.equal(o, rank_order_sum(xs)) for o in outs)


@pytest.mark.parametrize("n", [2, 3, 8])
def test_two_shot_sequences_with_changing_block_counts(n):
    """Two-shot has no end barrier: back-to-back calls whose block partitions
    differ must still not overwrite a result region a peer is gathering."""
    group = LocalGroup(n, max_bytes=MAX_BYTES, timeout_ms=5000)
    for i in range(300):
        blocks = (1, 4, 2, 7)[i % 4]
        xs = inputs(n, 50_000 + 13 * i, seed=i, dtype=torch.bfloat16)
        outs = group.all_reduce(xs, algorithm="twoshot", blocks=min(blocks, 132 // n))
        if i % 25 == 24:
            group.check()
        torch.cuda.synchronize()
        assert all(torch.equal(o, rank_order_sum(xs)) for o in outs), (n, i)


# ------------------------------------------------------------ processes
def _first_call_inside_default_capture(ctx):
    """torch.cuda.graph on its own capture stream (from PyTorch's pool): the
    set-up's private stream cannot be the one being captured."""
    import torch.distributed as dist
    torch.cuda.set_device(0)
    n = ctx.world_size
    group = dist.new_group(backend="tpcomm")
    x = torch.zeros(4096, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(x, group=group)
    for i in range(50):
        x.fill_(float(ctx.rank + i))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(x, torch.full_like(x, float(sum(r + i for r in range(n))))), i


def _mismatched_settings(ctx):
    from tpcomm.custom_allreduce import IpcCommunicator
    torch.cuda.set_device(0)
    comm = IpcCommunicator.create(max_bytes=MAX_BYTES, timeout_ms=2000)
    assert not comm.eligible
    return comm.reason


def _teardown_with_kernels_in_flight(ctx):
    from tpcomm.custom_allreduce import IpcCommunicator
    torch.cuda.set_device(0)
    n = ctx.world_size
    for round_ in range(3):
        comm = IpcCommunicator.create(max_bytes=MAX_BYTES, timeout_ms=5000)
        assert comm.eligible, comm.reason
        x = torch.ones(MAX_BYTES // 4, device="cuda")
        outs = [comm.all_reduce(x) for _ in range(20)]
        comm.check()  # every rank's calls are in flight or done
        del comm
        gc.collect()  # unmaps the peers' buffers: after the kernels ended
        torch.cuda.synchronize()  # raises on an illegal address
        assert all(torch.equal(o, torch.full_like(o, float(n))) for o in outs), round_


def _reset_through_the_backend(ctx):
    import torch.distributed as dist
    torch.cuda.set_device(0)
    group = dist.new_group(backend="tpcomm")
    x = torch.ones(4096, device="cuda")
    dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    if ctx.rank == 0:
        dist.all_reduce(x, group=group)  # rank 1 never comes
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match="reset_custom_allreduce"):
            dist.all_reduce(x, group=group)
    dist.barrier(group=ctx.ref)
    tpcomm.reset_custom_allreduce(group)
    for i in range(10):
        y = torch.full((4096,), float(ctx.rank + i), device="cuda")
        dist.all_reduce(y, group=group)
        torch.cuda.synchronize()
        want = float(sum(r + i for r in range(ctx.world_size)))
        assert torch.equal(y, torch.full_like(y, want)), i


def _overlapping_views_and_many_captures(ctx):
    torch.cuda.set_device(0)
    n = ctx.world_size
    c = tpcomm.GroupCoordinator([list(range(n))], local_rank=0, group_name="hard")
    warm = torch.ones(1024, device="cuda")
    c.all_reduce(warm)
    buf = torch.zeros(4096 + 16, device="cuda")
    inp, out = buf[:4096], buf[16:]  # distinct views sharing 4,080 elements
    # Partial overlap is refused on every rank, as on the CPU routes (and
    # as Gloo does): it would be read after it was written.
    with pytest.raises(RuntimeError, match="partly overlaps"):
        tpcomm.all_reduce_into(inp, out, group=c.device_group)
    separate = torch.zeros(4096, device="cuda")
    xs = torch.zeros(64, device="cuda")
    calls = 4096 + 200  # more than one table chunk
    with c.graph_capture() as gctx:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=gctx.stream):
            tpcomm.all_reduce_into(inp, separate, group=c.device_group)
            outs = [c.all_reduce(xs + k) for k in range(calls)]
    zc = tpcomm.describe(c)["custom_allreduce"]["zero_copy"]
    assert zc["table_slots"] == calls + 1 and not zc["table_full"], zc
    assert zc["registered"] == calls + 1 and zc["staged"] == 0, zc
    for i in range(3):
        buf.fill_(0)
        inp.copy_(torch.arange(4096, device="cuda", dtype=torch.float32) * (ctx.rank + 1) + i)
        xs.fill_(float(ctx.rank + i))
        graph.replay()
        torch.cuda.synchronize()
        want = torch.arange(4096, device="cuda", dtype=torch.float32) * (n * (n + 1) / 2) + n * i
        assert torch.equal(separate, want), i
        for k in (0, 4095, calls - 1):
            expect = float(sum(r + i + k for r in range(n)))
            assert torch.equal(outs[k], torch.full_like(outs[k], expect)), (i, k)
    c.destroy()


def _run(fn, n=2, env=ENV, env_per_rank=None, timeout_s=600):
    group = Group(n, env=env, env_per_rank=env_per_rank, extra_paths=[HERE], start_timeout_s=240)
    try:
        return group.run(fn, timeout_s=timeout_s)
    finally:
        group.close()


def test_first_call_inside_a_default_capture():
    _run(_first_call_inside_default_capture)


def test_ranks_with_different_launch_settings_are_refused_naming_them():
    reasons = _run(_mismatched_settings, env_per_rank={1: {"TPCOMM_CAR_BLOCKS": "8"}})
    assert reasons[0] == reasons[1]
    assert reasons[0].startswith("ranks disagree on TPCOMM_CAR_BLOCKS (rank 0: 0, rank 1: 8)"), \
        reasons[0]


def test_teardown_with_kernels_in_flight():
    _run(_teardown_with_kernels_in_flight)


def test_reset_through_the_backend_after_a_withheld_rank():
    _run(_reset_through_the_backend)


def test_overlapping_views_and_more_captures_than_a_table_chunk():
    _run(_overlapping_views_and_many_captures)
