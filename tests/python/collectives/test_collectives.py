"""Every torch.distributed collective on CPU tensors through backend "tpcomm",
against plain Gloo on the same ranks (or a float64 closed form where Gloo has
no such op), at world sizes 1 to 4."""

import pytest
import torch
import torch.distributed as dist

from harness import Group, error_message

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64]
R = dist.ReduceOp


def make(rank, n, dtype, salt=0):
    """A deterministic per-rank input with distinct values on every rank."""
    g = torch.Generator().manual_seed(1000 * rank + 17 * n + salt)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    return torch.randint(-50, 50, (n,), generator=g, dtype=torch.int64).to(dtype)


def all_inputs(ctx, n, dtype, salt=0):
    return [make(r, n, dtype, salt) for r in range(ctx.world_size)]


# conftest's world sizes, two ranks of each marked torch_version: every
# collective once on the other torch of .ci/run.
@pytest.fixture(params=[1, pytest.param(2, marks=pytest.mark.torch_version), 3, 4],
                ids=lambda n: f"ws{n}")
def group(request, groups):
    return groups(request.param)


def assert_same(actual, expected, what):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} vs {expected.dtype}"
    assert torch.equal(actual, expected), f"{what}: {actual} != {expected}"


# ---------------------------------------------------------------- all_reduce
def _all_reduce_vs_gloo(ctx):
    checked = 0
    for dtype in DTYPES:
        ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX]
        if not dtype.is_floating_point:
            ops += [R.BAND, R.BOR, R.BXOR]
        for op in ops:
            for n in [0, 1, 5, 1000]:
                x = make(ctx.rank, n, dtype)
                ref = x.clone()
                dist.all_reduce(x, op=op)
                dist.all_reduce(ref, op=op, group=ctx.ref)
                assert_same(x, ref, f"all_reduce {op} {dtype} n={n}")
                checked += 1
    return checked


def test_all_reduce_matches_gloo(group):
    assert group.run(_all_reduce_vs_gloo) == [6 * 4 * 4 + 2 * 3 * 4] * group.world_size


def _all_reduce_avg_and_premul(ctx):
    for dtype in DTYPES:
        for n in [0, 3, 64]:
            inputs = all_inputs(ctx, n, dtype)
            total = torch.stack([t.double() for t in inputs]).sum(0)
            x = inputs[ctx.rank].clone()
            dist.all_reduce(x, op=R.AVG)
            if dtype.is_floating_point:
                tol = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-6
                torch.testing.assert_close(x.double(), total / ctx.world_size, atol=tol, rtol=tol)
                for factor in [0.5, torch.tensor([0.25], dtype=dtype)]:
                    y = inputs[ctx.rank].clone()
                    dist.all_reduce(y, op=dist._make_nccl_premul_sum(factor))
                    f = float(factor) if isinstance(factor, float) else float(factor.item())
                    torch.testing.assert_close(y.double(), total * f, atol=tol, rtol=tol)
            else:  # integers: truncating division, as NCCL's ncclAvg
                assert_same(x, torch.div(total.long(), ctx.world_size, rounding_mode="trunc")
                            .to(dtype), f"all_reduce AVG {dtype}")
    return True


def test_all_reduce_avg_and_premul_sum_closed_form(group):
    assert all(group.run(_all_reduce_avg_and_premul))


def _all_reduce_coalesced(ctx):
    xs = [make(ctx.rank, n, torch.float32, salt=3) for n in (1, 7, 100)]
    refs = [x.clone() for x in xs]
    dist.all_reduce_coalesced(xs)
    dist.all_reduce_coalesced(refs, group=ctx.ref)
    for x, ref in zip(xs, refs):
        assert_same(x, ref, "all_reduce_coalesced")
    return len(xs)


def test_all_reduce_coalesced_matches_gloo(group):
    assert group.run(_all_reduce_coalesced) == [3] * group.world_size


# ---------------------------------------------------------------- gathers
def _all_gathers(ctx):
    for dtype in DTYPES:
        for n in [0, 1, 9]:
            x = make(ctx.rank, n, dtype)
            expected = all_inputs(ctx, n, dtype)
            out = [torch.empty_like(x) for _ in range(ctx.world_size)]
            dist.all_gather(out, x)
            for r in range(ctx.world_size):
                assert_same(out[r], expected[r], f"all_gather from {r}")
            flat = torch.empty(n * ctx.world_size, dtype=dtype)
            dist.all_gather_into_tensor(flat, x)
            assert_same(flat, torch.cat(expected), "all_gather_into_tensor")
    objs = [None] * ctx.world_size
    dist.all_gather_object(objs, {"rank": ctx.rank, "tag": "x" * ctx.rank})
    assert objs == [{"rank": r, "tag": "x" * r} for r in range(ctx.world_size)], objs
    return True


def test_all_gather_variants(group):
    assert all(group.run(_all_gathers))


def _gather_scatter(ctx):
    for dtype in [torch.float32, torch.int64, torch.bfloat16]:
        for root in range(ctx.world_size):
            x = make(ctx.rank, 6, dtype)
            gl = [torch.empty_like(x) for _ in range(ctx.world_size)] if ctx.rank == root else None
            dist.gather(x, gl, dst=root)
            if ctx.rank == root:
                for r, t in enumerate(all_inputs(ctx, 6, dtype)):
                    assert_same(gl[r], t, f"gather to {root} from {r}")
            out = torch.empty(6, dtype=dtype)
            sl = all_inputs(ctx, 6, dtype, salt=root) if ctx.rank == root else None
            dist.scatter(out, sl, src=root)
            assert_same(out, make(ctx.rank, 6, dtype, salt=root), f"scatter from {root}")
    return True


def test_gather_and_scatter_from_every_root(group):
    assert all(group.run(_gather_scatter))


# ---------------------------------------------------------------- reduce_scatter
def _reduce_scatters(ctx):
    w = ctx.world_size
    for dtype in [torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16]:
        for op in [R.SUM, R.MIN, R.MAX, R.PRODUCT]:
            chunk = 5
            full = make(ctx.rank, chunk * w, dtype)
            out, ref = torch.empty(chunk, dtype=dtype), torch.empty(chunk, dtype=dtype)
            dist.reduce_scatter_tensor(out, full, op=op)
            dist.reduce_scatter_tensor(ref, full.clone(), op=op, group=ctx.ref)
            assert_same(out, ref, f"reduce_scatter_tensor {op} {dtype}")
            pieces = list(full.chunk(w))
            out2, ref2 = torch.empty(chunk, dtype=dtype), torch.empty(chunk, dtype=dtype)
            dist.reduce_scatter(out2, [p.clone() for p in pieces], op=op)
            dist.reduce_scatter(ref2, [p.clone() for p in pieces], op=op, group=ctx.ref)
            assert_same(out2, ref2, f"reduce_scatter {op} {dtype}")
    # AVG (Gloo has none): against float64.
    full = make(ctx.rank, 4 * w, torch.float64)
    total = torch.stack([make(r, 4 * w, torch.float64) for r in range(w)]).sum(0)
    out = torch.empty(4, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, full.clone(), op=R.AVG)
    torch.testing.assert_close(out, (total / w).chunk(w)[ctx.rank])
    out = torch.empty(4, dtype=torch.float64)
    before = full.clone()
    dist.reduce_scatter_tensor(out, full, op=dist._make_nccl_premul_sum(3.0))
    torch.testing.assert_close(out, (total * 3.0).chunk(w)[ctx.rank])
    assert_same(full, before, "reduce_scatter PREMUL_SUM must not modify its input")
    return True


def test_reduce_scatter_variants(group):
    assert all(group.run(_reduce_scatters))


# ---------------------------------------------------------------- broadcast, reduce
def _broadcast_reduce(ctx):
    for root in range(ctx.world_size):
        for dtype in DTYPES:
            x = make(ctx.rank, 11, dtype)
            dist.broadcast(x, src=root)
            assert_same(x, make(root, 11, dtype), f"broadcast from {root}")
            y = make(ctx.rank, 11, dtype)
            ref = y.clone()
            dist.reduce(y, dst=root, op=R.SUM)
            dist.reduce(ref, dst=root, op=R.SUM, group=ctx.ref)
            if ctx.rank == root:
                assert_same(y, ref, f"reduce to {root} {dtype}")
        objs = [f"from {ctx.rank}", {"n": ctx.rank}] if ctx.rank == root else [None, None]
        dist.broadcast_object_list(objs, src=root)
        assert objs == [f"from {root}", {"n": root}], objs
        z = make(ctx.rank, 3, torch.float64)
        orig = z.clone()
        dist.reduce(z, dst=root, op=R.AVG)
        if ctx.rank == root:
            total = sum(make(r, 3, torch.float64) for r in range(ctx.world_size))
            torch.testing.assert_close(z, total / ctx.world_size)
        else:
            assert_same(z, orig, "reduce AVG must leave non-root tensors alone")
    return True


def test_broadcast_and_reduce_from_every_root(group):
    assert all(group.run(_broadcast_reduce))


# ---------------------------------------------------------------- all_to_all
def _all_to_all(ctx):
    w, r = ctx.world_size, ctx.rank
    # Uneven: rank r sends (r + d + 1) rows of value 100 r + d to rank d.
    in_splits = [r + d + 1 for d in range(w)]
    out_splits = [s + r + 1 for s in range(w)]
    inp = torch.cat([torch.full((n, 3), 100.0 * r + d) for d, n in enumerate(in_splits)])
    out = torch.empty(sum(out_splits), 3)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    ref = torch.empty_like(out)
    dist.all_to_all_single(ref, inp, out_splits, in_splits, group=ctx.ref)
    assert_same(out, ref, "all_to_all_single uneven")
    expected = torch.cat([torch.full((n, 3), 100.0 * s + r) for s, n in enumerate(out_splits)])
    assert_same(out, expected, "all_to_all_single closed form")
    # Even split, no sizes given.
    even = torch.arange(4 * w, dtype=torch.int64) + 1000 * r
    got = torch.empty_like(even)
    dist.all_to_all_single(got, even)
    assert_same(got, torch.cat([torch.arange(4 * r, 4 * r + 4) + 1000 * s for s in range(w)]),
                "all_to_all_single even")
    # List form with different sizes per peer (Gloo has no list all_to_all).
    ins = [torch.full((r + d + 1,), float(10 * r + d)) for d in range(w)]
    outs = [torch.empty(s + r + 1) for s in range(w)]
    dist.all_to_all(outs, ins)
    for s in range(w):
        assert_same(outs[s], torch.full((s + r + 1,), float(10 * s + r)), f"all_to_all from {s}")
    return True


def test_all_to_all_uneven(group):
    assert all(group.run(_all_to_all))


# ---------------------------------------------------------------- point to point
def _point_to_point(ctx):
    w, r = ctx.world_size, ctx.rank
    nxt, prv = (r + 1) % w, (r - 1) % w
    if w == 1:
        return True
    # Blocking ring, ordered to avoid deadlock.
    got = torch.empty(4)
    if r % 2 == 0:
        dist.send(torch.full((4,), float(r)), dst=nxt)
        dist.recv(got, src=prv)
    else:
        dist.recv(got, src=prv)
        dist.send(torch.full((4,), float(r)), dst=nxt)
    assert_same(got, torch.full((4,), float(prv)), "send/recv ring")
    # Non-blocking.
    got = torch.empty(5, dtype=torch.int64)
    reqs = [dist.isend(torch.full((5,), r, dtype=torch.int64), dst=nxt),
            dist.irecv(got, src=prv)]
    for q in reqs:
        q.wait()
        assert q.is_completed()
    assert_same(got, torch.full((5,), prv, dtype=torch.int64), "isend/irecv")
    # batch_isend_irecv, both directions at once.
    a, b = torch.empty(3), torch.empty(3)
    ops = [dist.P2POp(dist.isend, torch.full((3,), r + 0.5), nxt),
           dist.P2POp(dist.isend, torch.full((3,), r + 0.25), prv),
           dist.P2POp(dist.irecv, a, prv),
           dist.P2POp(dist.irecv, b, nxt)]
    for q in dist.batch_isend_irecv(ops):
        q.wait()
    assert_same(a, torch.full((3,), prv + 0.5), "batch from prev")
    assert_same(b, torch.full((3,), nxt + 0.25), "batch from next")
    # Receive from any source: rank 0 collects one message from each other rank.
    if r == 0:
        seen = set()
        for _ in range(w - 1):
            t = torch.empty(1, dtype=torch.int64)
            src = dist.recv(t)
            assert int(t) == src, (int(t), src)
            seen.add(src)
        assert seen == set(range(1, w)), seen
    else:
        dist.send(torch.tensor([r]), dst=0)
    return True


def test_point_to_point(group):
    assert all(group.run(_point_to_point))


# ---------------------------------------------------------------- barriers, async, groups
def _barriers(ctx):
    import time
    from datetime import timedelta
    for _ in range(3):
        dist.barrier()
    dist.monitored_barrier(timeout=timedelta(seconds=30))
    dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)
    # A barrier really waits: the last rank sleeps, nobody leaves before it arrives.
    start = time.monotonic()
    if ctx.rank == ctx.world_size - 1:
        time.sleep(0.3)
    dist.barrier()
    return time.monotonic() - start


def test_barrier_and_monitored_barrier(group):
    waited = group.run(_barriers)
    assert all(t >= 0.25 for t in waited), waited


def _async_ops(ctx):
    x = make(ctx.rank, 8, torch.float32)
    ref = x.clone()
    dist.all_reduce(ref, group=ctx.ref)
    work = dist.all_reduce(x, async_op=True)
    fut = work.get_future()
    value = fut.wait()
    assert isinstance(value, list) and len(value) == 1, value
    assert_same(value[0], ref, "future value")
    assert work.is_completed()
    assert work.wait()
    assert_same(x, ref, "async all_reduce")
    # AVG composes a division: the future must see the divided result.
    y = torch.full((4,), float(ctx.rank))
    fut = dist.all_reduce(y, op=R.AVG, async_op=True).get_future()
    out = fut.then(lambda f: f.value()[0] * 2).wait()
    torch.testing.assert_close(out, torch.full((4,), (ctx.world_size - 1.0)))
    # Gloo's reduce-scatter and point-to-point works have no future of their
    # own; tpcomm's still complete, after the division of AVG.
    w = ctx.world_size
    out = torch.empty(2)
    work = dist.reduce_scatter_tensor(out, torch.full((2 * w,), 3.0), op=R.AVG, async_op=True)
    got = work.get_future().wait()
    torch.testing.assert_close(got[0], torch.full((2,), 3.0))
    assert work.is_completed()
    work.wait()
    if w > 1:
        nxt, prv = (ctx.rank + 1) % w, (ctx.rank - 1) % w
        buf = torch.empty(3)
        recv = dist.irecv(buf, src=prv)
        send = dist.isend(torch.full((3,), float(ctx.rank)), dst=nxt)
        recv_value = recv.get_future().wait()
        send.get_future().wait()
        assert_same(recv_value[0], torch.full((3,), float(prv)), "irecv future value")
    works = [dist.broadcast(torch.zeros(2), src=0, async_op=True) for _ in range(4)]
    for w in works:
        w.wait()
    return True


def test_async_work_wait_is_completed_and_future(group):
    assert all(group.run(_async_ops))


def _subgroups(ctx):
    w, r = ctx.world_size, ctx.rank
    evens = list(range(0, w, 2))
    odds = list(range(1, w, 2))
    g_even = dist.new_group(evens)
    g_odd = dist.new_group(odds) if odds else None
    mine, members = (g_even, evens) if r % 2 == 0 else (g_odd, odds)
    x = torch.tensor([float(r)])
    dist.all_reduce(x, group=mine)
    assert float(x) == float(sum(members)), (float(x), members)
    assert dist.get_backend(mine) == "tpcomm"
    # ProcessGroup.split_group: the C++ split path, through our backend's split().
    world = dist.group.WORLD
    sub = world.split_group(members, group_name=f"split_{'even' if r % 2 == 0 else 'odd'}_{w}")
    y = torch.tensor([float(r + 1)])
    work = sub.allreduce(y)
    work.wait()
    assert float(y) == float(sum(m + 1 for m in members)), (float(y), members)
    be = sub._get_backend(torch.device("cpu"))
    assert type(be).__name__ == "ProcessGroupTpcomm", type(be)
    assert be is sub._get_backend(torch.device("cuda")), "one split backend for cpu and cuda"
    return True


def test_new_group_and_split(group):
    assert all(group.run(_subgroups))


def _split_group_api(ctx):
    # torch's dist.split_group insists on a bound accelerator device even for
    # CPU collectives; bind a nominal one for the call, then run CPU traffic.
    w, r = ctx.world_size, ctx.rank
    default = dist.group.WORLD
    saved = default.bound_device_id
    default.bound_device_id = torch.device("cuda", 0)
    try:
        halves = [list(range(0, (w + 1) // 2)), list(range((w + 1) // 2, w))]
        halves = [h for h in halves if h]
        try:
            sub = dist.split_group(split_ranks=halves)
        except RuntimeError as error:
            # torch 2.12-2.14's split_group asks for an accelerator before it
            # looks at the group's backends: without one it refuses every
            # backend alike, which the caller checks against Gloo's refusal.
            if torch.accelerator.is_available():
                raise
            return str(error), error_message(
                lambda: dist.split_group(parent_pg=ctx.ref, split_ranks=halves))
    finally:
        default.bound_device_id = saved
    mine = next(h for h in halves if r in h)
    x = torch.tensor([1.0])
    dist.all_reduce(x, group=sub)
    assert float(x) == len(mine)
    assert dist.get_process_group_ranks(sub) == mine
    return True


def test_dist_split_group(group):
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    for rank, result in enumerate(group.run(_split_group_api)):
        if result is True:
            continue
        # Refused by torch itself: only where its split_group needs an
        # accelerator, and exactly as it refuses a Gloo group.
        ours, gloo = result
        assert (2, 12) <= version <= (2, 14) and not torch.accelerator.is_available(), (rank, ours)
        assert gloo == f"RuntimeError: {ours}", (rank, ours, gloo)


def _functional(ctx):
    import torch.distributed._functional_collectives as funcol
    w, r = ctx.world_size, ctx.rank
    group = dist.group.WORLD
    x = make(r, 12 * w, torch.float32)
    ref = x.clone()
    dist.all_reduce(ref, group=ctx.ref)
    assert_same(funcol.all_reduce(x, "sum", group).wait(), ref, "funcol.all_reduce")
    gathered = funcol.all_gather_tensor(x, 0, group)
    expected = torch.cat(all_inputs(ctx, 12 * w, torch.float32))
    assert_same(gathered, expected, "funcol.all_gather_tensor")
    rs = funcol.reduce_scatter_tensor(x, "sum", 0, group)
    assert_same(rs, ref.chunk(w)[r], "funcol.reduce_scatter_tensor")
    a2a = funcol.all_to_all_single(x, None, None, group)
    ref_a2a = torch.empty_like(x)
    dist.all_to_all_single(ref_a2a, x, group=ctx.ref)
    assert_same(a2a, ref_a2a, "funcol.all_to_all_single")
    # The coalesced entry points torch.compile uses.
    outs = funcol.all_gather_into_tensor_coalesced([x, x * 2], group)
    assert_same(outs[1], expected * 2, "all_gather_into_tensor_coalesced")
    outs = funcol.reduce_scatter_tensor_coalesced([x, x * 2], "sum", [0, 0], group)
    torch.testing.assert_close(outs[1], ref.chunk(w)[r] * 2)
    outs = funcol.all_reduce_coalesced([x, x + 1], "sum", group)
    refs = [x.clone(), x + 1]
    dist.all_reduce_coalesced(refs, group=ctx.ref)
    assert_same(outs[0].wait(), refs[0], "funcol.all_reduce_coalesced")
    assert_same(outs[1].wait(), refs[1], "funcol.all_reduce_coalesced")

    @torch.compile(fullgraph=True, backend="eager")
    def compiled(t):
        return funcol.all_reduce(t * 2, "sum", group) + 1

    assert_same(compiled(x), ref * 2 + 1, "compiled functional all_reduce")
    return True


def test_functional_collectives(group):
    assert all(group.run(_functional))


def _cpu_job_never_touches_device(ctx):
    x = torch.ones(4)
    dist.all_reduce(x)
    dist.all_gather_into_tensor(torch.empty(4 * ctx.world_size), x)
    objs = [None] * ctx.world_size
    dist.all_gather_object(objs, ctx.rank)
    dist.barrier()
    be = dist.group.WORLD._get_backend(torch.device("cpu"))
    return be.device_backend_created, torch.cuda.is_initialized()


@pytest.mark.torch_version
def test_cpu_only_job_never_creates_nccl_nor_initialises_cuda():
    # A fresh group: other tests in the shared ones touch CUDA on purpose.
    group = Group(2)
    try:
        assert group.run(_cpu_job_never_touches_device) == [(False, False)] * 2
    finally:
        group.close()
