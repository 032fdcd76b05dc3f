"""GroupCoordinator.all_reduce_add_rms_norm on CPU: the shared-memory path
(fused into its reduction pass) at world sizes 1 to 5, the composed fallback
(Gloo, rows longer than a chunk, a non-tpcomm backend), the in-place
variant, the custom ops under torch.compile, and bad input.

References: residual_out against the float32 rank-order sum rounded to the
dtype plus the residual (bitwise on the shared-memory path, which sums so);
normed against a float64 RMSNorm of residual_out within float32 statistics
and one rounding; every rank's outputs bitwise equal."""

import pytest
import torch
import torch.distributed as dist

from harness import error_message

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
EPS = 1e-5


def _data(seed, rank, shape, dtype):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _inputs(seed, rank, world_size, rows, hidden, dtype):
    """This rank's input, the shared residual and weight, and the float32
    rank-order sum of every rank's input rounded to the dtype."""
    x = _data(seed, rank, (rows, hidden), dtype)
    residual = _data(seed, 100, (rows, hidden), dtype)
    weight = (_data(seed, 101, (hidden,), torch.float64) * 0.5 + 1).to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    total = _data(seed, 0, (rows, hidden), dtype).to(acc)
    for r in range(1, world_size):
        total = total + _data(seed, r, (rows, hidden), dtype).to(acc)
    return x, residual, weight, total.to(dtype)


def _magnitude(seed, world_size, rows, hidden, dtype):
    """Sum over ranks of |input|: what bounds another summation order's error."""
    return sum(_data(seed, r, (rows, hidden), dtype).double().abs() for r in range(world_size))


def _rounding(dtype):
    return {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.bfloat16: 2.0**-8,
            torch.float16: 2.0**-11}[dtype]


def _check(normed, residual_out, residual, weight, total, magnitude, what):
    """residual_out is total + residual (bitwise when `magnitude` is None, else
    within the rounding of any summation order); normed within rounding of a
    float64 RMSNorm of residual_out."""
    want = total + residual
    if magnitude is None:
        assert torch.equal(residual_out, want), f"{what}: residual_out differs from sum + residual"
    else:
        tol = 4 * _rounding(want.dtype) * (magnitude + residual.double().abs()) + 1e-30
        assert ((residual_out.double() - want.double()).abs() <= tol).all(), what
    ro = residual_out.double()
    ref = ro * torch.rsqrt(ro.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    stats = 2.0**-53 if normed.dtype == torch.float64 else 2.0**-24
    tol = ref.abs() * (stats * (ro.shape[-1] / 8 + 8) + 2 * _rounding(normed.dtype)) + 1e-6
    bad = (normed.double() - ref).abs() > tol
    assert not bad.any(), f"{what}: normed off at {bad.nonzero()[:3].tolist()}"


def _coordinator(ctx, name="fused", backend=None):
    import tpcomm

    key = (name, backend)
    cache = _coordinator.__dict__.setdefault("cache", {})
    if key not in cache:
        kwargs = {} if backend is None else {"torch_distributed_backend": backend}
        cache[key] = tpcomm.GroupCoordinator([list(range(ctx.world_size))], ctx.rank,
                                             group_name=name, device="cpu", **kwargs)
    return cache[key]


# (rows, hidden): one row; odd hidden; several rows; two-phase past 8 KiB;
# a row of 8 KiB float32 that exceeds the 4 KiB test chunk (composed).
SHAPES = [(1, 8), (3, 13), (5, 64), (40, 100), (1, 2048)]


def _fused_cases(ctx, backend=None):
    c = _coordinator(ctx, "fused" if backend is None else "fused_" + backend, backend)
    n = ctx.world_size
    out = []
    for d, dtype in enumerate(DTYPES):
        for s, (rows, hidden) in enumerate(SHAPES):
            seed = 10 * d + s
            x, residual, weight, total = _inputs(seed, ctx.rank, n, rows, hidden, dtype)
            x_before = x.clone()
            if s % 2 == 0:
                normed, residual_out = c.all_reduce_add_rms_norm(x, residual, weight, EPS)
                assert residual_out is not residual
            else:
                kept = residual.clone()
                normed, residual_out = c.all_reduce_add_rms_norm_(x, residual, weight, EPS)
                assert residual_out is residual
                residual = kept
            assert torch.equal(x, x_before), "the input was modified"
            path = c.last_fused_path
            if backend is not None or n == 1:
                expected = "composed" if backend is not None else "local"
            else:
                expected = "composed" if hidden * x.element_size() > 4096 else "cpu_shm"
            assert path == expected, f"{dtype} {rows}x{hidden}: path {path}, want {expected}"
            exact = path in ("cpu_shm", "local")
            magnitude = None if exact else _magnitude(seed, n, rows, hidden, dtype)
            _check(normed, residual_out, residual, weight, total, magnitude,
                   f"{dtype} {rows}x{hidden} {path}")
            out.append((normed, residual_out))
    return out


def _all_equal(results):
    for rank, outputs in enumerate(results[1:], 1):
        for (n0, r0), (n1, r1) in zip(results[0], outputs):
            assert torch.equal(n0, n1) and torch.equal(r0, r1), f"rank {rank} differs from 0"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_cpu_shm_path(shm_groups, world_size):
    _all_equal(shm_groups(world_size).run(_fused_cases, timeout_s=300))


def test_composed_through_gloo(groups):
    # TPCOMM_CPU_SHM=0: the allreduce through Gloo, then add and rms_norm.
    def run(n):
        return groups(n).run(_composed_cases, timeout_s=300)

    for n in (2, 3):
        _all_equal(run(n))


def _composed_cases(ctx):
    c = _coordinator(ctx, "composed")
    x, residual, weight, total = _inputs(3, ctx.rank, ctx.world_size, 4, 100, torch.bfloat16)
    normed, residual_out = c.all_reduce_add_rms_norm(x, residual, weight, EPS)
    assert c.last_fused_path == "composed"
    _check(normed, residual_out, residual, weight, total,
           _magnitude(3, ctx.world_size, 4, 100, torch.bfloat16), "gloo bfloat16")
    return [(normed, residual_out)]


def test_non_tpcomm_backend_composes_in_python(shm_groups):
    _all_equal(shm_groups(3).run(_fused_cases, "gloo", timeout_s=300))


def _stats_and_views(ctx):
    c = _coordinator(ctx)
    backend = c._tpcomm_backend()
    backend.reset_stats()
    x, residual, weight, total = _inputs(5, ctx.rank, ctx.world_size, 6, 32, torch.float32)
    # Views that are not contiguous: a transposed input and residual.
    xt, rt = x.t().contiguous().t(), residual.t().contiguous().t()
    assert not xt.is_contiguous()
    normed, residual_out = c.all_reduce_add_rms_norm(xt, rt, weight, EPS)
    _check(normed, residual_out, residual, weight, total, None, "views")
    kept = rt.clone()
    normed2, same = c.all_reduce_add_rms_norm_(xt, rt, weight, EPS)
    assert same is rt and torch.equal(rt, residual_out) and torch.equal(normed2, normed)
    assert torch.equal(kept, residual)
    return backend.stats().get("cpu_shm", {}).get("calls")


def test_views_in_place_and_stats(shm_groups):
    assert shm_groups(2).run(_stats_and_views) == [2, 2]


def _compiled(ctx):
    c = _coordinator(ctx)

    def layer(x, residual, weight):
        normed, residual = c.all_reduce_add_rms_norm(torch.relu(x) * 2, residual, weight, EPS)
        return normed * 3, residual

    def layer_inplace(x, residual, weight):
        normed, _ = c.all_reduce_add_rms_norm_(x * 2, residual, weight, EPS)
        return normed + 1

    x, residual, weight, _ = _inputs(7, ctx.rank, ctx.world_size, 3, 24, torch.float32)
    eager = layer(x, residual, weight)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, residual, weight)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    r1, r2 = residual.clone(), residual.clone()
    eager = layer_inplace(x, r1, weight)
    compiled = torch.compile(layer_inplace, fullgraph=True, backend="aot_eager")(x, r2, weight)
    assert torch.equal(eager, compiled) and torch.equal(r1, r2)
    assert not torch.equal(r1, residual)  # the residual was written
    # The fake implementation: shapes and dtypes without communicating.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fx = torch.empty(5, 24, dtype=torch.bfloat16)
        a, b = torch.ops.tpcomm.all_reduce_add_rms_norm(fx, fx.clone(), torch.empty(24), EPS,
                                                        c.unique_name)
        assert a.shape == b.shape == (5, 24) and a.dtype == torch.bfloat16
    return True


def test_custom_ops_under_compile(shm_groups):
    assert shm_groups(2).run(_compiled, timeout_s=300) == [True, True]


def _bad_input(ctx):
    c = _coordinator(ctx)
    x = torch.ones(2, 8)
    w = torch.ones(8)
    msgs = [
        error_message(lambda: c.all_reduce_add_rms_norm(x, x.clone(), torch.ones(7), EPS)),
        error_message(lambda: c.all_reduce_add_rms_norm(x.int(), x.int(), w.int(), EPS)),
        error_message(lambda: c.all_reduce_add_rms_norm(x, x.clone(), w, -1.0)),
        error_message(lambda: c.all_reduce_add_rms_norm(x, torch.ones(2, 9), w, EPS)),
        error_message(lambda: c.all_reduce_add_rms_norm(x, x.clone(), w.double(), EPS)),
    ]
    # The group still works afterwards.
    normed, _ = c.all_reduce_add_rms_norm(x, x.clone(), w, EPS)
    assert torch.allclose(normed, torch.ones(2, 8), atol=1e-3)
    return msgs


def test_bad_input_is_named(shm_groups):
    msgs = shm_groups(2).run(_bad_input)[0]
    for msg, want in zip(msgs, ["weight has shape [7]", "input is int32", "eps must be finite",
                                "residual has shape [2, 9]", "float64"]):
        assert msg is not None and want in msg and "all_reduce_add_rms_norm" in msg, msg


def test_bench_fused_quick_runs():
    # The benchmark's quick run end to end (its figures are printed, not checked).
    from tpcomm.bench.fused import run

    assert run(world_sizes=(2,), quick=True, rounds=1) == 0
