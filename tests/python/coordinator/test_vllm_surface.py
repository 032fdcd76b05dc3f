"""What vLLM 0.33 added to GroupCoordinator and parallel_state, through real
process groups at world sizes 1 to 4, against closed-form references: the
asynchronous pipeline sends (paired every way with the blocking ones), the
new dispatch(hidden_states, topk_weights, topk_ids) and dispatch_router_logits
against a single-process mixture of experts in float64, the *_into_output
forms, cpu_all_reduce_, sibling groups, the context-parallel layout, and the
node and rank queries."""

import pytest
import torch
import torch.distributed as dist

from test_group_coordinator import _coordinator, _data, _moe_reference
from test_message_queue import _step_dict, assert_dicts_equal


# ----------------------------------------------------------------- async sends
def _async_pipeline(ctx):
    c = _coordinator(ctx)
    n, r = ctx.world_size, ctx.rank
    if n == 1:
        assert c.isend_tensor_dict(_step_dict(0)) == []
        assert c.irecv_tensor_dict() == (None, [], [])
        return
    nxt, prv = (r + 1) % n, (r - 1) % n
    # Posted sends do not wait for the receiver: every rank sends first.
    h = c.isend_object({"from": r, "t": torch.arange(3) + r}, dst=nxt)
    got = c.recv_object(src=prv)
    h.wait()
    h.wait()  # a second wait does nothing
    assert h.is_completed()
    assert got["from"] == prv and torch.equal(got["t"], torch.arange(3) + prv)

    # isend_tensor_dict -> recv_tensor_dict; handles dropped (the group keeps them).
    c.isend_tensor_dict(_step_dict(r), dst=nxt)
    assert_dicts_equal(c.recv_tensor_dict(src=prv), _step_dict(prv))

    # isend_tensor_dict -> irecv_tensor_dict, handles waited by both.
    handles = c.isend_tensor_dict(_step_dict(r + 10))
    got, recv_handles, post = c.irecv_tensor_dict()
    for w in recv_handles + handles:
        w.wait()
    assert post == []
    assert_dicts_equal(got, _step_dict(prv + 10))

    # send_tensor_dict -> irecv_tensor_dict (ranks alternate so that the
    # blocking sends have a receiver).
    if r % 2 == 0 or (n % 2 and r == n - 1):
        c.send_tensor_dict(_step_dict(r + 20), dst=nxt)
        got, recv_handles, _ = c.irecv_tensor_dict(src=prv)
    else:
        got, recv_handles, _ = c.irecv_tensor_dict(src=prv)
        c.send_tensor_dict(_step_dict(r + 20), dst=nxt)
    for w in recv_handles:
        w.wait()
    assert_dicts_equal(got, _step_dict(prv + 20))
    # Many sends in flight, reaped as they complete; the values they read
    # are kept alive though the caller drops every reference.
    for k in range(5):
        c.isend_tensor_dict({"k": torch.full((64,), float(k + r))}, dst=nxt)
    for k in range(5):
        assert torch.equal(c.recv_tensor_dict(src=prv)["k"], torch.full((64,), float(k + prv)))
    c.barrier()
    # Every kept send was received: waiting for each returns, and reaping
    # then drops them all.
    for handles in list(c._pending_isends):
        for w in handles:
            w.wait()
    c._reap_isends()
    assert len(c._pending_isends) == 0
    with pytest.raises(ValueError, match="is this rank itself"):
        c.isend_object(1, dst=c.rank_in_group)


def test_async_pipeline_sends(group):
    group.run(_async_pipeline)


def _sliced_async(ctx):
    """TP=2 x PP=2: isend_tensor_dict with all_gather_group sends 1/TP slices;
    irecv_tensor_dict's postprocess all-gathers them."""
    import tpcomm

    tpcomm.initialize_model_parallel(2, 2, device="cpu")
    try:
        tp, pp = tpcomm.get_tp_group(), tpcomm.get_pp_group()
        g = torch.Generator().manual_seed(3)
        d = {"hidden_states": torch.randn(6, 8, generator=g), "odd": torch.arange(7), "n": 2}
        if pp.is_first_rank:
            handles = pp.isend_tensor_dict(d, all_gather_group=tp)
            for w in handles:
                w.wait()
            assert handles[1]._retained == ()
        else:
            got, handles, post = pp.irecv_tensor_dict(all_gather_group=tp)
            assert got["hidden_states"].numel() == 24  # this rank's slice until postprocess
            for w in handles:
                w.wait()
            for fn in post:
                fn()
            assert len(post) == 1
            assert_dicts_equal(got, d)
    finally:
        tpcomm.destroy_model_parallel()


def test_async_pipeline_sends_with_all_gather_group(groups):
    groups(4).run(_sliced_async)


def _dropped_isends_on_gloo(ctx):
    import tpcomm

    c = tpcomm.GroupCoordinator([[0, 1]], ctx.rank, torch_distributed_backend="gloo",
                                group_name="gloo_isends", device="cpu")
    count, cap = 80, c.MAX_PENDING_ISENDS
    most = 0
    try:
        if ctx.rank == 0:
            for k in range(count):
                c.isend_tensor_dict({"k": torch.full((16,), float(k)), "n": k}, dst=1)
                most = max(most, len(c._pending_isends))
        else:
            for k in range(count):
                got = c.recv_tensor_dict(src=0)
                assert got["n"] == k and torch.equal(got["k"], torch.full((16,), float(k)))
        c.barrier()
    finally:
        c.destroy()
    return most


def test_dropped_isends_stay_bounded_on_a_gloo_group(groups):
    # A Gloo send reports completion only once waited for: the kept sends
    # are waited for beyond the bound instead of piling up.
    most = groups(2).run(_dropped_isends_on_gloo)
    from tpcomm import GroupCoordinator

    assert 0 < most[0] <= GroupCoordinator.MAX_PENDING_ISENDS + 1


# ----------------------------------------------------------------- reductions
def _into_output_and_cpu_all_reduce(ctx):
    c = _coordinator(ctx)
    n, r = ctx.world_size, ctx.rank
    x = _data(3, r, (5, 4 * n))
    want = sum(_data(3, k, (5, 4 * n)).double() for k in range(n))
    # reduce_scatterv's dim defaults to the last, as vLLM's.
    part = c.reduce_scatterv(x)
    assert torch.allclose(part.double(), want[:, 4 * r:4 * r + 4], atol=1e-5)
    sizes = [r_ + 1 for r_ in range(n)]
    y = _data(4, r, (sum(sizes), 3))
    out = torch.empty(sizes[r], 3)
    assert c.reduce_scatterv_into_output(y, out, dim=0, sizes=sizes) is out
    full = sum(_data(4, k, (sum(sizes), 3)).double() for k in range(n))
    start = sum(sizes[:r])
    assert torch.allclose(out.double(), full[start:start + sizes[r]], atol=1e-5)
    with pytest.raises(ValueError, match="output has shape"):
        c.reduce_scatterv_into_output(y, torch.empty(sizes[r] + 1, 3), dim=0, sizes=sizes)
    t = torch.tensor([r + 1, 10 * (r + 1)], dtype=torch.int64)
    assert c.cpu_all_reduce_(t) is t
    assert t.tolist() == [n * (n + 1) // 2, 10 * n * (n + 1) // 2]
    with pytest.raises(ValueError, match="takes a CPU tensor"):
        c.cpu_all_reduce_(torch.empty(2, device="meta"))


def test_into_output_and_cpu_all_reduce(group):
    group.run(_into_output_and_cpu_all_reduce)


def _sibling(ctx):
    c = _coordinator(ctx)
    sibling = c.make_sibling_device_group(group_desc="sibling")
    assert sibling is not c.device_group
    assert dist.get_process_group_ranks(sibling) == c.ranks
    assert dist.get_backend(sibling) == dist.get_backend(c.device_group)
    t = torch.ones(3) * (ctx.rank + 1)
    dist.all_reduce(t, group=sibling)
    assert t.tolist() == [ctx.world_size * (ctx.world_size + 1) / 2] * 3
    dist.destroy_process_group(sibling)


def test_make_sibling_device_group(group):
    group.run(_sibling)


# ----------------------------------------------------------------- expert parallel
def _experts_for_all(hidden, weights, ids, experts, rank, world_size):
    """A rank's share of an MoE over every token: its own experts only."""
    per_rank = experts.shape[0] // world_size
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(hidden.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            if rank * per_rank <= e < (rank + 1) * per_rank:
                out[t] += w * (hidden[t].float() @ experts[e].float())
    return out.to(hidden.dtype)


def _dispatch_topk(ctx, form, dtype):
    c = _coordinator(ctx)
    n, r, hidden_dim, num_experts, top_k = ctx.world_size, ctx.rank, 8, 4 * ctx.world_size, 2
    experts = _data(8, 99, (num_experts, hidden_dim, hidden_dim)) / hidden_dim
    tokens = 2 + 3 * r  # uneven counts
    hidden = _data(9, r, (tokens, hidden_dim), dtype)
    logits = _data(10, r, (tokens, num_experts))
    topk = logits.double().softmax(-1).topk(top_k, dim=-1)
    weights, ids = topk.values.float(), topk.indices
    marks = torch.arange(tokens) + 100 * r
    if form == "topk":
        got_h, got_w, got_ids, (got_marks,) = c.dispatch(hidden, weights, ids,
                                                         extra_tensors=[marks])
    else:  # dispatch_router_logits: the receiver routes from the logits
        got_h, got_logits, (got_marks,) = c.dispatch_router_logits(hidden, logits,
                                                                   extra_tensors=[marks])
        t = got_logits.double().softmax(-1).topk(top_k, dim=-1)
        got_w, got_ids = t.values.float(), t.indices
    every = sum(2 + 3 * k for k in range(n))
    assert got_h.shape == (every, hidden_dim) and got_ids.shape == (every, top_k)
    want_marks = torch.cat([torch.arange(2 + 3 * k) + 100 * k for k in range(n)])
    assert torch.equal(got_marks, want_marks), "every rank's tokens, by rank then token"
    mine = _experts_for_all(got_h, got_w, got_ids, experts, r, n)
    assert c.allocate_combine_input(mine.shape, mine.dtype, mine.device) is None
    out = torch.empty(tokens, hidden_dim, dtype=dtype)
    assert c.combine_into_output(mine, out) is out
    want = _moe_reference(hidden, logits, experts, top_k)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    assert torch.allclose(out.double(), want, atol=tol, rtol=tol), (out, want)
    if n > 1:
        c.dispatch(hidden, weights, ids)
        with pytest.raises(ValueError, match="output has shape"):
            c.combine_into_output(mine, torch.empty(tokens + 1, hidden_dim, dtype=dtype))
        # The plan stays: a good combine still pairs with that dispatch.
        back = c.combine(_experts_for_all(*c.all_gatherv([hidden, weights, ids], dim=0),
                                          experts, r, n))
        assert torch.allclose(back.double(), want, atol=tol, rtol=tol)
        with pytest.raises(ValueError, match="first dim must be the"):
            c.dispatch(hidden, weights[:1], ids)
        with pytest.raises(ValueError, match="rows"):
            c.dispatch_router_logits(hidden, logits)
            c.combine(torch.zeros(1, hidden_dim, dtype=dtype))
        c.combine(torch.zeros(every, hidden_dim, dtype=dtype))  # the pending one


@pytest.mark.parametrize("form,dtype", [("topk", torch.float32), ("topk", torch.bfloat16),
                                        ("router_logits", torch.float32)],
                         ids=["topk", "topk_bf16", "router_logits"])
def test_dispatch_topk_and_router_logits_against_single_process_moe(group, form, dtype):
    group.run(_dispatch_topk, form, dtype)


def _ep_group_choice(ctx, dp):
    """On the expert-parallel group of initialize_model_parallel, vLLM's
    dispatch gathers over the data-parallel group unless the tokens are
    sequence parallel (then over the whole expert-parallel group)."""
    import tpcomm

    n, r = ctx.world_size, ctx.rank
    tpcomm.initialize_model_parallel(n // dp, 1, data_parallel_size=dp, device="cpu")
    try:
        ep = tpcomm.get_ep_group()
        tokens = 2 + r
        hidden = _data(11, r, (tokens, 4))
        ids = torch.zeros(tokens, 1, dtype=torch.int64)
        w = torch.ones(tokens, 1)
        rows = {}
        for sp in (False, True):
            got_h, _, _ = ep.dispatch(hidden, w, ids, is_sequence_parallel=sp)
            rows[sp] = got_h.shape[0]
            # Each rank hands back what it received: combine sums the copies.
            out = ep.combine(got_h, is_sequence_parallel=sp)
            copies = (n if sp else dp)
            assert torch.allclose(out, hidden * copies, atol=1e-6), (sp, out, hidden)
        dp_group = tpcomm.get_dp_group().ranks
        assert rows[False] == sum(2 + k for k in dp_group)
        assert rows[True] == sum(2 + k for k in range(n))
    finally:
        tpcomm.destroy_model_parallel()


@pytest.mark.parametrize("world_size,dp", [(2, 1), (4, 2)], ids=["tp2", "tp2xdp2"])
def test_dispatch_on_the_expert_parallel_group_gathers_as_vllm(groups, world_size, dp):
    groups(world_size).run(_ep_group_choice, dp)


# ----------------------------------------------------------------- parallel_state
def test_layout_with_context_parallel_matches_vllm():
    import tpcomm

    got = tpcomm.model_parallel_layout(8, tensor_model_parallel_size=2,
                                       pipeline_model_parallel_size=2,
                                       prefill_context_model_parallel_size=2)
    # vLLM 0.33: [outer, data, pipeline, prefill context, tensor].
    assert got["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert got["pcp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert got["pp"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert got["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert got["dcp"] == [[r] for r in range(8)]
    got = tpcomm.model_parallel_layout(8, tensor_model_parallel_size=4,
                                       decode_context_model_parallel_size=2,
                                       data_parallel_size=2)
    assert got["dcp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert got["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert got["inner_dp_world"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # With prefill context parallelism a decode-context group spans it first.
    got = tpcomm.model_parallel_layout(8, tensor_model_parallel_size=2,
                                       pipeline_model_parallel_size=2,
                                       prefill_context_model_parallel_size=2,
                                       decode_context_model_parallel_size=2)
    assert got["dcp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    got = tpcomm.model_parallel_layout(8, tensor_model_parallel_size=2,
                                       prefill_context_model_parallel_size=2,
                                       decode_context_model_parallel_size=4)
    assert got["dcp"] == [[0, 2, 1, 3], [4, 6, 5, 7]]
    # One replica's ranks per inner DP world, also with an outer dimension.
    got = tpcomm.model_parallel_layout(8, tensor_model_parallel_size=2, data_parallel_size=2)
    assert got["inner_dp_world"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="decode_context_model_parallel_size 3 does not divide"):
        tpcomm.model_parallel_layout(8, tensor_model_parallel_size=4,
                                     decode_context_model_parallel_size=3)


def _state(ctx):
    import tpcomm

    n, r = ctx.world_size, ctx.rank
    assert tpcomm.is_global_first_rank() == (r == 0)
    assert tpcomm.is_local_first_rank() == (r == 0)
    tpcomm.init_distributed_environment()
    assert tpcomm.get_node_count() == 1
    world = tpcomm.get_world_group()
    assert tpcomm.in_the_same_node_as(world.cpu_group) == [True] * n
    assert tpcomm.in_the_same_node_as(world, source_rank=n - 1) == [True] * n
    with pytest.raises(ValueError, match="source_rank"):
        tpcomm.in_the_same_node_as(world, source_rank=n)
    g = tpcomm.init_model_parallel_group([list(range(n))], r, "tpcomm", group_name="mine",
                                         use_all2all=True, device="cpu")
    assert g.unique_name.startswith("mine:") and g.ranks == list(range(n))
    ps = tpcomm.parallel_state
    t = torch.ones(2)
    assert torch.equal(ps.all_reduce(t, g.unique_name), t * n)
    x = torch.arange(2.0 * n).reshape(2, n) + r
    gathered = ps.all_gather(x, 0, n, g.unique_name)
    assert torch.equal(gathered, torch.cat([x - r + k for k in range(n)]))
    assert ps.all_gather_fake(x, 0, n, g.unique_name).shape == gathered.shape
    scattered = ps.reduce_scatter(x, 1, n, g.unique_name)
    want = sum(x - r + k for k in range(n))[:, r:r + 1]
    assert torch.equal(scattered, want)
    assert ps.reduce_scatter_fake(x, 1, n, g.unique_name).shape == (2, 1)
    assert ps.all_reduce_fake(x, g.unique_name).shape == x.shape
    g.destroy()
    # vLLM's switch: coordinators made afterwards route CUDA allreduces to NCCL.
    ps.set_custom_all_reduce(False)
    try:
        off = tpcomm.init_model_parallel_group([list(range(n))], r, "tpcomm", device="cpu")
        assert tpcomm.describe(off)["route_mode"] == "nccl"
        off.destroy()
    finally:
        ps.set_custom_all_reduce(True)
    on = tpcomm.init_model_parallel_group([list(range(n))], r, "tpcomm", device="cpu")
    assert tpcomm.describe(on)["route_mode"] == "auto"
    on.destroy()
    dcp = 2 if n % 2 == 0 else 1
    tpcomm.initialize_model_parallel(n, 1, 1, dcp, device="cpu", enable_eplb=True)
    try:
        assert tpcomm.get_dcp_world_size_and_rank() == (dcp, r % dcp)
        assert tpcomm.get_dcp_world_size_and_rank(enabled=False) == (1, 0)
        assert tpcomm.get_pcp_group().ranks == [r]
        assert tpcomm.get_eplb_group().ranks == tpcomm.get_ep_group().ranks
        assert tpcomm.get_eplb_group().device_group is not tpcomm.get_ep_group().device_group
        assert tpcomm.get_inner_dp_world_group() is world
        assert tpcomm.get_engram_dp_group() is None and tpcomm.get_engram_dp_size() == 1
        tpcomm.ensure_model_parallel_initialized(n, 1, 1, dcp)
        with pytest.raises(RuntimeError, match="\\(tp, pp, pcp, dcp\\)"):
            tpcomm.ensure_model_parallel_initialized(n, 1, 1, 1 if dcp == 2 else 2)
    finally:
        tpcomm.cleanup_dist_env_and_memory()
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialised"):
        tpcomm.get_node_count()


def test_parallel_state_queries_and_cleanup(group):
    # Each worker's default group goes with cleanup: a fresh set of processes.
    from harness import Group

    g = Group(group.world_size)
    try:
        g.run(_state)
    finally:
        g.close()
