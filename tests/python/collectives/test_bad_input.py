"""Wrong calls raise errors that name what is wrong, never hang or return a
wrong answer; a rank that never joins makes the others raise within the
group's timeout."""

import time

import pytest
import torch
import torch.distributed as dist

from harness import Group, RankFailure, error_message

R = dist.ReduceOp




def _symmetric_bad_calls(ctx):
    """Every rank makes the same bad call, so none is left waiting."""
    w = ctx.world_size
    x = torch.ones(4)
    group = dist.group.WORLD
    cases = {
        "bitwise_on_float": lambda: dist.all_reduce(x, op=R.BAND),
        "premul_on_int": lambda: dist.all_reduce(
            torch.ones(4, dtype=torch.int32), op=dist._make_nccl_premul_sum(2.0)),
        "avg_on_bool": lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool), op=R.AVG),
        "gather_list_length": lambda: dist.all_gather([torch.empty(4)] * (w + 1), x),
        "into_tensor_size": lambda: dist.all_gather_into_tensor(torch.empty(4 * w + 1), x),
        "mixed_dtypes": lambda: dist.all_gather_into_tensor(
            torch.empty(4 * w, dtype=torch.float64), x),
        "split_sizes": lambda: dist.all_to_all_single(
            torch.empty(4), torch.ones(4), [5] + [0] * (w - 1), [4] + [0] * (w - 1)),
        "split_count": lambda: dist.all_to_all_single(
            torch.empty(4), torch.ones(4), [4] * (w + 1), [4] * (w + 1)),
        "non_contiguous": lambda: dist.all_reduce(torch.ones(4, 3).t()),
        # torch's dispatcher gives meta tensors a no-op kernel before any
        # backend is reached; the backend's own check is exercised directly.
        "meta_device": lambda: group._get_backend(torch.device("cpu")).allreduce(
            [torch.empty(4, device="meta")]),
        "root_out_of_range": lambda: group.broadcast(x, w + 3),
        "reduce_scatter_list": lambda: dist.reduce_scatter(
            torch.empty(4), [torch.ones(4)] * (w + 2)),
        "all_to_all_lists": lambda: dist.all_to_all([torch.empty(1)] * w,
                                                     [torch.ones(1)] * (w + 1)),
    }
    messages = {name: error_message(call) for name, call in cases.items()}
    # The group is still healthy afterwards: nothing was half-sent.
    y = torch.ones(3)
    dist.all_reduce(y)
    assert torch.equal(y, torch.full((3,), float(w)))
    return messages


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_bad_calls_name_what_is_wrong(groups, world_size):
    w = world_size
    expected = {
        "bitwise_on_float": "allreduce: ReduceOp.BAND needs an integer or bool tensor, got float32",
        "premul_on_int": "PREMUL_SUM needs a floating-point tensor, got int32",
        "avg_on_bool": "ReduceOp.AVG is not defined for bool tensors",
        "gather_list_length": f"allgather: output tensor list has {w + 1} entries, expected {w}",
        "into_tensor_size": f"the output has {4 * w + 1} elements, expected {4 * w}",
        "mixed_dtypes": "has dtype float64 but the call's dtype is float32",
        "split_sizes": "output_split_sizes sum to 5 but the tensor has 4 rows",
        "split_count": f"input_split_sizes has {w + 1} entries, expected {w}",
        "non_contiguous": "is not contiguous",
        "meta_device": "tensors[0] is on device meta; tpcomm handles cpu and cuda tensors",
        "root_out_of_range": f"root rank {w + 3} is out of range for a group of size {w}",
        "reduce_scatter_list": f"the input list has {w + 2} entries, expected {w}",
        "all_to_all_lists": f"input_tensor_list has {w + 1} entries, expected {w}",
    }
    for messages in groups(world_size).run(_symmetric_bad_calls):
        for name, text in expected.items():
            assert messages[name] is not None, f"{name}: no error raised"
            assert text in messages[name], f"{name}: {messages[name]!r} lacks {text!r}"


def _python_front_door_checks(ctx):
    x = torch.ones(2)
    return {
        "broadcast_src": error_message(lambda: dist.broadcast(x, src=ctx.world_size + 5)),
        "send_dst": error_message(lambda: dist.send(x, dst=ctx.world_size + 5)),
    }


def test_rank_out_of_range_through_torch_api(groups):
    for messages in groups(2).run(_python_front_door_checks):
        for name, msg in messages.items():
            assert msg is not None and "7" in msg, f"{name}: {msg!r}"


# ---------------------------------------------------------------- TPCOMM_DEBUG
def _debug_shape_mismatch(ctx):
    be = dist.group.WORLD._get_backend(torch.device("cpu"))
    assert be.debug_checks
    x = torch.ones(5 if ctx.rank == 1 else 4)
    msg = error_message(lambda: dist.all_reduce(x))
    op_msg = error_message(lambda: dist.all_reduce(torch.ones(2)) if ctx.rank == 0
                      else dist.broadcast(torch.ones(2), src=0))
    y = torch.ones(2)
    dist.all_reduce(y)  # still usable: the mismatched calls were never issued
    assert torch.equal(y, torch.full((2,), float(ctx.world_size)))
    return msg, op_msg


def test_debug_mode_names_ranks_and_shapes():
    group = Group(3, env={"TPCOMM_DEBUG": "1"})
    try:
        results = group.run(_debug_shape_mismatch)
    finally:
        group.close()
    for shape_msg, op_msg in results:
        assert "TPCOMM_DEBUG: ranks disagree" in shape_msg, shape_msg
        assert "ranks 0,2 called allreduce SUM float32[4]" in shape_msg, shape_msg
        assert "rank 1 called allreduce SUM float32[5]" in shape_msg, shape_msg
        assert "rank 0 called allreduce SUM float32[2]" in op_msg, op_msg
        assert "ranks 1,2 called broadcast root=0 float32[2]" in op_msg, op_msg


def _debug_off_by_default(ctx):
    return dist.group.WORLD._get_backend(torch.device("cpu")).debug_checks


def test_debug_mode_is_off_by_default(groups):
    assert groups(2).run(_debug_off_by_default) == [False, False]


# ---------------------------------------------------------------- missing ranks
def _one_rank_never_joins(ctx):
    if ctx.rank != 0:
        time.sleep(8)  # never joins within rank 0's timeout
        return None
    start = time.monotonic()
    msg = error_message(lambda: dist.all_reduce(torch.ones(4)))
    return msg, time.monotonic() - start


def test_missing_rank_raises_within_timeout():
    group = Group(2, pg_timeout_s=3)
    try:
        results = group.run(_one_rank_never_joins, timeout_s=60)
    finally:
        group.close(kill=True)
    msg, elapsed = results[0]
    assert msg is not None and msg.startswith("DistBackendError"), msg
    assert "tpcomm: allreduce on group" in msg and "failed" in msg, msg
    assert 2.5 <= elapsed < 15, elapsed


def _monitored_barrier_missing(ctx):
    from datetime import timedelta
    if ctx.rank != 0:
        time.sleep(6)
        return None
    return error_message(lambda: dist.monitored_barrier(timeout=timedelta(seconds=2),
                                                   wait_all_ranks=True))


def test_monitored_barrier_names_the_missing_rank():
    group = Group(3, pg_timeout_s=5)
    try:
        results = group.run(_monitored_barrier_missing, timeout_s=60)
    finally:
        group.close(kill=True)
    msg = results[0]
    assert msg is not None and "monitoredBarrier" in msg, msg
    assert "1" in msg and "2" in msg, msg


def test_harness_reports_a_failing_rank(groups):
    with pytest.raises(RankFailure, match="rank 1"):
        groups(2).run(_fails_on_rank_one)


def _fails_on_rank_one(ctx):
    assert ctx.rank != 1, "deliberate"
    return True
