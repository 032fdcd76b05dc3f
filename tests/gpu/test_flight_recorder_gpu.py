"""The custom kernel's calls in torch's flight recorder: 2 processes sharing
this GPU through CUDA IPC (NCCL refuses two ranks on one GPU). Entries against
the calls made, across ranks; torchfrtrace over the dumps of a run in which
rank 1 skips a call."""

import os
import pickle
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU on this machine: the custom kernel's recording needs one",
                allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))
from harness import Group  # noqa: E402

ENV = {"TPCOMM_CAR_MAX_BYTES": str(1 << 20), "TPCOMM_CAR_TIMEOUT_MS": "2000"}


def _rows(dump, group):
    return [(e["profiling_name"], e["collective_seq_id"], e["state"], e["input_sizes"],
             e["input_dtypes"]) for e in dump["entries"] if e["process_group"][0] == group]


def _custom_calls(ctx):
    import torch.distributed as dist
    torch.cuda.set_device(0)
    group = dist.new_group(backend="tpcomm")
    x = torch.ones(1024, device="cuda") * (ctx.rank + 1)
    for _ in range(3):
        dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 12.0))  # (1 + 2) * 2 * 2
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    return _rows(dump, group.group_name)


def test_custom_kernel_calls_are_recorded_with_agreeing_sequence_ids():
    group = Group(2, env=ENV, extra_paths=[HERE], start_timeout_s=240)
    try:
        results = group.run(_custom_calls, timeout_s=300)
    finally:
        group.close()
    print(results)
    for rows in results:
        assert [r[0] for r in rows] == ["nccl:all_reduce tpcomm/custom_oneshot"] * 3, rows
        assert [r[1] for r in rows] == [1, 2, 3], rows
        assert all(r[2] == "completed" for r in rows), rows
        assert rows[0][3] == [[1024]] and rows[0][4] == ["Float"], rows


def _skips_a_call(ctx, prefix):
    import torch.distributed as dist
    torch.cuda.set_device(0)
    group = dist.new_group(backend="tpcomm")
    x = torch.ones(1024, device="cuda")
    error = None
    for i in range(3):
        if ctx.rank == 1 and i == 2:
            continue  # rank 1 skips the third all_reduce
        dist.all_reduce(x, group=group)
    torch.cuda.synchronize()  # rank 0's third kernel gives up after the timeout
    if ctx.rank == 0:
        try:
            dist.all_reduce(x, group=group)
            torch.cuda.synchronize()
        except RuntimeError as e:
            error = str(e)
    with open(f"{prefix}{ctx.rank}", "wb") as f:
        f.write(torch._C._distributed_c10d._dump_fr_trace())
    dist.barrier(group=ctx.ref)
    return error


def test_torchfrtrace_names_the_call_a_rank_skipped_on_the_custom_kernel(tmp_path):
    prefix = str(tmp_path / "trace_")
    group = Group(2, env=ENV, extra_paths=[HERE], start_timeout_s=240)
    try:
        errors = group.run(_skips_a_call, prefix, timeout_s=300)
    finally:
        group.close(kill=True)
    assert errors[0] is not None and "rank 1 did not arrive" in errors[0], errors
    tool = os.path.join(os.path.dirname(sys.executable), "torchfrtrace")
    if not os.path.exists(tool):
        tool = "torchfrtrace"
    out = subprocess.run([tool, str(tmp_path), "-p", "trace_"], capture_output=True, text=True,
                         timeout=120)
    report = out.stdout + out.stderr
    print(report)
    assert out.returncode == 0, report
    assert "tpcomm/custom_oneshot" in report, report
    assert "sequence number: 3" in report, report
