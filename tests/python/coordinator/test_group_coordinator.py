"""tpcomm.GroupCoordinator through real process groups at world sizes 1 to 4:
every method against a closed-form or float64 single-process reference, and
against plain Gloo where Gloo has the same call."""

import re

import pytest
import torch
import torch.distributed as dist

from test_message_queue import _step_dict, assert_dicts_equal

pytestmark = pytest.mark.torch_version  # .ci/run runs these on torch 2.11 too

_cache = {}


def _coordinator(ctx, mq=False):
    """One coordinator over the whole world per worker (and one with a queue)."""
    import tpcomm

    key = ("world", mq)
    if key not in _cache:
        _cache[key] = tpcomm.GroupCoordinator([list(range(ctx.world_size))], ctx.rank,
                                              use_message_queue_broadcaster=mq,
                                              group_name="test_mq" if mq else "test",
                                              device="cpu")
    return _cache[key]


def _data(seed, rank, shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


# ----------------------------------------------------------------- attributes
def _attributes(ctx):
    import tpcomm

    n = ctx.world_size
    lists = [list(range(0, n, 2)), list(range(1, n, 2))] if n > 1 else [[0]]
    c = tpcomm.GroupCoordinator(lists, ctx.rank, group_name="parity", device="cpu")
    mine = lists[ctx.rank % 2]
    got = (c.rank, c.ranks, c.world_size, c.rank_in_group, c.local_rank, c.first_rank,
           c.last_rank, c.is_first_rank, c.is_last_rank, c.next_rank, c.prev_rank,
           c.unique_name.split(":")[0], c.mq_broadcaster, c.cpu_group is c.device_group)
    i = mine.index(ctx.rank)
    want = (ctx.rank, mine, len(mine), i, ctx.rank, mine[0], mine[-1], i == 0,
            i == len(mine) - 1, mine[(i + 1) % len(mine)], mine[(i - 1) % len(mine)], "parity",
            None, True)
    assert got == want, (got, want)
    assert dist.get_process_group_ranks(c.device_group) == mine
    c.destroy()


def test_attributes(group):
    group.run(_attributes)


# ----------------------------------------------------------------- reductions, gathers
def _all_reduce(ctx, dtype):
    c = _coordinator(ctx)
    x = _data(1, ctx.rank, (3, 17), dtype)
    before = x.clone()
    y = c.all_reduce(x)
    if ctx.world_size == 1:
        assert y is x
        return
    assert torch.equal(x, before), "all_reduce must be out of place"
    ref = x.clone()
    dist.all_reduce(ref, group=ctx.ref)
    assert torch.equal(y, ref), "differs from plain Gloo"
    exact = sum(_data(1, r, (3, 17), dtype).double() for r in range(ctx.world_size))
    tol = 1e-2 * ctx.world_size if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(y.double(), exact, atol=tol, rtol=tol)
    z = torch.ops.tpcomm.all_reduce(x, c.unique_name)  # the op directly
    assert torch.equal(z, ref)
    w = x.clone()  # the in-place op: the sum in the tensor itself
    assert torch.ops.tpcomm.all_reduce_(w, c.unique_name) is None
    assert torch.equal(w, ref)
    base = x.t().contiguous()  # a non-contiguous view: the sum in its own elements
    assert torch.ops.tpcomm.all_reduce_(base.t(), c.unique_name) is None
    assert torch.equal(base, ref.t())
    # Elements sharing memory cannot hold a sum: refused before any
    # communication, naming the op.
    with pytest.raises(ValueError, match="all_reduce_: the tensor has elements that share"):
        torch.ops.tpcomm.all_reduce_(x[:1].expand(3, 17), c.unique_name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64],
                         ids=lambda d: str(d).split(".")[1])
def test_all_reduce(group, dtype):
    group.run(_all_reduce, dtype)


def _gathers(ctx):
    c = _coordinator(ctx)
    n, shape = ctx.world_size, (2, 3, 4)
    every = [_data(2, r, shape) for r in range(n)]
    x = every[ctx.rank]
    for dim in (0, 1, 2, -1, -3):
        got = c.all_gather(x, dim)
        assert torch.equal(got, torch.cat(every, dim=dim) if n > 1 else x), dim
        for dst in range(n):
            got = c.gather(x, dst=dst, dim=dim)
            if ctx.rank == dst:
                assert torch.equal(got, torch.cat(every, dim=dim)), (dim, dst)
            else:
                assert got is None
    with pytest.raises(IndexError, match="dim 3 is out of range") if n > 1 else _nothing():
        c.all_gather(x, 3)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_all_gather_and_gather(group):
    group.run(_gathers)


def _reduce_scatters(ctx):
    c = _coordinator(ctx)
    n = ctx.world_size
    shape = (2 * n, 3 * n, n)
    x = _data(3, ctx.rank, shape)
    total = sum(_data(3, r, shape).double() for r in range(n))
    for dim in (0, 1, 2, -1):
        got = c.reduce_scatter(x, dim)
        want = total.chunk(n, dim=dim)[ctx.rank] if n > 1 else x.double()
        assert got.shape == want.shape, (dim, got.shape, want.shape)
        assert torch.allclose(got.double(), want, atol=1e-5), dim
    if n > 1:
        with pytest.raises(ValueError, match="does not divide by the group size"):
            c.reduce_scatter(torch.ones(n + 1, 2), dim=0)


def test_reduce_scatter(group):
    group.run(_reduce_scatters)


def _gathervs(ctx):
    c = _coordinator(ctx)
    n = ctx.world_size
    sizes = [(r * 3 + 1) % 4 for r in range(n)]  # uneven, a 0 at rank 1
    every = [_data(4, r, (sizes[r], 5)) for r in range(n)]
    for given in (sizes, None):
        got = c.all_gatherv(every[ctx.rank], dim=0, sizes=given)
        assert torch.equal(got, torch.cat(every)), given
    # dim 1 and a list of tensors
    cols = [_data(5, r, (2, sizes[r])) for r in range(n)]
    a, b = c.all_gatherv([cols[ctx.rank], cols[ctx.rank] * 2], dim=1, sizes=sizes)
    assert torch.equal(a, torch.cat(cols, dim=1)) and torch.equal(b, torch.cat(cols, 1) * 2)
    # reduce_scatterv: rank r keeps sizes[r] rows of the sum
    rows = sum(sizes)
    x = _data(6, ctx.rank, (rows, 3))
    total = sum(_data(6, r, (rows, 3)).double() for r in range(n))
    got = c.reduce_scatterv(x, dim=0, sizes=sizes)
    start = sum(sizes[:ctx.rank])
    want = total[start:start + sizes[ctx.rank]] if n > 1 else x.double()
    assert got.shape == want.shape and torch.allclose(got.double(), want, atol=1e-5)
    got = c.reduce_scatterv(x.t(), dim=1, sizes=sizes)
    assert torch.allclose(got.double(), want.t(), atol=1e-5)
    if n > 1:
        with pytest.raises(ValueError, match="sum to"):
            c.reduce_scatterv(x, dim=0, sizes=[rows + 1] + [0] * (n - 1))
        bad = list(sizes)
        bad[ctx.rank] += 1
        with pytest.raises(ValueError, match=r"sizes\[\d\] = "):
            c.all_gatherv(every[ctx.rank], sizes=bad)


def test_all_gatherv_and_reduce_scatterv(group):
    group.run(_gathervs)


# ----------------------------------------------------------------- broadcasts
def _broadcasts(ctx, mq):
    c = _coordinator(ctx, mq)
    n = ctx.world_size
    assert (c.mq_broadcaster is not None) == (mq and n > 1)
    for src in range(n):
        t = torch.full((4,), float(ctx.rank))
        assert c.broadcast(t, src=src) is t and torch.equal(t, torch.full((4,), float(src)))
        obj = {"from": src, "payload": list(range(src + 3))}
        assert c.broadcast_object(obj if ctx.rank == src else None, src=src) == obj
        lst = [src, "x"] if ctx.rank == src else [None, None]
        assert c.broadcast_object_list(lst, src=src) == [src, "x"]
        for step in (src, src + 10):
            want = _step_dict(step)
            want["transposed"] = torch.arange(12.0).reshape(3, 4).t() + step  # not contiguous
            got = c.broadcast_tensor_dict(want if ctx.rank == src else None, src=src)
            assert_dicts_equal(got, want)
    with pytest.raises(ValueError, match=f"src {n} is not a rank of group"):
        c.broadcast(torch.ones(1), src=n)


@pytest.mark.parametrize("mq", [False, True], ids=["cpu_group", "message_queue"])
def test_broadcasts(group, mq):
    group.run(_broadcasts, mq)


def _queues(ctx):
    c = _coordinator(ctx)
    n = ctx.world_size
    last = n - 1
    mq = c.create_mq_broadcaster(writer_rank=last)
    assert mq.is_writer == (ctx.rank == last)
    assert mq.broadcast_object(("hello", last) if mq.is_writer else None) == ("hello", last)
    want = _step_dict(3)
    assert_dicts_equal(mq.broadcast_tensor_dict(want if mq.is_writer else None), want)
    mq.shutdown()
    writer, readers = c.create_single_reader_mq_broadcasters(reader_rank_in_group=0)
    if n == 1:
        assert (writer, readers) == (None, [])
        return
    if ctx.rank == 0:
        assert writer is None and len(readers) == n - 1
        got = [r.dequeue(timeout=30) for r in readers]
        assert got == [("result", r) for r in range(1, n)], got
        dicts = [r.broadcast_tensor_dict() for r in readers]
        for r, d in zip(range(1, n), dicts):
            assert_dicts_equal(d, _step_dict(r))
    else:
        assert readers == []
        writer.enqueue(("result", ctx.rank))
        writer.broadcast_tensor_dict(_step_dict(ctx.rank))
    for q in readers + ([writer] if writer else []):
        q.shutdown()


def test_mq_broadcasters(group):
    group.run(_queues)


# ----------------------------------------------------------------- point to point
def _point_to_point(ctx):
    c = _coordinator(ctx)
    n, r = ctx.world_size, ctx.rank
    if n == 1:
        assert c.send_tensor_dict({"a": torch.ones(1)}) == {"a": torch.ones(1)}
        assert c.recv_tensor_dict() is None
        with pytest.raises(ValueError, match="is this rank itself"):
            c.send(torch.ones(1))
        return
    nxt, prv = (r + 1) % n, (r - 1) % n
    # Even ranks send first, odd ranks receive first (no deadlock at odd n:
    # Gloo's send completes into the peer's buffer without a matching recv).
    def exchange(send, recv):
        if r % 2 == 0:
            send()
            return recv()
        got = recv()
        send()
        return got

    got = exchange(lambda: c.send_object({"from": r}, dst=nxt), lambda: c.recv_object(src=prv))
    assert got == {"from": prv}
    # CPU tensors inside an object travel out of band (any dtype, views).
    def holding(k):
        return {"ids": torch.arange(6).reshape(2, 3).t() + k, "h": [torch.full((3,), k + 0.5)
                                                                    .to(torch.bfloat16)]}
    got = exchange(lambda: c.send_object(holding(r), dst=nxt), lambda: c.recv_object(src=prv))
    want = holding(prv)
    assert torch.equal(got["ids"], want["ids"]) and torch.equal(got["h"][0], want["h"][0])
    assert got["h"][0].dtype == torch.bfloat16
    got = exchange(lambda: c.send(torch.arange(5.0) + r), lambda: c.recv((5,), torch.float32))
    assert torch.equal(got, torch.arange(5.0) + prv)
    got = exchange(lambda: c.send_tensor_dict(_step_dict(r)), lambda: c.recv_tensor_dict())
    assert_dicts_equal(got, _step_dict(prv))
    c.barrier()


def test_point_to_point(group):
    group.run(_point_to_point)


# ----------------------------------------------------------------- world size 1
def _identity_at_one(ctx):
    import tpcomm

    c = tpcomm.GroupCoordinator([[r] for r in range(ctx.world_size)], ctx.rank,
                                use_message_queue_broadcaster=True, group_name="single",
                                device="cpu")
    x = torch.randn(4, 6)
    logits = torch.randn(4, 8)
    d = {"x": x}
    assert c.world_size == 1 and c.mq_broadcaster is None
    outs = [c.all_reduce(x), c.all_gather(x, 1), c.reduce_scatter(x, 1), c.all_gatherv(x),
            c.reduce_scatterv(x), c.gather(x), c.broadcast(x), c.combine(x)]
    assert all(o is x for o in outs)
    assert c.broadcast_tensor_dict(d) is d and c.broadcast_object(d) is d
    h, lg = c.dispatch(x, logits)
    assert h is x and lg is logits
    c.destroy()


def test_world_size_one_returns_inputs(group):
    group.run(_identity_at_one)


# ----------------------------------------------------------------- custom op, compile
def _compiled(ctx):
    c = _coordinator(ctx)
    name = c.unique_name

    def step(x):
        h = torch.ops.tpcomm.all_reduce(x * 2, name)
        return c.all_gather(c.all_reduce(h + 1), 0) - 1

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x = _data(7, ctx.rank, (5, 3))
    assert torch.equal(compiled(x), step(x))

    def in_place(x):  # the in-place op on a graph input: mutated as in eager
        torch.ops.tpcomm.all_reduce_(x, name)
        return x + 1

    mine, theirs = x.clone(), x.clone()
    got = torch.compile(in_place, fullgraph=True, backend="aot_eager")(mine)
    assert torch.equal(got, in_place(theirs)) and torch.equal(mine, theirs)
    n = ctx.world_size
    s = sum(_data(7, r, (5, 3)).double() * 2 for r in range(n))
    want = (n * (s + 1) if n > 1 else s + 1).repeat(n, 1) - 1
    assert torch.allclose(compiled(x).double(), want, atol=1e-4)


def test_compile_fullgraph_through_custom_op(group):
    group.run(_compiled)


def _inductor(ctx):
    c = _coordinator(ctx)

    def step(x):
        return c.all_gather(c.all_reduce(torch.relu(x) * 2) + 1, 0)

    x = _data(11, ctx.rank, (4, 3))
    got = torch.compile(step, fullgraph=True)(x)  # the default backend: inductor
    assert torch.equal(got, step(x))

    def in_place(x):  # the in-place op on the graph's own buffer, as vLLM's layers call it
        h = torch.relu(x) * 2
        torch.ops.tpcomm.all_reduce_(h, c.unique_name)
        return h + 1

    from torch._inductor.utils import run_and_get_code

    got, (code, *_) = run_and_get_code(torch.compile(in_place, fullgraph=True), x)
    want = sum(torch.relu(_data(11, r, (4, 3)).double()) * 2 for r in range(ctx.world_size)) + 1
    assert torch.equal(got, in_place(x)) and torch.allclose(got.double(), want, atol=1e-5)
    # Called in place on the buffer the fused relu kernel wrote from the
    # input, not on a copy of it.
    lines = [line.strip() for line in code.splitlines()]
    call = next(i for i, line in enumerate(lines) if "tpcomm.all_reduce_.default(" in line)
    buf = re.search(r"all_reduce_\.default\((\w+)", lines[call]).group(1)
    assert any("arg0_1" in line and re.search(rf"\b{buf}\b", line) for line in lines[:call]), \
        "\n".join(lines)


def test_compile_with_inductor(groups):
    # Inductor compiles C++ on CPU (about 20 s); one world size is enough.
    groups(2).run(_inductor, timeout_s=300)


def test_custom_op_names_unknown_group():
    import tpcomm  # noqa: F401

    with pytest.raises(ValueError, match="no live tpcomm GroupCoordinator named 'nope:0'"):
        torch.ops.tpcomm.all_reduce(torch.ones(2), "nope:0")


# ----------------------------------------------------------------- expert parallel
def _moe_reference(hidden, logits, experts, top_k):
    """Per token: sum over its top-k experts of softmax weight x expert(x)."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    weights = logits.double().softmax(-1)
    ids = logits.topk(top_k, dim=-1).indices
    for t in range(hidden.shape[0]):
        for e in ids[t].tolist():
            out[t] += weights[t, e] * (hidden[t].double() @ experts[e].double())
    return out


def _local_experts(hidden, logits, experts, rank, world_size, top_k):
    """What an expert-parallel rank computes for the tokens it received."""
    per_rank = experts.shape[0] // world_size
    mine = range(rank * per_rank, (rank + 1) * per_rank)
    weights = logits.float().softmax(-1)
    ids = logits.topk(top_k, dim=-1).indices
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(hidden.shape[0]):
        for e in ids[t].tolist():
            if e in mine:
                out[t] += weights[t, e] * (hidden[t].float() @ experts[e].float())
    return out.to(hidden.dtype)


def _dispatch_combine(ctx, top_k, dtype):
    c = _coordinator(ctx)
    n, hidden_dim, num_experts = ctx.world_size, 8, 4 * ctx.world_size
    experts = _data(8, 99, (num_experts, hidden_dim, hidden_dim)) / hidden_dim
    tokens = 3 + 2 * ctx.rank  # uneven token counts per rank
    hidden = _data(9, ctx.rank, (tokens, hidden_dim), dtype)
    logits = _data(10, ctx.rank, (tokens, num_experts))
    ids = torch.arange(tokens) + 100 * ctx.rank
    recv_h, recv_l, (recv_ids,) = c.dispatch(hidden, logits, extra_tensors=[ids],
                                             top_k=top_k if top_k else None)
    k = top_k or num_experts
    # Every received token owns one of this rank's experts among its top-k.
    per_rank = num_experts // n
    owners = recv_l.topk(k, dim=-1).indices // per_rank
    assert bool((owners == ctx.rank).any(-1).all()) if n > 1 else True
    senders = recv_ids // 100
    assert bool((senders[1:] >= senders[:-1]).all()), "rows must come by source rank"
    out = c.combine(_local_experts(recv_h, recv_l, experts, ctx.rank, n, k))
    want = _moe_reference(hidden, logits, experts, k)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    assert out.dtype == dtype and out.shape == hidden.shape
    assert torch.allclose(out.double(), want, atol=tol, rtol=tol), (out, want)
    if n > 1:
        with pytest.raises(RuntimeError, match="without a dispatch"):
            c.combine(recv_h)
        with pytest.raises(ValueError, match="first dim must be the"):
            c.dispatch(hidden[:1], logits)
    return recv_h.shape[0]


@pytest.mark.parametrize("top_k,dtype", [(2, torch.float32), (1, torch.bfloat16),
                                         (0, torch.float32)], ids=["top2", "top1_bf16", "dense"])
def test_dispatch_combine_against_single_process_moe(group, top_k, dtype):
    received = group.run(_dispatch_combine, top_k, dtype)
    if top_k == 0:  # dense: every rank gets every token
        n = group.world_size
        assert received == [sum(3 + 2 * r for r in range(n))] * n


# ----------------------------------------------------------------- misc
def _buffers_and_stats(ctx):
    import tpcomm

    c = _coordinator(ctx)
    model = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 96),
                                torch.nn.Linear(96, 16))
    assert c.prepare_communication_buffer_for_model(model, max_tokens=10) == 96 * 10 * 4
    model.max_num_tokens = 3
    assert c.prepare_communication_buffer_for_model(model.half()) == 96 * 3 * 2
    tpcomm.reset_stats(c)
    c.all_reduce(torch.ones(10))
    c.barrier()
    s = tpcomm.stats(c)
    assert set(s) == {"gloo", "cpu_shm", "cpu_hier", "custom_oneshot", "custom_twoshot", "nccl"}
    assert s["nccl"] == {"calls": 0, "bytes": 0}
    # The all_reduce (and the barrier, on a tpcomm CPU group) take the
    # shared-memory path on one host.
    cpu = {k: s["gloo"][k] + s["cpu_shm"][k] for k in ("calls", "bytes")}
    want = {"calls": 2, "bytes": 40} if ctx.world_size > 1 else {"calls": 1, "bytes": 0}
    assert cpu == want, s


def test_communication_buffer_size_and_stats(group):
    group.run(_buffers_and_stats)


def _bad_arguments(ctx):
    import tpcomm

    n = ctx.world_size
    with pytest.raises(ValueError, match=f"{n} is not a rank of a world of {n}"):
        tpcomm.GroupCoordinator([list(range(n + 1))], ctx.rank, device="cpu")
    with pytest.raises(ValueError, match="appears in more than one place"):
        tpcomm.GroupCoordinator([[0], [0]], ctx.rank, device="cpu")
    with pytest.raises(ValueError, match="external_writer_handle is not supported"):
        _coordinator(ctx).create_mq_broadcaster(external_writer_handle=object())
    c = _coordinator(ctx)
    x = torch.ones(2, 3)
    with pytest.raises(ValueError, match=f"dst {n} is not a rank of group {c.unique_name}"):
        c.gather(x, dst=n)
    if n == 1:
        return
    with pytest.raises(ValueError, match=f"dst {ctx.rank} is this rank itself"):
        c.send_object(1, dst=ctx.rank)
    with pytest.raises(ValueError, match=r"router_logits must be \[tokens, experts\]"):
        c.dispatch(x, torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="experts do not divide over"):
        c.dispatch(x, torch.ones(2, 2 * n + 1))
    with pytest.raises(ValueError, match=r"top_k 99 must be an integer in 1\.\.%d" % (2 * n)):
        c.dispatch(x, torch.ones(2, 2 * n), top_k=99)
    # A combine with the wrong row count is refused and the dispatch stays pending.
    h, _ = c.dispatch(x, torch.ones(2, 2 * n))
    with pytest.raises(ValueError, match=f"expected {h.shape[0]} rows"):
        c.combine(h[1:])
    assert torch.equal(c.combine(h), x * n)


def test_bad_arguments(group):
    group.run(_bad_arguments)


# ------------------------------------------------------ the ops' CPU kernels
def _ops_go_straight_to_the_engine(ctx):
    """CPU calls of the coordinator's ops run their C++ kernels: right with
    torch.distributed's Python collectives out of the way, other Python
    threads running while a call waits for a late peer, and on a coordinator
    over Gloo too."""
    import threading
    import time

    import tpcomm

    n, r = ctx.world_size, ctx.rank
    c = _coordinator(ctx)
    x = _data(11, r, (6, 4 * n))
    every = [_data(11, k, (6, 4 * n)) for k in range(n)]
    saved = {name: getattr(dist, name) for name in
             ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")}

    def refuse(*args, **kwargs):
        raise AssertionError("a CPU op went through torch.distributed's Python API")

    try:
        for name in saved:
            setattr(dist, name, refuse)
        total = torch.stack(every).sum(0)
        torch.testing.assert_close(c.all_reduce(x), total.to(x.dtype), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(c.all_gather(x, dim=1), torch.cat(every, 1))
        torch.testing.assert_close(c.reduce_scatter(x, dim=1), total.chunk(n, 1)[r].contiguous(),
                                   rtol=1e-6, atol=1e-6)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    # A peer 0.5 s late: this rank's Python threads go on meanwhile.
    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.005)

    if n > 1:
        if r == n - 1:
            time.sleep(0.5)
        thread = threading.Thread(target=tick)
        thread.start()
        c.all_reduce(x)
        stop.set()
        thread.join()
        if r == 0:
            assert len(ticks) > 20, len(ticks)
    # Over Gloo: the same results through its ProcessGroup.
    g = tpcomm.GroupCoordinator([list(range(n))], r, torch_distributed_backend="gloo",
                                group_name="ops_gloo", device="cpu")
    if n > 1:
        torch.testing.assert_close(g.all_reduce(x), c.all_reduce(x))
        torch.testing.assert_close(g.all_gather(x, dim=0), c.all_gather(x, dim=0))
        # The in-place op on the Gloo group: the sum in the tensor itself.
        w = x.clone()
        torch.ops.tpcomm.all_reduce_(w, g.unique_name)
        torch.testing.assert_close(w, c.all_reduce(x))
    g.destroy()
    return torch._C._dispatch_has_kernel_for_dispatch_key("tpcomm::all_reduce", "CPU")


def test_the_ops_cpu_kernels_go_straight_to_the_engine(group):
    assert all(group.run(_ops_go_straight_to_the_engine))


def test_the_ops_cpu_kernels_on_the_shared_memory_path(shm_groups):
    assert all(shm_groups(3).run(_ops_go_straight_to_the_engine))
