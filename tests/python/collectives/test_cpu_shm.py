"""The shared-memory path for CPU collectives (TPCOMM_CPU_SHM) through the
plain torch.distributed API, at world sizes 1 to 5: every op, dtype and
reduction against a rank-order reference (bit for bit) and float64, results
bitwise equal on every rank, sizes across chunk and two-phase boundaries,
offset views, async Work, DDP/FSDP2/functional collectives, two simulated
hosts (Gloo), a killed rank, and nothing left in /dev/shm.

Longer than 600 lines because its cases share the worker groups of world
sizes 1 to 5 (the shm fixture) and the input and reference helpers at its top."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from harness import Group

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64]
R = dist.ReduceOp
SIZES = [0, 1, 7, 1023, 1024, 1025, 2048 + 5, 5000]  # chunks of 1024 float32 (conftest)


@pytest.fixture(params=[1, 2, 3, 4, 5], ids=lambda n: f"ws{n}")
def shm(request, shm_groups):
    return shm_groups(request.param)


def make(rank, n, dtype, small=False, salt=0):
    g = torch.Generator().manual_seed(7919 * rank + 31 * n + salt)
    if small:  # products stay exact: values in {-2, -1, 1, 2}
        v = torch.randint(1, 3, (n,), generator=g) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
        return v.to(dtype)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64).to(dtype)


def rank_order(inputs, op, dtype, world, scale=None):
    """The promised result: ranks combined in order 0..n-1 in float32 (float64
    for float64, the dtype for integers), one rounding at the end."""
    acc_dtype = torch.float64 if dtype == torch.float64 else (
        torch.float32 if dtype.is_floating_point else dtype)
    if scale is not None:
        inputs = [(x * scale).to(dtype) for x in inputs]
    acc = inputs[0].to(acc_dtype)
    for x in inputs[1:]:
        x = x.to(acc_dtype)
        if op in (R.SUM, R.AVG, R.PREMUL_SUM):
            acc = acc + x
        elif op == R.PRODUCT:
            acc = acc * x
        elif op == R.MIN:
            acc = torch.minimum(acc, x)
        else:
            acc = torch.maximum(acc, x)
    if op == R.AVG:
        acc = torch.div(acc, world, rounding_mode="trunc") if not dtype.is_floating_point \
            else acc / world
    return acc.to(dtype)


def same_on_every_rank(ctx, t):
    flat = t.reshape(-1).view(torch.uint8) if t.numel() else torch.zeros(1, dtype=torch.uint8)
    gathered = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, flat, group=ctx.ref)
    return all(torch.equal(g, flat) for g in gathered)


def _allreduce_every_dtype_and_op(ctx):
    w, r = ctx.world_size, ctx.rank
    ops = [R.SUM, R.AVG, R.MIN, R.MAX, R.PRODUCT, "premul"]
    for dtype in DTYPES:
        tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-6}.get(dtype, 1e-12)
        for op in ops:
            if op == "premul" and not dtype.is_floating_point:
                continue
            for n in SIZES:
                small = op == R.PRODUCT
                inputs = [make(k, n, dtype, small) for k in range(w)]
                x = inputs[r].clone()
                if op == "premul":
                    dist.all_reduce(x, op=dist._make_nccl_premul_sum(0.375))
                    want = rank_order(inputs, R.PREMUL_SUM, dtype, w, scale=0.375)
                else:
                    dist.all_reduce(x, op=op)
                    want = rank_order(inputs, op, dtype, w)
                what = f"all_reduce {op} {dtype} n={n}"
                assert torch.equal(x, want), f"{what}: {x} != {want}"
                assert same_on_every_rank(ctx, x), what
                if op == R.SUM and dtype.is_floating_point:
                    exact = torch.stack([t.double() for t in inputs]).sum(0) if n else x.double()
                    torch.testing.assert_close(x.double(), exact, rtol=tol, atol=tol)
    return True


def test_allreduce_every_dtype_and_op_against_the_references(shm):
    assert all(shm.run(_allreduce_every_dtype_and_op, timeout_s=600))


def _gathers_scatters_broadcasts(ctx):
    w, r = ctx.world_size, ctx.rank
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool):
        for n in SIZES:
            inputs = [make(k, n, torch.int64 if not dtype.is_floating_point else dtype)
                      .to(dtype) for k in range(w)]
            # all_gather_into_tensor from an offset view
            backing = torch.zeros(n + 3, dtype=dtype)
            backing[3:] = inputs[r]
            out = torch.empty(n * w, dtype=dtype)
            dist.all_gather_into_tensor(out, backing[3:])
            assert torch.equal(out, torch.cat(inputs)), f"all_gather_into_tensor {dtype} {n}"
            outs = [torch.empty(n, dtype=dtype) for _ in range(w)]
            dist.all_gather(outs, inputs[r])
            assert all(torch.equal(o, i) for o, i in zip(outs, inputs)), f"all_gather {dtype}"
            for root in range(w):
                t = inputs[r].clone()
                dist.broadcast(t, src=root)
                assert torch.equal(t, inputs[root]), f"broadcast {dtype} {n} from {root}"
        dist.barrier()
    for dtype in (torch.float32, torch.float16, torch.int32):
        for n in SIZES:
            full = [make(k, n * w, dtype) for k in range(w)]
            out = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(out, full[r])
            want = rank_order([f[r * n:(r + 1) * n] for f in full], R.SUM, dtype, w)
            assert torch.equal(out, want), f"reduce_scatter_tensor {dtype} {n}"
            out2 = torch.empty(n, dtype=dtype)
            dist.reduce_scatter(out2, list(full[r].chunk(w)) if n else
                                [torch.empty(0, dtype=dtype)] * w, op=R.AVG)
            want = rank_order([f[r * n:(r + 1) * n] for f in full], R.AVG, dtype, w)
            assert torch.equal(out2, want), f"reduce_scatter AVG {dtype} {n}"
    return True


def test_gathers_scatters_broadcasts_and_barrier(shm):
    assert all(shm.run(_gathers_scatters_broadcasts, timeout_s=600))


def _partial_overlaps(ctx):
    """Outputs that partly overlap their inputs are refused (they would be
    read after they were written); exact in-place calls still work."""
    import tpcomm

    w, r = ctx.world_size, ctx.rank
    n, shift = 3000, 100  # several 4 KiB chunks
    inputs = [make(k, n, torch.float32) for k in range(w)]
    want = rank_order(inputs, R.SUM, torch.float32, w)
    refused = []
    buf = torch.zeros(n + shift)
    buf[:n] = inputs[r]
    try:
        tpcomm.all_reduce_into(buf[:n], buf[shift:shift + n])
    except Exception as e:  # noqa: BLE001
        refused.append(str(e))
    assert torch.equal(buf[:n], inputs[r]), "a refused call changed its input"
    whole = torch.zeros(n * w + 7)
    whole[7:7 + n] = inputs[r]
    try:  # the input starts 7 elements into the output: nobody's slot
        dist.all_gather_into_tensor(whole[:n * w], whole[7:7 + n])
    except Exception as e:  # noqa: BLE001
        refused.append(str(e))
    full = make(r, n * w + 5, torch.float32)
    try:
        dist.reduce_scatter_tensor(full[5:5 + n], full[:n * w])
    except Exception as e:  # noqa: BLE001
        refused.append(str(e))
    assert len(refused) == 3, refused
    assert all("overlap" in m for m in refused), refused
    # Exactly in place: still served, still right.
    same = inputs[r].clone()
    tpcomm.all_reduce_into(same, same)
    assert torch.equal(same, want)
    whole = torch.zeros(n * w)
    whole[r * n:(r + 1) * n] = inputs[r]
    dist.all_gather_into_tensor(whole, whole[r * n:(r + 1) * n])
    assert torch.equal(whole, torch.cat(inputs))
    fulls = [make(k, n * w, torch.float32, salt=1) for k in range(w)]
    mine = fulls[r].clone()
    dist.reduce_scatter_tensor(mine[r * n:(r + 1) * n], mine)
    assert torch.equal(mine[r * n:(r + 1) * n],
                       rank_order([f[r * n:(r + 1) * n] for f in fulls], R.SUM, torch.float32, w))
    # Exactly another rank's part: each offset is read before it is written.
    other = (r + 1) % w
    whole = torch.zeros(n * w)
    whole[other * n:(other + 1) * n] = inputs[r]
    dist.all_gather_into_tensor(whole, whole[other * n:(other + 1) * n])
    assert torch.equal(whole, torch.cat(inputs))
    mine = fulls[r].clone()
    dist.reduce_scatter_tensor(mine[other * n:(other + 1) * n], mine)
    assert torch.equal(mine[other * n:(other + 1) * n],
                       rank_order([f[r * n:(r + 1) * n] for f in fulls], R.SUM, torch.float32, w))
    # A coalesced call whose output 0 is input 1's memory: refused.
    pg = dist.group.WORLD
    a, b = torch.ones(n), torch.ones(n)
    outs = [torch.empty(n * w), torch.empty(n * w)]
    message = None
    try:
        pg.allgather_into_tensor_coalesced([outs[0], outs[1]], [a, outs[0][:n]]).wait()
    except Exception as e:  # noqa: BLE001
        message = str(e)
    assert message is not None and "shares memory with input 1" in message, message
    return True


def test_partly_overlapping_outputs_are_refused_and_in_place_calls_work(shm):
    assert all(shm.run(_partial_overlaps, timeout_s=120))


def _every_kernel_level(ctx):
    """Every reduction kernel level gives the same bits (16-bit types through
    the vector kernels, tails through the portable loop)."""
    import tpcomm

    w, r = ctx.world_size, ctx.rank
    backend = tpcomm._backend_of(dist.group.WORLD)
    seen = set()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for op in (R.SUM, R.AVG, R.MAX):
            for n in (5, 1000, 5000):
                inputs = [make(k, n, dtype, salt=3) for k in range(w)]
                want = rank_order(inputs, op, dtype, w)
                for level in ("portable", "avx2", "avx512", "auto"):
                    backend.set_cpu_reduce_isa(level)
                    seen.add(tpcomm.describe()["cpu_shm"]["reduce_isa"])
                    x = inputs[r].clone()
                    dist.all_reduce(x, op=op)
                    assert torch.equal(x, want), f"{level} {dtype} {op} n={n}"
    try:
        backend.set_cpu_reduce_isa("sse9")
        raise AssertionError("an unknown level was accepted")
    except Exception as e:  # noqa: BLE001
        assert "sse9" in str(e) and "portable" in str(e), e
    return sorted(seen)


def test_every_reduction_kernel_level_gives_the_reference_bits(shm):
    import subprocess
    import sys

    from tpcomm import _C

    levels = shm.run(_every_kernel_level, timeout_s=120)
    print("kernel levels run:", levels[0])
    # Every level this CPU runs was run (AVX-512 and AVX2 on an AVX-512
    # server, AVX2 on an AVX2-only one, the portable loops everywhere).
    assert sorted(levels[0]) == sorted(_C.cpu_reduce_isas()), (levels, _C.cpu_reduce_isas())
    # python -m tpcomm.info names the level in use and those the CPU runs.
    for asked in ("auto", "portable"):
        out = subprocess.run([sys.executable, "-m", "tpcomm.info"], capture_output=True,
                             text=True, timeout=120,
                             env={**os.environ, "TPCOMM_CPU_REDUCE_ISA": asked}).stdout
        want = _C.cpu_reduce_isa() if asked == "auto" else "portable"
        assert (f"{want} in use (TPCOMM_CPU_REDUCE_ISA={asked}; this CPU runs "
                f"{', '.join(_C.cpu_reduce_isas())})") in out, out


def _async_and_routes(ctx):
    import tpcomm
    w, r = ctx.world_size, ctx.rank
    tpcomm.reset_stats()
    x = torch.full((1000,), float(r + 1))
    work = dist.all_reduce(x, async_op=True)
    assert work.wait() and work.is_completed()
    assert torch.equal(work.get_future().wait()[0], x)
    assert x[0].item() == w * (w + 1) / 2
    out = torch.empty(1000 * w)
    work = dist.all_gather_into_tensor(out, x, async_op=True)
    work.wait()
    assert torch.equal(out, x.repeat(w))
    work = dist.barrier(async_op=True)
    work.wait()
    backing = torch.zeros(1003)  # an offset view, reduced in place
    view = backing[3:]
    view.fill_(1.0)
    dist.all_reduce(view)
    assert backing[:3].eq(0).all() and view.eq(w).all()
    s = tpcomm.stats()
    assert s["cpu_shm"]["calls"] == 4 and s["gloo"]["calls"] == 0, s
    d = tpcomm.describe()["cpu_shm"]
    assert d["available"] and d["set_up"] and d["mode"] == "1", d
    # Not taken by the path: bitwise ops go to Gloo, with the same answer.
    y = torch.tensor([r + 1], dtype=torch.int32)
    dist.all_reduce(y, op=R.BOR)
    assert tpcomm.stats()["gloo"]["calls"] == 1
    # Non-contiguous tensors are refused as before.
    with pytest.raises(RuntimeError, match="not contiguous"):
        dist.all_reduce(torch.ones(4, 4).t())
    # A call whose size differs on one rank: every rank raises, the group lives on.
    if w > 1:
        z = torch.ones(5 if r == 1 else 4)
        with pytest.raises(RuntimeError, match="ranks disagree on a shared-memory collective"):
            dist.all_reduce(z)
        z = torch.ones(4)
        dist.all_reduce(z)
        assert z[0].item() == w
    return True


def test_async_work_routes_and_refusals(shm):
    assert all(shm.run(_async_and_routes))


def _subgroups(ctx):
    import tpcomm
    w, r = ctx.world_size, ctx.rank
    ranks = list(range(0, w, 2))
    sub = dist.new_group(ranks)
    if r in ranks:
        x = torch.full((300,), float(r))
        dist.all_reduce(x, group=sub)
        assert x[0].item() == sum(ranks)
        assert tpcomm.describe(sub)["cpu_shm"]["available"]
    child = dist.group.WORLD.split_group(list(range(w)))
    y = torch.full((10,), 1.0)
    dist.all_reduce(y, group=child)
    assert y[0].item() == w and tpcomm.describe(child)["cpu_shm"]["available"]
    return True


def test_subgroups_and_split_groups_use_the_path(shm):
    assert all(shm.run(_subgroups))


# ---------------------------------------------------------------- real users
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def _batches(rank, steps):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
            for _ in range(steps)]


def _reference_params(world, steps):
    """Data-parallel SGD in float64 in one process: the gradient is the mean of
    every rank's gradient, as DDP and FSDP2 compute it."""
    model = _model().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    batches = [_batches(r, steps) for r in range(world)]
    for step in range(steps):
        opt.zero_grad()
        loss = sum(nn.functional.mse_loss(model(b[step][0].double()), b[step][1].double())
                   for b in batches) / world
        loss.backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _train(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _ddp_and_fsdp(ctx, steps):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    import tpcomm

    tpcomm.reset_stats()
    ref = _reference_params(ctx.world_size, steps)
    ddp = DDP(_model(), process_group=dist.group.WORLD, bucket_cap_mb=0.001)
    _train(ddp, _batches(ctx.rank, steps))
    params = [p.detach() for p in ddp.module.parameters()]
    flat = torch.cat([p.reshape(-1) for p in params])
    assert same_on_every_rank(ctx, flat), "DDP replicas differ"
    for p, q in zip(params, ref):
        torch.testing.assert_close(p.double(), q, rtol=1e-4, atol=1e-5)
    model = _model()
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _train(model, _batches(ctx.rank, steps))
    full = [p.full_tensor() for p in model.parameters()]
    assert same_on_every_rank(ctx, torch.cat([p.reshape(-1) for p in full]))
    for p, q in zip(full, ref):
        torch.testing.assert_close(p.double(), q, rtol=1e-4, atol=1e-5)
    assert tpcomm.stats()["cpu_shm"]["calls"] > 0
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_and_fsdp2_match_float64_and_replicas_agree(shm_groups, world_size):
    assert all(shm_groups(world_size).run(_ddp_and_fsdp, 8, timeout_s=300))


def test_existing_ddp_fsdp2_and_functional_tests_pass_with_the_path_on(shm_groups):
    """The suite's own DDP, FSDP2 and functional-collective checks, which compare
    with Gloo bit for bit, with the path on at 2 ranks: a sum of two terms does
    not depend on the order, so equality with Gloo still holds there (from 3
    ranks on, the tests above compare with float64 instead)."""
    import test_collectives
    import test_users

    group = shm_groups(2)
    assert len(group.run(test_users._ddp_bit_identical, 20, timeout_s=300)) == 2
    assert len(group.run(test_users._fsdp2_matches_gloo, 10, timeout_s=300)) == 2
    assert all(group.run(test_collectives._functional))


def _functional(ctx):
    import torch.distributed._functional_collectives as funcol
    w, r = ctx.world_size, ctx.rank
    group = dist.group.WORLD
    inputs = [make(k, 12 * w, torch.float32) for k in range(w)]
    x = inputs[r]
    total = rank_order(inputs, R.SUM, torch.float32, w)
    assert torch.equal(funcol.all_reduce(x, "sum", group).wait(), total)
    assert torch.equal(funcol.all_gather_tensor(x, 0, group), torch.cat(inputs))
    assert torch.equal(funcol.reduce_scatter_tensor(x, "sum", 0, group), total.chunk(w)[r])
    outs = funcol.all_gather_into_tensor_coalesced([x, x * 2], group)
    assert torch.equal(outs[1], torch.cat(inputs) * 2)
    outs = funcol.reduce_scatter_tensor_coalesced([x, x], "sum", [0, 0], group)
    assert torch.equal(outs[1], total.chunk(w)[r])
    outs = funcol.all_reduce_coalesced([x, x], "sum", group)
    assert torch.equal(outs[1].wait(), total)
    # Mixed dtypes, one of which the path does not reduce: all through Gloo.
    u = (torch.arange(4 * w) % 7).to(torch.uint8)
    outs = funcol.reduce_scatter_tensor_coalesced([x, u], "sum", [0, 0], group)
    assert torch.equal(outs[1], (u.chunk(w)[r].int() * w).to(torch.uint8)), outs[1]
    torch.testing.assert_close(outs[0], total.chunk(w)[r])

    @torch.compile(fullgraph=True, backend="eager")
    def compiled(t):
        return funcol.all_reduce(t, "sum", group) + 1

    assert torch.equal(compiled(x), total + 1)
    return True


def test_functional_collectives_and_compile(shm):
    assert all(shm.run(_functional))


# ---------------------------------------------------------------- hosts, faults
def _two_hosts(ctx):
    import tpcomm
    x = torch.full((100,), float(ctx.rank + 1))
    dist.all_reduce(x)
    d = tpcomm.describe()["cpu_shm"]
    return x[0].item(), d["available"], d["reason"], tpcomm.stats()["gloo"]["calls"]


@pytest.mark.parametrize("per_rank, why", [
    ({0: {"TPCOMM_HOST_ID": "host-a"}, 1: {"TPCOMM_HOST_ID": "host-b"}}, "different hosts"),
    ({1: {"TPCOMM_CPU_SHM": "0"}}, "TPCOMM_CPU_SHM=0 on rank(s) 1"),
    ({0: {"TPCOMM_CPU_SHM_BUFFER_BYTES": "8192"}},
     "ranks disagree on TPCOMM_CPU_SHM_BUFFER_BYTES (rank 0: 8192, rank 1: 0 (auto))"),
], ids=["two-hosts", "off-on-one-rank", "settings-differ"])
def test_groups_the_path_cannot_serve_use_gloo_on_every_rank(per_rank, why):
    group = Group(2, env_per_rank=per_rank)
    try:
        results = group.run(_two_hosts)
    finally:
        group.close()
    for value, available, reason, gloo_calls in results:
        assert value == 3.0 and not available and gloo_calls == 1
        assert why in reason, reason


def _chunk_in_force(ctx):
    import tpcomm
    n = 1_000_000  # 4 MB of float32: several chunks of any size below
    x = make(ctx.rank, n, torch.float32)
    dist.all_reduce(x)
    d = tpcomm.describe()["cpu_shm"]
    want = rank_order([make(r, n, torch.float32) for r in range(ctx.world_size)], R.SUM,
                      torch.float32, ctx.world_size)
    return d["available"], d["buffer_bytes"], d["threads"], torch.equal(x, want)


@pytest.mark.parametrize("per_rank, chunk", [
    ({0: {"TPCOMM_CPU_SHM_THREADS": "1"}, 1: {"TPCOMM_CPU_SHM_THREADS": "1"}}, 1 << 20),
    ({0: {"TPCOMM_CPU_SHM_THREADS": "2"}, 1: {"TPCOMM_CPU_SHM_THREADS": "2"}}, 1 << 20),
    ({0: {"TPCOMM_CPU_SHM_THREADS": "1"}, 1: {"TPCOMM_CPU_SHM_THREADS": "6"}}, 6 * (256 << 10)),
    ({0: {"TPCOMM_CPU_SHM_BUFFER_BYTES": "65536"}, 1: {"TPCOMM_CPU_SHM_BUFFER_BYTES": "65536"}},
     65536),
], ids=["auto-1-thread", "auto-2-threads", "auto-threads-differ", "explicit"])
def test_the_default_chunk_is_1_mib_or_256_kib_per_thread_of_the_largest_rank(per_rank, chunk):
    group = Group(2, env_per_rank={r: {"TPCOMM_CPU_SHM": "1", **e} for r, e in per_rank.items()})
    try:
        results = group.run(_chunk_in_force)
    finally:
        group.close()
    for available, buffer_bytes, _, exact in results:
        assert available and exact
        assert buffer_bytes == chunk


def _policy_when_pinned(ctx, cpus_of_rank):
    import tpcomm

    os.sched_setaffinity(0, cpus_of_rank[ctx.rank])
    group = dist.new_group(list(range(ctx.world_size)), backend="tpcomm")
    t = torch.ones(4)
    dist.all_reduce(t, group=group)  # sets the path up
    shm = tpcomm.describe(group)["cpu_shm"]
    dist.destroy_process_group(group)
    return t.tolist(), shm["available"], shm["spin_us"], shm["yields"]


@pytest.mark.parametrize("cores,yield_setting,waits",
                         [("own", None, (1000, False)), ("own", "1", (1000, True)),
                          ("shared", None, (0, False))],
                         ids=["a-core-each", "a-core-each-yielding", "one-core-for-both"])
def test_ranks_pinned_to_cores_of_their_own_poll_1ms(cores, yield_setting, waits):
    # vLLM's CPU workers are pinned to a core each: each process alone may
    # use one CPU, but the two ranks do not compete, so they poll 1 ms as
    # unpinned ranks on two cores do, without yielding the core between polls
    # unless TPCOMM_CPU_SHM_YIELD=1. Two ranks on one core poll a few times
    # (spin 0) and sleep on the futex, which frees the core for the peer.
    online = sorted(os.sched_getaffinity(0))
    if len(online) < 2:
        pytest.fail(f"needs two CPUs, this process may use {online}")
    pins = {0: {online[0]}, 1: {online[1]}} if cores == "own" else {0: {online[0]},
                                                                     1: {online[0]}}
    env = {"TPCOMM_CPU_SHM": "1"}
    if yield_setting is not None:
        env["TPCOMM_CPU_SHM_YIELD"] = yield_setting
    group = Group(2, env=env)
    try:
        results = group.run(_policy_when_pinned, pins)
    finally:
        group.close()
    for values, available, spin_us, yields in results:
        assert values == [2.0] * 4 and available
        assert (spin_us, yields) == waits


def _region_vmas():
    """This process's mappings of shared-memory groups' regions, in address
    order: (start, end, policy, {node: pages})."""
    ends = {}
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:tpcomm-shm" in line:
                a, b = line.split()[0].split("-")
                ends[int(a, 16)] = int(b, 16)
    vmas = []
    with open("/proc/self/numa_maps") as f:
        for line in f:
            fields = line.split()
            start = int(fields[0], 16)
            if start not in ends:
                continue
            pages = {int(x[1:x.index("=")]): int(x[x.index("=") + 1:]) for x in fields
                     if x[0] == "N" and x[1:2].isdigit()}
            vmas.append((start, ends[start], fields[1], pages))
    return sorted(vmas)


def _placement(ctx, pin_main_to_last=False):
    """Each rank's slots on its node, its share of the CPUs and its worker
    threads pinned inside it, as describe() and /proc show them."""
    import tpcomm

    if pin_main_to_last:
        # As an OpenMP runtime pins a vLLM worker's main thread to one CPU of
        # its list (the first there; the last here, so that the workers'
        # places differ from an unpinned thread's), and the plugin hands the
        # list to tpcomm.
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cpus[-1:])
        tpcomm.set_cpu_shm_cpus(cpus)
    x = torch.full((1 << 18,), float(ctx.rank + 1))
    dist.all_reduce(x)
    assert x[0].item() == ctx.world_size * (ctx.world_size + 1) / 2
    shm = tpcomm.describe()["cpu_shm"]
    me = shm["ranks"][ctx.rank]
    page = os.sysconf("SC_PAGE_SIZE")
    slots = 2 * shm["buffer_bytes"]
    vmas = _region_vmas()
    if me["memory"].startswith("first touch (mbind refused"):
        # A seccomp filter forbids mbind: the pages are where this rank
        # touched them, on a node of its own share.
        assert sum(n for v in vmas for n in v[3].values()) > 0, vmas
    else:
        # The region's pages of this rank: one mapping of exactly its slots,
        # bound to its node ("prefer:N"), every page allocated there.
        assert me["memory"] == f"bound to node {me['node']}", me
        mine = [v for v in vmas if v[1] - v[0] == slots and v[2] == f"prefer:{me['node']}"]
        assert mine, (me, vmas)
        assert mine[0][3] == {me["node"]: slots // page}, mine
        # The header and the flags before the ranks' slots are not bound.
        assert vmas[0][2] == "default", vmas
    # Worker threads: named, each pinned to one CPU of the rank's share.
    pinned = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        if name.startswith("tpcomm-shm:"):
            with open(f"/proc/self/task/{tid}/status") as f:
                allowed = [ln.split()[1] for ln in f if ln.startswith("Cpus_allowed_list")][0]
            pinned.append(allowed)
    return shm["ranks"], shm["threads"], sorted(pinned), shm["spin_us"], shm["yields"]


def test_each_rank_keeps_its_memory_on_its_node_and_its_threads_on_its_cpus():
    """Placement (docs/cpu-shm.md#placement-many-cores-and-numa-nodes): the
    binding and the page counts read back from /proc on this machine's nodes
    (one here); at world size 1 a worker pinned to each CPU but the first
    (the rank's own thread, not pinned, keeps it), or but the one the main
    thread is pinned to (the last: the workers take the first); at 2 ranks, unpinned processes
    that declare a CPU each (TPCOMM_CPU_SHM_CPUS) get those as their shares
    and, not competing, poll 1 ms (without yielding the core between polls)."""
    online = sorted(os.sched_getaffinity(0))
    if len(online) < 2:
        pytest.fail(f"needs two CPUs, this process may use {online}")
    expect_threads = min(8, len(online))
    for pin_main in (False, True):
        one = Group(1, env={"TPCOMM_CPU_SHM": "1"})
        try:
            ranks, threads, pinned, _, _ = one.run(_placement, pin_main)[0]
        finally:
            one.close()
        share = ",".join(map(str, online))
        assert ranks[0]["cpus"] in (share, f"{online[0]}-{online[-1]}"), ranks
        assert threads == expect_threads == ranks[0]["threads"], (threads, ranks)
        # The rank's own thread keeps the CPU it is pinned to (else the
        # first); a worker on each other.
        left = online[-1] if pin_main else online[0]
        want = [c for c in online if c != left][:expect_threads - 1]
        assert pinned == sorted(str(c) for c in want), (pin_main, pinned)
        assert ranks[0]["pinned_workers"] == expect_threads - 1, ranks
    two = Group(2, env_per_rank={r: {"TPCOMM_CPU_SHM": "1", "TPCOMM_CPU_SHM_CPUS": str(online[r])}
                                 for r in range(2)})
    try:
        results = two.run(_placement)
    finally:
        two.close()
    for ranks, threads, pinned, spin_us, yields in results:
        assert [x["cpus"] for x in ranks] == [str(online[0]), str(online[1])], ranks
        assert [x["allowed_cpus"] for x in ranks] == [str(online[0]), str(online[1])], ranks
        assert threads == 1 and pinned == [], (threads, pinned)
        assert (spin_us, yields) == (1000, False)


def _bad_cpu_list(ctx):
    try:
        dist.all_reduce(torch.ones(3))
        return None
    except RuntimeError as e:
        return str(e)


def test_a_bad_cpu_list_is_named_on_every_rank():
    group = Group(2, env={"TPCOMM_CPU_SHM": "1"},
                  env_per_rank={1: {"TPCOMM_CPU_SHM_CPUS": "0-99999"}})
    try:
        messages = group.run(_bad_cpu_list)
    finally:
        group.close()
    for m in messages:
        assert m and "rank 1" in m and "TPCOMM_CPU_SHM_CPUS='0-99999'" in m, messages


def _required_but_refused(ctx):
    messages = []
    for _ in range(2):  # the set-up, then a later call: both raise
        try:
            dist.all_reduce(torch.ones(3))
            messages.append(None)
        except RuntimeError as e:
            messages.append(str(e))
    return messages


def test_required_path_on_two_hosts_raises_on_every_rank():
    # TPCOMM_CPU_SHM=1 on rank 0 only: rank 1 (auto) must raise too rather
    # than go on through Gloo alone.
    ranks = {0: {"TPCOMM_HOST_ID": "host-a", "TPCOMM_CPU_SHM": "1"},
             1: {"TPCOMM_HOST_ID": "host-b", "TPCOMM_CPU_SHM": "auto"}}
    group = Group(2, env_per_rank=ranks)
    try:
        results = group.run(_required_but_refused)
    finally:
        group.close()
    for messages in results:
        for m in messages:
            assert m is not None and "TPCOMM_CPU_SHM=1 (on rank(s) 0)" in m, m
            assert "different hosts" in m, m


def _killed_rank(ctx):
    dist.all_reduce(torch.ones(8))  # the path is set up
    if ctx.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(8))
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), time.monotonic() - start
    return None


def test_killed_rank_raises_on_the_survivors_within_the_timeout():
    group = Group(3, env={"TPCOMM_CPU_SHM": "1"}, pg_timeout_s=10)
    try:
        for conn in group._conns:
            conn.send((_killed_rank.__module__, _killed_rank.__name__, ()))
        results = []
        for rank in (0, 1):
            assert group._conns[rank].poll(60), f"rank {rank} hung"
            status, value = group._conns[rank].recv()
            assert status == "ok", value
            results.append(value)
    finally:
        group.close(kill=True)
    for kind, msg, elapsed in results:
        assert kind == "DistBackendError", (kind, msg)
        assert "rank 2" in msg and "tpcomm: allreduce on group" in msg, msg
        assert elapsed < 20, elapsed  # within 2x the 10 s timeout (death is seen at once)


def _destroyed_by_one_rank(ctx):
    import gc

    sub = dist.new_group(backend="tpcomm")
    dist.all_reduce(torch.ones(8), group=sub)  # the path is set up
    if ctx.rank == 1:
        dist.destroy_process_group(sub)
        del sub
        gc.collect()
        time.sleep(3)  # alive, but gone from the group
        return None
    time.sleep(0.3)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(8), group=sub)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), time.monotonic() - start
    return "no error"


def test_a_rank_that_destroys_its_group_is_named_by_its_peers_at_once():
    group = Group(2, env={"TPCOMM_CPU_SHM": "1"}, pg_timeout_s=60)
    try:
        results = group.run(_destroyed_by_one_rank, timeout_s=60)
    finally:
        group.close(kill=True)
    kind, msg, elapsed = results[0]
    assert kind == "DistBackendError", (kind, msg)
    assert "rank 1 left the group" in msg, msg
    assert elapsed < 1.0, elapsed  # not the 60 s timeout


def _forked_child_calls(ctx):
    dist.all_reduce(torch.ones(8))  # the path is set up
    message = None
    if ctx.rank == 0:
        read, write = os.pipe()
        child = os.fork()
        if child == 0:
            try:
                dist.all_reduce(torch.ones(8))
                text = "served"
            except Exception as e:  # noqa: BLE001
                text = f"{type(e).__name__}: {e}"
            os.write(write, text.encode()[:4000])
            os._exit(0)
        os.close(write)
        os.waitpid(child, 0)
        message = os.read(read, 4096).decode()
        os.close(read)
    x = torch.full((8,), float(ctx.rank + 1))
    dist.all_reduce(x)  # the parent's group is untouched
    assert torch.equal(x, torch.full((8,), 3.0)), x
    return message


def test_a_forked_child_cannot_use_its_parents_group():
    group = Group(2, env={"TPCOMM_CPU_SHM": "1"})
    try:
        results = group.run(_forked_child_calls, timeout_s=60)
    finally:
        group.close(kill=True)
    assert "forked from the one that set the group up" in results[0], results[0]


def test_dev_shm_is_unchanged():
    """Runs last in this module: the path never names anything in /dev/shm."""
    before = set(os.listdir("/dev/shm"))
    group = Group(2, env={"TPCOMM_CPU_SHM": "1"})
    try:
        group.run(_async_and_routes)
    finally:
        group.close(kill=True)
    assert set(os.listdir("/dev/shm")) - before == set()


def test_cpu_benchmark_runs_and_prints_its_tables():
    """The benchmark itself (figures are not checked: it is not a timed test)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tpcomm.bench", "cpu", "--world-sizes", "2",
                          "--max-mib", "1", "--quick", "--rounds", "1", "--png", ""],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        assert f"{op}, world size 2" in out.stdout, out.stdout
    assert "gloo/on" in out.stdout and "256 KB" in out.stdout, out.stdout
    for extra, expect in ((["--dtype", "bfloat16", "--threads", "2"], "on/thr"),
                          (["--dtypes"], "bf16/f32"), (["--paths"], "coordinator"),
                          (["--late"], "late rank in its call"),
                          (["--reuse"], "     64 KB   32     2 MB"),
                          (["--bound"], "of the bandwidth bound"),
                          (["--scaling", "--thread-counts", "1", "2"], "best/1t")):
        out = subprocess.run([sys.executable, "-m", "tpcomm.bench", "cpu", "--world-sizes", "2",
                              "--max-mib", "1", "--quick", "--rounds", "1", "--png", "", *extra],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (extra, out.stderr)
        assert expect in out.stdout, (extra, out.stdout)


def test_the_peers_benchmark_checks_every_way_and_says_why_a_peer_did_not_run():
    """bench cpu --peers: DeepSpeed's shared-memory op built from its PyPI
    sdist and run beside tpcomm where this CPU runs its kernels (float32 on
    AVX2, bfloat16 on AVX-512), every way checked against float64 first;
    vLLM's op is not in this interpreter, which the benchmark says."""
    import subprocess
    import sys

    from tpcomm.bench.cpu.peers import _cpu_flags

    out = subprocess.run([sys.executable, "-m", "tpcomm.bench", "cpu", "--peers", "--world-sizes",
                          "2", "--max-mib", "1", "--quick", "--rounds", "1"],
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, (out.stdout, out.stderr)
    assert "WRONG RESULT" not in out.stdout, out.stdout
    assert "vllm, float32: not run: vLLM is not installed" in out.stdout, out.stdout
    flags = _cpu_flags()
    tables = out.stdout.split("\n  bfloat16\n")
    assert len(tables) == 2 and "\n  float32\n" in tables[0], out.stdout
    float32, bfloat16 = tables[0].split("\n  float32\n")[1], tables[1]
    # Five sizes (4 B to 256 KB by 16x) in each table, tpcomm's two ways in both.
    for table in (float32, bfloat16):
        assert "tpcomm dist.all_reduce" in table and "tpcomm coordinator" in table, table
        assert sum(line.strip().startswith(("4 B", "64 B", "1 KB", "16 KB", "256 KB"))
                   for line in table.splitlines()) == 5, table
    # The header line: a peer's column where it ran.
    assert ("deepspeed" in float32.splitlines()[0]) == ("avx2" in flags), out.stdout
    assert ("deepspeed" in bfloat16.splitlines()[0]) == ("avx512bw" in flags), out.stdout
    if "avx512bw" not in flags:
        assert "deepspeed, bfloat16: not run: its bfloat16 kernels need AVX-512" in out.stdout
