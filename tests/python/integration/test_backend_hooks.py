"""torch's newest backend hooks on tpcomm (backend/hooks.hpp,
docs/torch_capabilities.md): abort hooks registered through torch's API run
on every rank before the group raises a communication failure, with the
group's reason already set, and in abort(); a hook's own error never replaces
the call's. Pre/post collective hooks registered on a ProcessGroup fire for
dist.all_reduce on tpcomm (the direct route steps aside while any is
registered). build_info() and `python -m tpcomm.info` say which capabilities
this build offers; on a torch without them (before 2.15) torch's API has none
and tpcomm says so."""

import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import tpcomm
from harness import error_message

pytestmark = pytest.mark.torch_version  # .ci/run runs these on torch 2.11 too

C10D = torch._C._distributed_c10d
TORCH_HAS_ABORT_HOOKS = hasattr(C10D.Backend, "supports_abort_hooks")
TORCH_HAS_COLLECTIVE_HOOKS = hasattr(C10D.ProcessGroup, "register_pre_hook")
TORCH_HAS_RECONFIGURE = hasattr(C10D.Backend, "supports_reconfigure")
TORCH_HAS_WINDOW = hasattr(C10D.Backend, "supports_window")


def test_build_info_and_info_name_the_capabilities_this_torch_has():
    capabilities = tpcomm.build_info()["torch_capabilities"]
    assert capabilities["abort_hooks"] == TORCH_HAS_ABORT_HOOKS, capabilities
    minor = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    assert capabilities["completion_hooks"] == (TORCH_HAS_ABORT_HOOKS and minor >= (2, 15))
    # Coalescing on every torch, and the backend says so to torch's callers.
    assert capabilities["coalescing"] is True, capabilities
    # Shrinking on every torch (2.11 has it), and the backend says so.
    assert capabilities["shrink"] is True, capabilities
    # Reconfigure where torch declares it (2.15 on).
    assert capabilities["reconfigure"] == TORCH_HAS_RECONFIGURE, capabilities
    # Windows where torch declares them (2.15 on).
    assert capabilities["window"] == TORCH_HAS_WINDOW, capabilities
    out = subprocess.run([sys.executable, "-m", "tpcomm.info"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    on = "on" if TORCH_HAS_ABORT_HOOKS else "off"
    assert f"abort_hooks {on}" in out.stdout and "shrink on" in out.stdout, out.stdout
    on = "on" if TORCH_HAS_RECONFIGURE else "off"
    assert f"reconfigure {on}" in out.stdout, out.stdout
    on = "on" if TORCH_HAS_WINDOW else "off"
    assert f"window {on}" in out.stdout, out.stdout
    assert "coalescing on" in out.stdout, out.stdout


def _abort_hooks(ctx, route_shm):
    """Rank 0 aborts the group while rank 1 waits in an allreduce: each
    rank's hook runs once before its failure is raised (rank 0's in abort(),
    rank 1's before its allreduce raises), rank 1's seeing the group's
    reason; a second hook that raises changes nothing of the error."""
    g = dist.new_group(backend="tpcomm")
    backend = g._get_backend(torch.device("cpu"))
    if not TORCH_HAS_ABORT_HOOKS:
        return "absent", not hasattr(backend, "register_abort_hook")
    assert backend.supports_abort_hooks
    x = torch.ones(1 << 10)
    dist.all_reduce(x, group=g)
    seen = []
    backend.register_abort_hook(2, lambda: seen.append(backend.fault))

    def broken():
        raise ValueError("the hook's own failure")

    backend.register_abort_hook(1, broken)
    unknown = error_message(lambda: backend.unregister_abort_hook(99))
    msg = None
    if ctx.rank == 0:
        time.sleep(0.3)
        backend.abort()
    else:
        msg = error_message(lambda: dist.all_reduce(x, group=g))
    return seen, msg, unknown


@pytest.mark.parametrize("route", ["gloo", "shm"])
def test_abort_hooks_run_on_every_rank_before_the_group_raises(groups, shm_groups, route):
    group = groups(2) if route == "gloo" else shm_groups(2)
    results = group.run(_abort_hooks, route == "shm")
    if not TORCH_HAS_ABORT_HOOKS:
        assert results == [("absent", True)] * 2, results
        return
    (seen0, _, unknown), (seen1, msg1, _) = results
    assert seen0 == [""], seen0  # in abort(), before it
    assert len(seen1) >= 1 and "rank 0 aborted the group" in seen1[0], seen1
    assert msg1 is not None and msg1.startswith("DistBackendError"), msg1
    assert "rank 0 aborted the group" in msg1 and "hook's own failure" not in msg1, msg1
    assert unknown is not None and "no abort hook 99 is registered" in unknown, unknown


def _collective_hooks(ctx):
    from tpcomm import _C

    pg = dist.group.WORLD
    if not TORCH_HAS_COLLECTIVE_HOOKS:
        return "absent"
    x = torch.ones(8)
    dist.all_reduce(x)  # the direct route is set up
    before = _C._fast_calls_taken()
    dist.all_reduce(x)
    direct = _C._fast_calls_taken() - before
    calls = []
    pg.register_pre_hook(5, lambda args: calls.append(("pre", str(args.name), args.op_id)))
    pg.register_post_hook(5, lambda args: calls.append(("post", str(args.name), args.op_id)))
    before = _C._fast_calls_taken()
    y = torch.full((8,), float(ctx.rank + 1))
    dist.all_reduce(y)
    with_hooks = _C._fast_calls_taken() - before
    pg.unregister_pre_hook(5)
    pg.unregister_post_hook(5)
    before = _C._fast_calls_taken()
    dist.all_reduce(x)
    after = _C._fast_calls_taken() - before
    return direct, calls, with_hooks, after, y.tolist()


def test_collective_hooks_fire_for_dist_all_reduce(groups):
    results = groups(2).run(_collective_hooks)
    if not TORCH_HAS_COLLECTIVE_HOOKS:
        assert results == ["absent"] * 2, results
        return
    for direct, calls, with_hooks, after, y in results:
        assert direct == 1 and after == 1, (direct, after)  # the direct route, hooks or not
        assert with_hooks == 0, with_hooks  # torch's route, which fires them
        assert [c[0] for c in calls] == ["pre", "post"] and "ALLREDUCE" in calls[0][1], calls
        assert calls[0][2] == calls[1][2], calls  # one op id correlates them
        assert y == [3.0] * 8, y
