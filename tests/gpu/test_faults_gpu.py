"""A broken group ends the custom kernel's waits: 2 processes sharing this GPU
through CUDA IPC, a kernel of one rank waiting for a peer that will never
launch its part (the kernel's own timeout is a minute). A peer's abort() and
a peer's refused call must end that wait within a second or two (the
watchdog's interval, then a 4-byte poison copy per rank), and every rank's
next call must raise naming the cause. A graph capture must survive the
watchdog's questions to the GPU."""

import os
import sys
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU on this machine: the custom kernel's fault tests need one",
                allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
from harness import Group  # noqa: E402

ENV = {"TPCOMM_CAR_MAX_BYTES": str(1 << 20), "TPCOMM_CAR_TIMEOUT_MS": "60000"}
# Processes time-slice one GPU (about 4.4 ms a slice), on top of the
# watchdog's 200 ms: generous, and far below the kernel's minute.
WITHIN_S = 5.0


def _set_up():
    import torch.distributed as dist

    import tpcomm
    torch.cuda.set_device(0)
    group = dist.new_group(backend="tpcomm")
    x = torch.ones(4096, device="cuda")
    dist.all_reduce(x, group=group)  # the custom kernel's set-up, on both ranks
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 2.0))
    assert tpcomm.stats(group)["custom_oneshot"]["calls"] == 1, tpcomm.stats(group)
    return group, x


def _next_call_error(group, x):
    """The error of this rank's next allreduce on `group` (None: none)."""
    import torch.distributed as dist
    try:
        dist.all_reduce(x, group=group)
        torch.cuda.synchronize()
    except RuntimeError as e:
        return str(e)
    return None


def _waiting_call(group, x):
    """An allreduce whose peer never launches its part: how long it took to
    end, and the error of the call after it."""
    import torch.distributed as dist
    start = time.monotonic()
    dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    waited = time.monotonic() - start
    return waited, _next_call_error(group, x)


def _peer_abort(ctx):
    import torch.distributed as dist
    group, x = _set_up()
    dist.barrier(group=ctx.ref)
    if ctx.rank == 0:
        time.sleep(0.5)  # rank 1's kernel is waiting by now
        group._get_backend(torch.device("cpu")).abort()
        return None, _next_call_error(group, x)
    return _waiting_call(group, x)  # rank 0 never launches its part


def test_a_peers_abort_ends_a_waiting_kernel():
    # A watchdog that never looks: rank 1's kernel can only end through the
    # poison rank 0's abort copies into its buffer.
    env = dict(ENV, TPCOMM_WATCHDOG_MS="60000")
    group = Group(2, env=env, extra_paths=[HERE], start_timeout_s=240)
    try:
        (_, own), (waited, peer) = group.run(_peer_abort, timeout_s=120)
    finally:
        group.close(kill=True)
    assert own is not None and "rank 0 aborted the group" in own, own
    assert waited < WITHIN_S, f"rank 1's kernel waited {waited:.2f} s"
    assert peer is not None and "the group is poisoned: rank 0 aborted it" in peer, peer


def _capture_while_the_watchdog_probes(ctx):
    import torch.distributed as dist
    group, x = _set_up()
    # The watchdog asks the GPU about the eager launch every interval; a
    # capture in global mode (torch.cuda.graph's default) that outlasts a
    # few intervals must survive those questions.
    y = torch.full((4096,), float(ctx.rank + 1), device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(y, group=group)
        time.sleep(1.0)
    for i in range(10):
        y.fill_(float(ctx.rank + 1 + i))
        graph.replay()
    torch.cuda.synchronize()
    want = float(sum(r + 1 + 9 for r in range(ctx.world_size)))
    assert torch.equal(y, torch.full_like(y, want)), y[:4]


def test_a_capture_survives_the_watchdogs_device_probe():
    group = Group(2, env=ENV, extra_paths=[HERE], start_timeout_s=240)
    try:
        group.run(_capture_while_the_watchdog_probes, timeout_s=120)
    finally:
        group.close()


def _peer_refusal(ctx):
    import torch.distributed as dist
    group, x = _set_up()
    dist.barrier(group=ctx.ref)
    if ctx.rank == 1:
        with pytest.raises(RuntimeError, match="ReduceOp.BAND needs an integer or bool tensor"):
            dist.all_reduce(x, op=dist.ReduceOp.BAND, group=group)  # refused: float
        return None, _next_call_error(group, x)
    return _waiting_call(group, x)  # rank 1 refused its part


def test_a_peers_refused_call_ends_a_waiting_kernel():
    group = Group(2, env=ENV, extra_paths=[HERE], start_timeout_s=240)
    try:
        (waited, mine), (_, theirs) = group.run(_peer_refusal, timeout_s=120)
    finally:
        group.close(kill=True)
    assert waited < WITHIN_S, f"rank 0's kernel waited {waited:.2f} s"
    for error in (mine, theirs):
        assert error is not None and "rank 1 refused allreduce" in error, error
