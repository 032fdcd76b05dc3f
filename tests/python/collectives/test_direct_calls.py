"""The direct route of dist.all_reduce and GroupCoordinator.all_reduce
(tpcomm/_fast_calls.py, python/fast_calls.cpp): taken for plain CPU tensors
on tpcomm groups, bitwise equal to torch's own route on the same group (and
to float64 / exact references), async Work as torch returns it; never taken
where torch's route does something the direct one would skip (complex,
grad-requiring and subclass tensors, torch function and dispatch modes, the
profiler, Gloo groups, non-members, destroyed groups); the same errors; the
GIL released while waiting; a refusal by torch's front door reported to the
peers; torch.compile mapping it like torch's function."""

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from harness import Group
from tpcomm import _fast_calls

pytestmark = pytest.mark.torch_version  # .ci/run runs these on torch 2.11 too

R = dist.ReduceOp
ENV = {"TPCOMM_CPU_SHM": "1"}


# The shared-memory groups of conftest (small chunks: calls cross chunks).
@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"ws{n}")
def group(request, shm_groups):
    return shm_groups(request.param)


def _torch_route():
    return _fast_calls.torch_route()


# Imported before any group exists, as a module-level import would be: the
# direct route must serve it too, and torch.compile must know it.
from torch.distributed import all_reduce as _imported_all_reduce  # noqa: E402


def _inputs(rank, n, dtype, small):
    g = torch.Generator().manual_seed(1009 * rank + n)
    if small:  # products exact: values in {-2, -1, 1, 2}
        signs = torch.randint(0, 2, (n,), generator=g) * 2 - 1
        v = torch.randint(1, 3, (n,), generator=g) * signs
        return v.to(dtype)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64).to(dtype)


def _reference(world, n, dtype, op, small):
    """float64 (or exact integer) result of op over every rank's input."""
    xs = [_inputs(r, n, dtype, small).to(torch.float64 if dtype.is_floating_point else torch.int64)
          for r in range(world)]
    out = xs[0].clone()
    for x in xs[1:]:
        if op in (R.SUM, R.AVG):
            out += x
        elif op == R.PRODUCT:
            out *= x
        elif op == R.MAX:
            out = torch.maximum(out, x)
        elif op == R.MIN:
            out = torch.minimum(out, x)
        elif op == R.BAND:
            out &= x
        elif op == R.BOR:
            out |= x
        elif op == R.BXOR:
            out ^= x
    return out / world if op == R.AVG else out


CASES = [(torch.float32, R.SUM), (torch.float32, R.AVG), (torch.float32, R.MAX),
         (torch.bfloat16, R.SUM), (torch.float16, R.MIN), (torch.float64, R.PRODUCT),
         (torch.int64, R.SUM), (torch.int32, R.BAND), (torch.int64, R.BOR),
         (torch.int32, R.BXOR), (torch.int64, R.PRODUCT)]


def _taken_and_exact(ctx):
    torch_route = _torch_route()
    for dtype, op in CASES:
        small = op == R.PRODUCT
        for n in (1, 7, 1000, 70_000):
            x = _inputs(ctx.rank, n, dtype, small)
            before = _fast_calls.calls_taken()
            direct = x.clone()
            assert dist.all_reduce(direct, op=op) is None
            assert _fast_calls.calls_taken() == before + 1, (dtype, op, n)
            via_torch = x.clone()
            torch_route(via_torch, op=op)
            assert _fast_calls.calls_taken() == before + 1, "torch's route took the direct one"
            assert torch.equal(direct, via_torch), (dtype, op, n)
            want = _reference(ctx.world_size, n, dtype, op, small)
            if dtype.is_floating_point:
                tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3}.get(dtype, 1e-5)
                torch.testing.assert_close(direct.double(), want, rtol=tol, atol=tol * 4)
            else:
                assert torch.equal(direct.long(), want), (dtype, op, n)
    return True


def test_direct_route_is_taken_and_matches_torchs_route_bit_for_bit(group):
    assert all(group.run(_taken_and_exact))


def _async(ctx):
    x = _inputs(ctx.rank, 513, torch.float32, False)
    before = _fast_calls.calls_taken()
    direct = x.clone()
    work = dist.all_reduce(direct, async_op=True)
    assert _fast_calls.calls_taken() == before + 1
    assert isinstance(work, dist.Work)
    assert work.wait() is True
    assert work.is_completed()
    via_torch = x.clone()
    twork = _torch_route()(via_torch, async_op=True)
    assert type(work) is type(twork)
    twork.wait()
    assert torch.equal(direct, via_torch)
    # the future's value, as DDP's comm hooks read it
    fut = dist.all_reduce(direct, async_op=True).get_future()
    tfut = _torch_route()(via_torch, async_op=True).get_future()
    got, want = fut.wait(), tfut.wait()
    assert type(got) is type(want)
    assert torch.equal(got[0], want[0]) and got[0].data_ptr() == direct.data_ptr()
    return True


def test_async_op_returns_the_backends_work_as_torch_does(group):
    assert all(group.run(_async))


class _Sub(torch.Tensor):
    pass


class _RecordingFunctionMode(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


class _PassDispatchMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _not_taken(ctx):
    """Each call that must go torch's way: nothing counted, results right."""
    world = ctx.world_size
    results = {}

    def check(name, call, tensor, want):
        before = _fast_calls.calls_taken()
        call(tensor)
        results[name] = (_fast_calls.calls_taken() == before,
                         torch.allclose(torch.view_as_real(tensor) if tensor.is_complex() else
                                        tensor.detach(), want))

    ones = torch.ones(5)
    check("complex", dist.all_reduce, torch.ones(5, dtype=torch.complex64),
          torch.view_as_real(torch.full((5,), world, dtype=torch.complex64)))
    check("requires_grad", dist.all_reduce, torch.ones(5, requires_grad=True), ones * world)
    check("subclass", dist.all_reduce, torch.ones(5).as_subclass(_Sub), ones * world)
    # A torch function mode sees the call as torch's function shows it (the
    # mode is off inside its handler, where the call may then go direct).
    mode = _RecordingFunctionMode()
    with mode:
        t = torch.ones(5)
        dist.all_reduce(t)
    results["torch function mode"] = (dist.all_reduce in mode.seen, torch.equal(t, ones * world))
    with _PassDispatchMode():
        check("dispatch mode", dist.all_reduce, torch.ones(5), ones * world)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        check("profiler", dist.all_reduce, torch.ones(5), ones * world)
    results["profiled"] = (any("allreduce" in e.name for e in prof.events()), True)
    check("gloo group", lambda t: dist.all_reduce(t, group=ctx.ref), torch.ones(5), ones * world)
    # the direct route is taken again once the modes are gone
    before = _fast_calls.calls_taken()
    dist.all_reduce(torch.ones(5))
    results["taken again"] = (_fast_calls.calls_taken() == before + 1, True)
    return results


def test_calls_torchs_route_serves_differently_are_not_taken(group):
    for rank, results in enumerate(group.run(_not_taken)):
        bad = {k: v for k, v in results.items() if v != (True, True)}
        assert not bad, f"rank {rank}: (not taken, right result) failed for {bad}"


def _non_member_and_destroyed(ctx):
    import gc

    sub = dist.new_group([0])
    t = torch.ones(3)
    before = _fast_calls.calls_taken()
    out = dist.all_reduce(t, group=sub)
    taken = _fast_calls.calls_taken() - before
    if ctx.rank != 0:
        assert out is None and taken == 0 and torch.equal(t, torch.ones(3))
    else:
        assert taken == 1 and torch.equal(t, torch.ones(3))
    dist.destroy_process_group(sub)
    if ctx.rank == 0:
        # a destroyed group: the direct route does what torch's does
        outcomes = []
        for route in (dist.all_reduce, _torch_route()):
            try:
                x = torch.ones(3)
                route(x, group=sub)
                outcomes.append(("ok", x.tolist()))
            except Exception as e:  # noqa: BLE001 - compared below
                outcomes.append((type(e).__name__, None))
        assert outcomes[0] == outcomes[1], outcomes
    del sub
    # groups made and destroyed leave no entry behind
    for _ in range(4):
        g = dist.new_group([0, 1])
        dist.all_reduce(torch.ones(2), group=g)
        dist.destroy_process_group(g)
        del g
    gc.collect()
    stale = [k for k, (ref, _) in _fast_calls._handles.items() if ref() is None]
    assert not stale and len(_fast_calls._handles) <= 3, _fast_calls._handles
    # the default group still takes it
    before = _fast_calls.calls_taken()
    dist.all_reduce(t)
    assert _fast_calls.calls_taken() == before + 1
    return True


def _coalescing_and_inflight(ctx):
    c10d = torch._C._distributed_c10d
    w = ctx.world_size
    a, b = torch.ones(4), torch.full((3,), 2.0)
    before = _fast_calls.calls_taken()
    with dist._coalescing_manager(async_ops=False):
        dist.all_reduce(a)
        dist.all_reduce(b)
    coalesced = (_fast_calls.calls_taken() == before, torch.equal(a, torch.full((4,), float(w))),
                 torch.equal(b, torch.full((3,), 2.0 * w)))
    # with in-flight collectives as graph inputs, each call's Work is
    # registered as torch's route registers it
    c10d._set_allow_inflight_collective_as_graph_input(True)
    try:
        sizes = []
        for route in (dist.all_reduce, _torch_route()):
            start = c10d._get_work_registry_size()
            x = torch.ones(5)
            route(x)
            sizes.append(c10d._get_work_registry_size() - start)
            torch.ops._c10d_functional.wait_tensor(x)
    finally:
        c10d._set_allow_inflight_collective_as_graph_input(False)
    return coalesced, sizes


def test_coalescing_and_inflight_registration_as_torchs_route(shm_groups):
    for coalesced, sizes in shm_groups(2).run(_coalescing_and_inflight):
        assert all(coalesced), coalesced
        assert sizes[0] == sizes[1], sizes


def _errors(ctx):
    """The same call refused with the same error on both routes."""
    got = []
    for make in (lambda: torch.ones(4), lambda: torch.ones(4, 4).t()):
        for op in (R.BAND, R.SUM):
            errors = []
            for route in (dist.all_reduce, _torch_route()):
                try:
                    route(make(), op=op)
                    errors.append(None)
                except Exception as e:  # noqa: BLE001 - compared below
                    errors.append((type(e), str(e).split(" failed: ")[-1]))
            got.append(errors)
    return got


def test_errors_match_torchs_route(shm_groups):
    for per_rank in shm_groups(2).run(_errors):
        for direct, via_torch in per_rank:
            assert direct == via_torch
    # BAND on float32 is refused on both routes
    assert shm_groups(2).run(_errors)[0][0][0] is not None


def _gil_released(ctx):
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    t = torch.ones(8)
    dist.barrier()
    if ctx.rank == 1:
        time.sleep(0.5)
        dist.all_reduce(t)
        return None
    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.05)
    start = ticks[0]
    before = _fast_calls.calls_taken()
    dist.all_reduce(t)  # waits about 0.45 s for rank 1
    during = ticks[0] - start
    stop.set()
    thread.join()
    assert _fast_calls.calls_taken() == before + 1
    assert torch.equal(t, torch.full((8,), 2.0))
    return during


def test_the_gil_is_released_while_waiting(shm_groups):
    during = shm_groups(2).run(_gil_released)[0]
    assert during > 50, f"another Python thread ran only {during} times in 0.45 s"


def _front_door_refusal(ctx):
    sub = dist.new_group([0, 1])  # broken for good by the refusal
    start = time.monotonic()
    try:
        if ctx.rank == 0:
            dist.all_reduce([torch.ones(2)], group=sub)  # torch refuses a list
        else:
            dist.all_reduce(torch.ones(2), group=sub)
    except Exception as e:  # noqa: BLE001 - compared below
        return type(e).__name__, str(e), time.monotonic() - start
    return None


def test_a_refusal_by_torchs_function_is_reported_to_the_peers(shm_groups):
    refused, peer = shm_groups(2).run(_front_door_refusal, timeout_s=60)
    assert refused is not None and refused[0] in ("TypeError", "ValueError")
    assert peer is not None, "the peer's call succeeded"
    assert "rank 0 refused allreduce" in peer[1], peer[1]
    assert peer[2] < 10, f"the peer raised after {peer[2]:.1f} s"


def _compiled(ctx):
    @torch.compile(fullgraph=True, backend="eager")
    def step(t):
        y = t * 2
        dist.all_reduce(y)
        z = t - ctx.rank
        dist.all_reduce(z, op=R.MAX)
        w = t + ctx.rank
        _imported_all_reduce(w, op=R.MIN)
        return y + 1, z, w

    x = torch.arange(6, dtype=torch.float32)
    y, z, w = step(x.clone())
    # the name imported before tpcomm installed its route takes it too
    before = _fast_calls.calls_taken()
    u = x.clone()
    _imported_all_reduce(u)
    return (torch.equal(y, x * 2 * ctx.world_size + 1), torch.equal(z, x),
            torch.equal(w, x), _fast_calls.calls_taken() == before + 1,
            torch.equal(u, x * ctx.world_size))


def test_torch_compile_maps_it_like_torchs_function(shm_groups):
    for flags in shm_groups(2).run(_compiled):
        assert all(flags), flags


def _coordinator(ctx):
    from tpcomm.coordinator import GroupCoordinator

    coord = GroupCoordinator([list(range(ctx.world_size))], ctx.rank, "tpcomm",
                             group_name="direct")
    try:
        results = []
        for x in (_inputs(ctx.rank, 300, torch.float32, False),
                  _inputs(ctx.rank, 64, torch.bfloat16, False).view(8, 8).t()):
            kept = x.clone()
            before = _fast_calls.calls_taken()
            out = coord.all_reduce(x)
            taken = _fast_calls.calls_taken() - before
            via_op = torch.ops.tpcomm.all_reduce(x, coord.unique_name)
            results.append((taken == 1, torch.equal(out, via_op), torch.equal(x, kept),
                            out.data_ptr() != x.data_ptr(), out.shape == x.shape))
        # a grad-requiring input goes through the op
        before = _fast_calls.calls_taken()
        out = coord.all_reduce(torch.ones(4, requires_grad=True))
        results.append((_fast_calls.calls_taken() == before,
                        torch.equal(out.detach(), torch.full((4,), float(ctx.world_size))),
                        True, True, True))
        return results
    finally:
        coord.destroy()


def test_coordinator_all_reduce_takes_the_direct_route(shm_groups):
    for rank, results in enumerate(shm_groups(2).run(_coordinator)):
        for i, flags in enumerate(results):
            assert all(flags), f"rank {rank} case {i}: {flags}"


def _switched_off(ctx):
    t = torch.ones(3)
    dist.all_reduce(t)
    from tpcomm.coordinator import GroupCoordinator

    coord = GroupCoordinator([list(range(ctx.world_size))], ctx.rank, "tpcomm",
                             group_name="switched_off")
    try:
        out = coord.all_reduce(torch.ones(3))
        return (not any(h for _, h in _fast_calls._handles.values()), coord._direct is None,
                _fast_calls.calls_taken() == 0, torch.equal(t, torch.full((3,), 2.0)),
                torch.equal(out, torch.full((3,), 2.0)))
    finally:
        coord.destroy()


def test_tpcomm_direct_calls_0_leaves_torchs_route():
    g = Group(2, env={**ENV, "TPCOMM_DIRECT_CALLS": "0"})
    try:
        for rank, flags in enumerate(g.run(_switched_off)):
            assert all(flags), f"rank {rank}: {flags}"
    finally:
        g.close()


def _devices_served(ctx):
    from tpcomm import _C

    world = _C._fast_handle_devices(_fast_calls._handle_of(dist.group.WORLD))
    cpu_only = dist.new_group(backend="cpu:tpcomm")
    only = _C._fast_handle_devices(_fast_calls._handle_of(cpu_only))
    t = torch.ones(2)
    before = _fast_calls.calls_taken()
    dist.all_reduce(t, group=cpu_only)  # CPU calls still go direct on it
    return world, only, _fast_calls.calls_taken() == before + 1, t.tolist()


def test_cuda_calls_go_direct_only_where_tpcomm_is_the_cuda_backend():
    """A group made with backend "tpcomm" serves CUDA tensors with the same
    backend: its direct handle takes them (the GPU run of
    tests/gpu/test_coordinator_cuda.py checks the call); a "cpu:tpcomm"
    group has no CUDA backend, so CUDA calls keep torch's route there."""
    g = Group(2, env=ENV)
    try:
        for rank, (world, only, taken, t) in enumerate(g.run(_devices_served)):
            assert world == ["cpu", "cuda"], (rank, world)
            assert only == ["cpu"], (rank, only)
            assert taken and t == [2.0, 2.0], rank
    finally:
        g.close()
