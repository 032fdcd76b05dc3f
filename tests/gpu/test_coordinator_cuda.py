"""GroupCoordinator on CUDA tensors at world size 1 (NCCL refuses two ranks
on one GPU): the custom op routed to NCCL, capture in a CUDA graph inside
graph_capture() with fresh inputs on every replay, and the demo's graph path."""

import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import tpcomm

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU on this machine: CUDA coordinator tests need one",
                allow_module_level=True)


@pytest.fixture(scope="module")
def coordinator():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    c = tpcomm.GroupCoordinator([[0]], local_rank=0, group_name="cuda_test")
    yield c
    c.destroy()
    dist.destroy_process_group()


def test_device_defaults_to_the_local_gpu(coordinator):
    assert coordinator.device == torch.device("cuda", 0)


def test_custom_op_on_cuda_goes_to_nccl(coordinator):
    tpcomm.reset_stats(coordinator)
    x = torch.randn(1000, device="cuda")
    y = torch.ops.tpcomm.all_reduce(x, coordinator.unique_name)
    assert y.data_ptr() != x.data_ptr() and torch.equal(y, x)
    s = tpcomm.stats(coordinator)
    assert s["nccl"] == {"calls": 1, "bytes": 4000} and s["gloo"]["calls"] == 0


def test_graph_capture_replays_with_fresh_inputs(coordinator):
    name = coordinator.unique_name
    static_in = torch.zeros(4096, device="cuda")
    torch.ops.tpcomm.all_reduce(static_in, name)  # warm-up: NCCL exists before capture
    torch.cuda.synchronize()
    with coordinator.graph_capture() as ctx:
        assert torch.cuda.current_stream() == ctx.stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=ctx.stream):
            static_out = torch.ops.tpcomm.all_reduce(static_in * 2, name) + 1
    for i in range(1000):
        fresh = torch.randn(4096, device="cuda") + i
        static_in.copy_(fresh)
        graph.replay()
        if i % 97 == 0 or i == 999:
            assert torch.equal(static_out, fresh * 2 + 1), i


def test_demo_replays_a_cuda_graph_and_passes_its_check():
    out = subprocess.run([sys.executable, "-m", "tpcomm.demo", "--tp", "1", "--steps", "24",
                          "--device", "cuda"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "CUDA graph replays" in out.stdout and out.stdout.rstrip().endswith("OK")


def test_cuda_tensors_take_the_direct_route(coordinator):
    """dist.all_reduce and GroupCoordinator.all_reduce on a CUDA tensor of a
    tpcomm group go straight to the backend (python/fast_calls.cpp), sync and
    async, with torch's route's results."""
    from tpcomm import _fast_calls

    x = torch.randn(1000, device="cuda")
    before = _fast_calls.calls_taken()
    direct = x.clone()
    assert dist.all_reduce(direct) is None
    work = dist.all_reduce(direct, async_op=True)
    work.wait()
    out = coordinator._all_reduce_op(x)
    assert _fast_calls.calls_taken() == before + 3
    via_torch = x.clone()
    _fast_calls.torch_route()(via_torch)
    assert _fast_calls.calls_taken() == before + 3
    torch.cuda.synchronize()
    assert torch.equal(direct, via_torch) and torch.equal(out, x)
