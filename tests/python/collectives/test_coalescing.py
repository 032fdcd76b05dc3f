"""Coalescing on tpcomm groups (backend/coalescing.hpp): the backend says it
coalesces, `dist.batch_isend_irecv` and `_coalescing_manager` run their calls
as one batch with one Work, every order of sends and receives Gloo accepts
completes, and the results equal plain Gloo's on the same ranks."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

from harness import Group, error_message

CPU = torch.device("cpu")


def _data(rank, peer, n, salt=0):
    """What `rank` sends to `peer`: distinct for every pair, size and salt."""
    g = torch.Generator().manual_seed(10_000 * rank + 100 * peer + n + salt)
    return torch.rand(n, generator=g, dtype=torch.float64).to(torch.float32)


def _exchange(ctx, group, sizes, order):
    """Every rank sends `sizes` to each other rank and receives theirs, in
    one batch; `order`: "recvs-first", "sends-first" or "interleaved"."""
    w, r = ctx.world_size, ctx.rank
    sends, recvs, got = [], [], {}
    for peer in range(w):
        if peer == r:
            continue
        for i, n in enumerate(sizes):
            sends.append(dist.P2POp(dist.isend, _data(r, peer, n, i), peer, group))
            got[peer, i] = torch.full((n,), float("nan"))
            recvs.append(dist.P2POp(dist.irecv, got[peer, i], peer, group))
    if order == "recvs-first":
        ops = recvs + sends
    elif order == "sends-first":
        ops = sends + recvs
    else:
        ops = [op for pair in zip(recvs, sends) for op in pair]
    works = dist.batch_isend_irecv(ops)
    for work in works:
        work.wait()
    return works, got


def _batches_match_gloo(ctx):
    w, r = ctx.world_size, ctx.rank
    backend = dist.group.WORLD._get_backend(CPU)
    assert backend.supports_coalescing, "tpcomm's backend says it does not coalesce"
    # Small messages and ones past the first part of a framed message
    # (256 KiB), several to the same peer in order, in every order.
    sizes = [3, 1, 70_000, 5]
    for order in ("recvs-first", "sends-first", "interleaved"):
        works, got = _exchange(ctx, None, sizes, order)
        # One batch, one Work (torch hands back what endCoalescing returned).
        assert len(works) == 1, (order, works)
        assert works[0].is_completed(), order
        _, ref = _exchange(ctx, ctx.ref, sizes, order)
        for key, tensor in got.items():
            peer, i = key
            assert torch.equal(tensor, _data(peer, r, sizes[i], i)), (order, key)
            assert torch.equal(tensor, ref[key]), (order, key, "differs from gloo")
    # The batch's future: completed with the received tensors.
    peer_next, peer_prev = (r + 1) % w, (r - 1) % w
    into = torch.empty(4)
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, into, peer_prev),
                                    dist.P2POp(dist.isend, torch.full((4,), float(r)), peer_next)])
    values = works[0].get_future().wait()
    # Every call's results in order: the recv's tensor (a send has none).
    assert len(values) == 1 and torch.equal(values[0], into), values
    assert torch.equal(into, torch.full((4,), float(peer_prev)))
    return True


# Two ranks of each marked torch_version: .ci/run runs them on torch 2.11 too.
ON_EVERY_TORCH = pytest.param(2, marks=pytest.mark.torch_version)


@pytest.mark.parametrize("world_size", [ON_EVERY_TORCH, 3, 4])
def test_batch_isend_irecv_is_one_batch_and_matches_gloo(groups, world_size):
    assert all(groups(world_size).run(_batches_match_gloo, timeout_s=300))


def _coalesced_collectives(ctx):
    w, r = ctx.world_size, ctx.rank
    pg = dist.group.WORLD
    xs = [torch.arange(n, dtype=torch.float32) * (r + 1) + n for n in (1, 7, 1000)]
    refs = [x.clone() for x in xs]
    # all_reduce's fast path: one allreduce_coalesced inside the batch.
    with _coalescing_manager(pg, CPU, async_ops=True) as cm:
        for x in xs:
            dist.all_reduce(x)
    cm.wait()
    for x in refs:
        dist.all_reduce(x, group=ctx.ref)
    for x, ref in zip(xs, refs):
        assert torch.equal(x, ref), (x, ref)
    # all_gather_into_tensor's fast path too (one allgather_into_tensor_coalesced).
    outs = [torch.empty(3 * w), torch.empty(2 * w)]
    with _coalescing_manager(pg, CPU):
        dist.all_gather_into_tensor(outs[0], torch.full((3,), float(r)))
        dist.all_gather_into_tensor(outs[1], torch.full((2,), float(r * r)))
    assert torch.equal(outs[0], torch.arange(w).float().repeat_interleave(3))
    assert torch.equal(outs[1], (torch.arange(w) ** 2).float().repeat_interleave(2))
    # Collectives with no fast path (broadcast, the list all_gather) go to the
    # backend one by one, in the batch; the block ends with them complete.
    b = torch.full((5,), float(r))
    g = [torch.empty(5) for _ in range(w)]
    with _coalescing_manager(pg, CPU):
        dist.broadcast(b, src=w - 1)
        dist.all_gather(g, torch.full((5,), float(r * r)))
    assert torch.equal(b, torch.full((5,), float(w - 1)))
    for k in range(w):
        assert torch.equal(g[k], torch.full((5,), float(k * k))), (k, g[k])
    # An empty batch (torch's abort makes one) returns no Work, as NCCL's.
    pg._start_coalescing(CPU)
    assert pg._end_coalescing(CPU) is None
    dist.barrier()
    return True


@pytest.mark.parametrize("world_size", [1, ON_EVERY_TORCH, 3, 4])
def test_coalesced_collectives_match_gloo(groups, world_size):
    assert all(groups(world_size).run(_coalesced_collectives, timeout_s=300))


def _misuse(ctx):
    import os
    import tempfile

    pg = dist.group.WORLD
    out = {"end without start": error_message(lambda: pg._end_coalescing(CPU))}
    # A batch whose block raised before its end stays open; the next start
    # drops it, warning, and runs (torch's abort starts one, too).
    with pytest.raises(ZeroDivisionError):
        with _coalescing_manager(pg, CPU):
            dist.broadcast(torch.ones(2), src=0)
            raise ZeroDivisionError("the block's own error")
    dist.distributed_c10d._world.pg_coalesce_state.pop(pg, None)  # torch's own leftover
    # The warning goes to the process's stderr (torch's C++ warning handler).
    with tempfile.TemporaryFile() as err:
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            pg._start_coalescing(CPU)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        out["warning"] = err.read().decode(errors="replace")
    x = torch.ones(3)
    dist.all_reduce(x)
    work = pg._end_coalescing(CPU)
    work.wait()
    out["after"] = x.tolist()
    return out


@pytest.mark.torch_version
def test_misused_coalescing_is_named_and_the_group_goes_on(groups):
    for out in groups(2).run(_misuse):
        assert "endCoalescing on group" in out["end without start"], out
        assert "without startCoalescing" in out["end without start"], out
        assert "dropped a batch of 1 call(s) that was never ended" in out["warning"], out
        assert out["after"] == [2.0, 2.0, 2.0], out


def _mismatched_batch(ctx):
    r = ctx.rank
    peer = 1 - r
    # Rank 0 sends 10 floats where rank 1 posts 12: both ranks' batches
    # raise, naming the mismatch, within the group's timeout.
    n = 10 if r == 0 else 12
    ops = [dist.P2POp(dist.isend, torch.ones(n), peer), dist.P2POp(dist.irecv, torch.empty(n), peer)]
    return error_message(lambda: [work.wait() for work in dist.batch_isend_irecv(ops)])


def test_a_mismatched_batch_raises_on_both_ranks():
    group = Group(2, env={"TPCOMM_CPU_SHM": "0"}, pg_timeout_s=20)
    try:
        errors = group.run(_mismatched_batch, timeout_s=120)
    finally:
        group.close(kill=True)
    for rank, error in enumerate(errors):
        assert error is not None, f"rank {rank}'s batch completed"
        assert "must match in size and dtype" in error, (rank, error)
