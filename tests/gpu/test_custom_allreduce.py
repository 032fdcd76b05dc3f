"""The custom allreduce kernels on a GPU: (a) N = 2..8 ranks on N streams of
one process, every dtype, sizes from 0 through odd counts to the maximum,
against a reference summed in rank order (bitwise) and in float64, outputs
poisoned first; (b) 2 and 4 processes sharing the GPU through IPC; (c) capture
in a CUDA graph and 1,000 replays on fresh inputs; (d) a withheld rank: the
others raise within the timeout and the group works again after reset()."""

import multiprocessing as mp
import socket
import time
import traceback

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU on this machine: custom allreduce kernels need one",
                allow_module_level=True)

import tpcomm  # noqa: E402
from tpcomm.custom_allreduce import LocalGroup  # noqa: E402
from car_reference import inputs, rank_order_sum  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MAX_BYTES = 1 << 20


def _sizes(dtype):
    per_pack = 16 // torch.tensor([], dtype=dtype).element_size()
    most = MAX_BYTES // torch.tensor([], dtype=dtype).element_size()
    return [0, 1, per_pack - 1, per_pack, per_pack + 1, 31, 1000, 4097, 65537, most - 3, most]


@pytest.fixture(scope="module")
def local_groups():
    groups = {n: LocalGroup(n, max_bytes=MAX_BYTES, timeout_ms=5000) for n in range(2, 9)}
    yield groups
    torch.cuda.synchronize()


@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot"])
def test_streams_in_one_process_match_the_reference(local_groups, n, algorithm):
    group = local_groups[n]
    for dtype in DTYPES:
        for count in _sizes(dtype):
            xs = inputs(n, count, seed=count + n, dtype=dtype)
            outs = [torch.full_like(x, float("nan")) for x in xs]
            group.all_reduce(xs, outs, algorithm=algorithm)
            group.check()
            want = rank_order_sum(xs)
            exact = sum(x.double() for x in xs) if count else torch.zeros(0, dtype=torch.double)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            for r, out in enumerate(outs):
                where = f"n={n} {algorithm} {dtype} count={count} rank {r}"
                assert torch.equal(out, want), where  # also: no NaN poison left
                assert torch.allclose(out.double(), exact.cuda(), atol=tol * n, rtol=tol), where


def test_in_place_and_default_choice(local_groups):
    group = local_groups[4]
    xs = inputs(4, 300_000, seed=5, dtype=torch.bfloat16)  # 600 KB: two-shot at 4 ranks
    want = rank_order_sum(xs)
    group.all_reduce(xs, xs)
    group.check()
    for x in xs:
        assert torch.equal(x, want)


def test_withheld_rank_raises_within_the_timeout_then_recovers():
    group = LocalGroup(2, max_bytes=MAX_BYTES, timeout_ms=200)
    xs = inputs(2, 1024, seed=1, dtype=torch.float32)
    start = time.monotonic()
    group.all_reduce(xs, ranks=[0])  # rank 1 never launches
    with pytest.raises(TimeoutError, match="rank 1 did not arrive"):
        group.check()
    assert time.monotonic() - start < 5
    with pytest.raises(tpcomm.PeerLostError, match="an earlier call failed"):
        group.all_reduce(xs)
    group.reset()
    outs = group.all_reduce(xs)
    group.check()
    assert all(torch.equal(o, xs[0] + xs[1]) for o in outs)


# ---------------------------------------------------------------- processes
def _ipc_worker(rank, n, port, conn):
    try:
        import torch.distributed as dist

        from tpcomm.custom_allreduce import IpcCommunicator

        torch.cuda.set_device(0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n)
        comm = IpcCommunicator.create(max_bytes=MAX_BYTES, timeout_ms=5000)
        assert comm.eligible, comm.reason
        for dtype in DTYPES:
            most = MAX_BYTES // torch.tensor([], dtype=dtype).element_size()
            for count in (1, 7, 1000, 65537, most):
                xs = inputs(n, count, seed=count, dtype=dtype)
                out = comm.all_reduce(xs[rank])
                comm.check()
                assert torch.equal(out, rank_order_sum(xs)), (dtype, count)
        # Graph capture: 1,000 replays, each on new inputs.
        static = torch.zeros(4096, device="cuda")
        out = torch.empty_like(static)
        comm.all_reduce(static, out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            comm.all_reduce(static, out)
        base = torch.arange(4096, device="cuda", dtype=torch.float32)
        for i in range(1000):
            static.copy_(base * (rank + 1) + i)
            graph.replay()
            if i % 50 == 0 or i == 999:
                torch.cuda.synchronize()
                want = base * (n * (n + 1) / 2) + n * i
                assert torch.equal(out, want), i
        comm.check()
        dist.barrier()
        dist.destroy_process_group()
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


@pytest.mark.parametrize("n", [2, 4])
def test_processes_sharing_the_gpu_through_ipc_and_graph_replays(n):
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pipes = [ctx.Pipe() for _ in range(n)]
    procs = [ctx.Process(target=_ipc_worker, args=(r, n, port, pipes[r][1])) for r in range(n)]
    for p in procs:
        p.start()
    failures = []
    for r, (parent, _) in enumerate(pipes):
        if not parent.poll(240):
            failures.append(f"rank {r}: no answer within 240 s")
            continue
        status, text = parent.recv()
        if status != "ok":
            failures.append(f"rank {r}:\n{text}")
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert not failures, "\n".join(failures)
