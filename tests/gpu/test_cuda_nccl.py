"""CUDA tensors through backend "tpcomm": they go to torch's NCCL, created on
the first CUDA call. NCCL refuses two ranks on one GPU, so these run at world
size 1 (the multi-rank GPU paths come with the custom allreduce)."""

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import tpcomm  # noqa: F401

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU on this machine: CUDA routing tests need one",
                allow_module_level=True)

R = dist.ReduceOp


@pytest.fixture(scope="module")
def world():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, timeout=timedelta(seconds=60))
    yield dist.group.WORLD
    dist.destroy_process_group()


def backend(pg):
    return pg._get_backend(torch.device("cuda"))


def test_device_backend_is_created_on_first_cuda_call(world):
    x = torch.ones(4)
    dist.all_reduce(x)
    assert not backend(world).device_backend_created
    y = torch.ones(4, device="cuda")
    dist.all_reduce(y)
    assert backend(world).device_backend_created
    assert torch.equal(y.cpu(), torch.ones(4))


def test_every_collective_on_cuda(world):
    dev = torch.device("cuda")
    for dtype in [torch.float32, torch.bfloat16, torch.float16, torch.int64]:
        x = torch.arange(10, device=dev).to(dtype)
        for op in [R.SUM, R.MAX, R.MIN, R.PRODUCT]:
            y = x.clone()
            dist.all_reduce(y, op=op)
            assert torch.equal(y, x)
        if dtype.is_floating_point:
            y = x.clone()
            dist.all_reduce(y, op=R.AVG)
            assert torch.equal(y, x)
    x = torch.randn(6, device=dev)
    out = torch.empty(6, device=dev)
    dist.all_gather_into_tensor(out, x)
    assert torch.equal(out, x)
    lst = [torch.empty(6, device=dev)]
    dist.all_gather(lst, x)
    assert torch.equal(lst[0], x)
    rs = torch.empty(6, device=dev)
    dist.reduce_scatter_tensor(rs, x)
    assert torch.equal(rs, x)
    b = x.clone()
    dist.broadcast(b, src=0)
    assert torch.equal(b, x)
    a2a = torch.empty(6, device=dev)
    dist.all_to_all_single(a2a, x)
    assert torch.equal(a2a, x)
    outs = [torch.empty(3, device=dev)]
    dist.all_to_all(outs, [x[:3].clone()])
    assert torch.equal(outs[0], x[:3])
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    assert work.get_future().wait()[0].device.type == "cuda"
    dist.barrier()


def test_premul_sum_matches_plain_nccl(world):
    """tpcomm hands PREMUL_SUM to NCCL unchanged: same result as plain NCCL."""
    ref = dist.new_group(backend="nccl")
    for factor in [2.0, torch.tensor([2.0], device="cuda")]:
        for async_op in [False, True]:
            x = torch.arange(10, device="cuda", dtype=torch.float32)
            ours, theirs = x.clone(), x.clone()
            w = dist.all_reduce(ours, op=dist._make_nccl_premul_sum(factor), async_op=async_op)
            v = dist.all_reduce(theirs, op=dist._make_nccl_premul_sum(factor), group=ref,
                                async_op=async_op)
            if async_op:
                w.wait()
                v.wait()
            torch.cuda.synchronize()
            assert torch.equal(ours, theirs), (factor, async_op, ours, theirs)
    dist.destroy_process_group(ref)


def test_all_reduce_in_cuda_graph_replays(world):
    x = torch.zeros(1024, device="cuda")
    dist.all_reduce(x)  # warm-up: NCCL communicator exists before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            x.mul_(2)
            dist.all_reduce(x)
            x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    for i in range(20):
        x.fill_(float(i))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(x, torch.full_like(x, 2.0 * i + 1))


def test_ddp_on_cuda(world):
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).cuda()
    ddp = DDP(model, device_ids=[0])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        loss = ddp(torch.randn(16, 8, device="cuda")).pow(2).mean()
        loss.backward()
        opt.step()
    assert torch.isfinite(loss)


def test_wrong_device_tensors_are_refused(world):
    be = backend(world)
    with pytest.raises(RuntimeError, match="tensors of one call must be on one device"):
        be._allgather_base(torch.empty(4, device="cuda"), torch.ones(4))
