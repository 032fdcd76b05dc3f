"""tpcomm's hooks into torch's internals check their ground (tpcomm._hooks).

On the torch installed here every hook is on; a torch laid out otherwise
(faked here before `import tpcomm`) turns that hook off with its reason in
describe() and python -m tpcomm.info, and the calls it would have served
take torch's own route with the same results. This module imports tpcomm
only inside functions: its fakes run on the ranks before tpcomm is imported.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from harness import Group

pytestmark = pytest.mark.torch_version  # .ci/run runs these on torch 2.11 too

ENV = {"TPCOMM_CPU_SHM": "1"}
HOOKS = ("direct_route", "front_door", "flight_recorder", "gloo_connections")
# The functions torch does not wrap in its error logger, which the front door
# wraps itself (the others it sees through the logger's error path).
FRONT_DOOR = ("all_reduce_coalesced", "all_gather_coalesced", "isend", "irecv",
              "batch_isend_irecv")


def _use_the_group(ctx):
    """Every hook's state, and what calls each hook serves returned."""
    import tpcomm
    from tpcomm import _fast_calls

    t = torch.arange(4, dtype=torch.float64) * (ctx.rank + 1)
    before = _fast_calls.calls_taken()
    dist.all_reduce(t)
    direct = _fast_calls.calls_taken() - before
    gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, torch.full((2,), ctx.rank))
    out = torch.zeros(ctx.world_size, dtype=torch.int64)
    dist.all_to_all_single(out, torch.arange(ctx.world_size) + 10 * ctx.rank)
    expected_sum = torch.arange(4, dtype=torch.float64) * sum(range(1, ctx.world_size + 1))
    return {
        "hooks": tpcomm.describe()["torch_hooks"],
        "all_reduce": torch.equal(t, expected_sum),
        "direct": direct,
        "all_gather": all(torch.equal(g, torch.full((2,), r)) for r, g in enumerate(gathered)),
        "all_to_all": out.tolist() == [10 * r + ctx.rank for r in range(ctx.world_size)],
        "front_door_wrapped": sorted(
            name for name in dir(dist)
            if hasattr(getattr(dist, name, None), "_tpcomm_front_door")),
    }


def _run(before_import=None):
    g = Group(2, env=ENV, before_import=before_import)
    try:
        return g.run(_use_the_group)
    finally:
        g.close()


def test_every_hook_is_on_with_this_torch():
    for rank, seen in enumerate(_run()):
        assert set(seen["hooks"]) == set(HOOKS), seen["hooks"]
        for name, state in seen["hooks"].items():
            assert state.startswith("on ("), f"rank {rank}: {name} is {state!r} on torch {torch.__version__}"
        assert seen["direct"] == 1, f"rank {rank}: the direct route was not taken"
        assert seen["all_reduce"] and seen["all_gather"] and seen["all_to_all"], seen
        assert seen["front_door_wrapped"] == sorted(FRONT_DOOR), seen["front_door_wrapped"]
        state = seen["hooks"]["front_door"]
        assert "functions through torch's error logger, 5 wrapped)" in state, state


def fake_plain_all_reduce():
    """torch.distributed.all_reduce as a plain function around torch's (not
    the error logger's closure the direct route hooks into)."""
    import torch.distributed.distributed_c10d as c10d

    torchs = c10d.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        return torchs(tensor, op, group, async_op)

    c10d.all_reduce = all_reduce
    dist.all_reduce = all_reduce


def test_direct_route_stays_off_on_an_unexpected_all_reduce():
    for rank, seen in enumerate(_run(("test_torch_hooks", "fake_plain_all_reduce"))):
        state = seen["hooks"]["direct_route"]
        assert state.startswith("off: ") and "not an error logger's wrapper" in state, state
        assert "torch's route" in state, state
        assert seen["direct"] == 0, f"rank {rank}: a call took the direct route"
        assert seen["all_reduce"], f"rank {rank}: torch's route gave a wrong sum"
        others = {k: v for k, v in seen["hooks"].items() if k != "direct_route"}
        assert all(v.startswith("on (") for v in others.values()), others


def fake_all_reduce_with_its_parameters_reordered():
    """torch.distributed.all_reduce inside an error logger as torch's, around
    a function whose parameters come in another order."""
    import torch.distributed.distributed_c10d as c10d

    from tpcomm_fakes import logged

    torchs = c10d.all_reduce.__wrapped__

    def all_reduce(tensor, group=None, op=dist.ReduceOp.SUM, async_op=False):
        return torchs(tensor, op, group, async_op)

    c10d.all_reduce = logged(all_reduce)
    dist.all_reduce = c10d.all_reduce


def test_direct_route_stays_off_when_all_reduces_parameters_differ():
    for rank, seen in enumerate(_run(("test_torch_hooks", "fake_all_reduce_with_its_parameters_reordered"))):
        state = seen["hooks"]["direct_route"]
        assert state == ("off: torch's all_reduce takes (tensor, group, op, async_op), not "
                         "(tensor, op, group, async_op); all_reduce takes torch's route"), state
        assert seen["direct"] == 0 and seen["all_reduce"], seen


def fake_isend_without_group():
    """torch.distributed.isend without a `group` argument."""
    import torch.distributed.distributed_c10d as c10d

    from tpcomm_fakes import without_group

    c10d.isend = without_group(c10d.isend)
    dist.isend = c10d.isend


def fake_collectives_without_group():
    """Every function the front door wraps without a `group` argument, and
    torch's error logger without the look-up the front door hooks."""
    import torch.distributed.distributed_c10d as c10d

    from tpcomm_fakes import without_group

    for name in FRONT_DOOR:
        setattr(c10d, name, without_group(getattr(c10d, name)))
        setattr(dist, name, getattr(c10d, name))
    from torch.distributed import c10d_logger

    del c10d_logger._get_msg_dict


def test_front_door_leaves_an_unexpected_function_alone():
    for rank, seen in enumerate(_run(("test_torch_hooks", "fake_isend_without_group"))):
        state = seen["hooks"]["front_door"]
        assert "functions through torch's error logger, 4 wrapped); off for the rest: " \
               "torch.distributed.isend has no group argument" in state, state
        assert seen["front_door_wrapped"] == sorted(set(FRONT_DOOR) - {"isend"}), seen
        assert seen["all_gather"] and seen["all_to_all"] and seen["all_reduce"], seen
        assert seen["hooks"]["direct_route"].startswith("on ("), seen["hooks"]


def test_front_door_stays_off_when_nothing_is_as_expected():
    for rank, seen in enumerate(_run(("test_torch_hooks", "fake_collectives_without_group"))):
        state = seen["hooks"]["front_door"]
        reasons = "; ".join(["torch.distributed.c10d_logger has no _get_msg_dict"] + [
            f"torch.distributed.{name} has no "
            f"{'p2p_op_list' if name == 'batch_isend_irecv' else 'group'} argument"
            for name in FRONT_DOOR])
        assert state == f"off: {reasons}; refusals before tpcomm reach no peer", state
        assert seen["front_door_wrapped"] == [], seen
        assert seen["all_gather"] and seen["all_to_all"] and seen["all_reduce"], seen
        assert seen["direct"] == 1, seen


def test_gloo_connection_finder_checks_its_descriptor_folder(tmp_path):
    from tpcomm import _C

    assert _C._gloo_ground_of("/proc/self/fd") == ""
    missing = str(tmp_path / "no-such-folder")
    assert _C._gloo_ground_of(missing).startswith(f"{missing} cannot be read: ")
    (tmp_path / "empty").mkdir()
    why = _C._gloo_ground_of(str(tmp_path / "empty"))
    assert why == f"{tmp_path / 'empty'} does not list a TCP socket this process just opened", why
    # A folder whose names are descriptors of other things (this process's
    # standard streams) lists no TCP socket either.
    (tmp_path / "streams").mkdir()
    for fd in (0, 1, 2):
        os.symlink(f"/proc/self/fd/{fd}", tmp_path / "streams" / str(fd))
    assert "does not list" in _C._gloo_ground_of(str(tmp_path / "streams"))


def test_info_prints_every_hook():
    out = subprocess.run([sys.executable, "-m", "tpcomm.info"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "hooks into torch's internals" in out, out
    for name in HOOKS:
        line = next((line for line in out.splitlines() if line.strip().startswith(f"{name}:")), None)
        assert line is not None and line.split(":", 1)[1].strip().startswith("on ("), out
