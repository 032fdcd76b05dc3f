"""One-sided windows on tpcomm (torch 2.15's dist._new_window;
backend/window/tpcomm_window.hpp, message_queue/window/shm_window.hpp):
puts, signals and views of the peers' tensors among the ranks of one host,
checked against what each rank computes itself; every bad call refused on
the calling rank, naming what is wrong; a wait on a silent peer bounded and
naming it, one on a peer that exited ending at once. Not marked
torch_version: on the newest torch only (test_backend_hooks.py checks that
a build against an older torch says windows are off)."""

import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import error_message, first_answers

N = 96  # elements of each rank's window


def _expected(rank, size, dtype):
    """What rank `rank`'s window holds once its left neighbour put its
    block: its own values, the block of the left neighbour at its place."""
    left = (rank - 1) % size
    mine = (torch.arange(N, dtype=torch.float64) + 1000 * rank)
    mine[16 * left:16 * left + 16] = torch.arange(16, dtype=torch.float64) - 500 * left
    return mine.to(dtype)


def _ring(ctx, dtype_name):
    """Each rank puts a block into its right neighbour's window at its own
    place, signals it, waits for its left neighbour's signal, and reads its
    window; then every rank's view of every window."""
    dtype = getattr(torch, dtype_name)
    g = dist.new_group(backend="tpcomm")
    rank, size = ctx.rank, ctx.world_size
    mine = (torch.arange(N, dtype=torch.float64) + 1000 * rank).to(dtype)
    window = dist._new_window(mine, group=g)
    right, left = (rank + 1) % size, (rank - 1) % size
    block = (torch.arange(16, dtype=torch.float64) - 500 * rank).to(dtype)
    window.put(block, right, 16 * rank, False)
    window.signal(right, False)
    window.wait_signal(left, False)
    ok_local = torch.equal(mine, _expected(rank, size, dtype))
    dist.barrier(group=ctx.ref)  # every put done everywhere
    views = [torch.equal(window.map_remote_tensor(r), _expected(r, size, dtype))
             for r in range(size)]
    attr = str(window.get_attr(right).access_type)
    del window
    dist.barrier(group=ctx.ref)
    dist.destroy_process_group(g)
    return ok_local, views, attr


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64"])
@pytest.mark.parametrize("size", [2, 3])
def test_puts_and_signals_around_a_ring_match_what_each_rank_computes(groups, size, dtype):
    for rank, (ok_local, views, attr) in enumerate(groups(size).run(_ring, dtype)):
        assert ok_local, rank
        assert views == [True] * size, (rank, views)
        assert attr.endswith("UNIFIED"), attr


def _view(ctx):
    """A view of a larger tensor registered: the peer's put lands in it, the
    rest of the storage is untouched and shared too; put/signal/wait in a
    loop count each signal once."""
    g = dist.new_group(backend="tpcomm")
    base = torch.full((64,), -1.0)
    view = base[8:40]
    window = dist._new_window(view, group=g)
    peer = 1 - ctx.rank
    window.put(torch.full((4,), float(ctx.rank + 1)), peer, 2, False)
    window.signal(peer, False)
    window.wait_signal(peer, False)
    # Each of 200 signals waited for once, in order.
    for i in range(200):
        window.put(torch.full((1,), float(i)), peer, 0, False)
        window.signal(peer, False)
        window.wait_signal(peer, False)
        assert view[0].item() == float(i), (i, view[0].item())
        dist.barrier(group=ctx.ref)  # the peer read it before the next put
    remote = window.map_remote_tensor(peer)
    out = (base[:8].tolist(), base[8:14].tolist(), base[40:].tolist(), tuple(remote.shape),
           base.data_ptr() == view.data_ptr() - 8 * 4)
    del window, remote
    dist.barrier(group=ctx.ref)
    dist.destroy_process_group(g)
    return out


def test_a_view_registered_shares_its_storage_and_each_signal_is_waited_for_once(groups):
    for rank, (before, start, after, shape, same) in enumerate(groups(2).run(_view)):
        peer = 1 - rank
        assert before == [-1.0] * 8 and after == [-1.0] * 24, (before, after)
        assert start == [199.0, -1.0] + [float(peer + 1)] * 4, start
        assert shape == (32,) and same, (shape, same)


def _misuse(ctx):
    g = dist.new_group(backend="tpcomm")
    peer = 1 - ctx.rank
    empty = dist._new_window(group=g)
    out = {"supports": dist._supports_window(g),
           "unregistered": error_message(lambda: empty.put(torch.ones(2), peer, 0, False))}
    mine = torch.zeros(16)
    empty.tensor_register(mine)
    window = empty
    bad = {
        "past": lambda: window.put(torch.ones(8), peer, 12, False),
        "negative": lambda: window.put(torch.ones(1), peer, -1, False),
        "dtype": lambda: window.put(torch.ones(2, dtype=torch.float64), peer, 0, False),
        "rank": lambda: window.put(torch.ones(2), 2, 0, False),
        "strided": lambda: window.put(torch.ones(4, 2)[:, 0], peer, 0, False),
        "twice": lambda: window.tensor_register(torch.zeros(4)),
        "map": lambda: window.map_remote_tensor(5),
        "signal": lambda: window.signal(-1, False),
        "conj": lambda: window.put(torch.ones(2, dtype=torch.complex64).conj(), peer, 0, False),
    }
    for name, call in bad.items():
        out[name] = error_message(call)
    # A wait for a peer that sends nothing: bounded by the options' timeout,
    # naming it.
    opts = torch._C._distributed_c10d.WaitSignalOptions()
    opts.timeout = timedelta(milliseconds=300)
    start = time.monotonic()
    out["silent"] = error_message(lambda: window.wait_signal(peer, False, opts))
    out["silent_s"] = time.monotonic() - start
    dist.barrier(group=ctx.ref)  # both waits ended before either signals
    # Nothing was sent: the window still works.
    window.put(torch.full((2,), 7.0), peer, 3, False)
    window.signal(peer, False)
    window.wait_signal(peer, False)
    out["after"] = mine[3:5].tolist()
    dist.barrier(group=ctx.ref)
    window.tensor_deregister()
    out["deregistered"] = error_message(lambda: window.signal(peer, False))
    dist.barrier(group=ctx.ref)
    dist.destroy_process_group(g)
    return out


def test_bad_window_calls_are_refused_naming_what_is_wrong(groups):
    for rank, out in enumerate(groups(2).run(_misuse)):
        peer = 1 - rank
        assert out["supports"] is True, out
        assert "no tensor is registered" in out["unregistered"], out
        assert f"8 elements at offset 12 run past rank {peer}'s window of 16" in out["past"], out
        assert "offset -1 is negative" in out["negative"], out
        assert "resolve_conj() or resolve_neg() it first" in out["conj"], out
        assert f"a Double tensor into rank {peer}'s Float window" in out["dtype"], out
        assert "rank 2 is not one of the group's 2 ranks" in out["rank"], out
        assert "contiguous CPU tensor" in out["strided"], out
        assert "a tensor is registered already" in out["twice"], out
        assert "rank 5 is not one of" in out["map"] and "rank -1 is not one of" in out["signal"]
        assert f"rank {peer} sent no signal within 300 ms" in out["silent"], out
        assert "DistBackendError" in out["silent"] and out["silent_s"] < 5, out
        assert out["after"] == [7.0, 7.0], out
        assert "no tensor is registered" in out["deregistered"], out


def _reregister(ctx):
    """A registration that fails on one rank (a strided tensor on rank 1)
    raises on both at once; both register again and the window works; it
    is deregistered and registered with another tensor; a view taken
    before stays readable."""
    g = dist.new_group(backend="tpcomm")
    peer = 1 - ctx.rank
    window = dist._new_window(group=g)
    bad = torch.zeros(8, 2)[:, 0] if ctx.rank == 1 else torch.zeros(8)
    start = time.monotonic()
    failed = error_message(lambda: window.tensor_register(bad))
    failed_s = time.monotonic() - start
    first = torch.zeros(8)
    window.tensor_register(first)
    window.put(torch.full((2,), 3.0), peer, 1, False)
    window.signal(peer, False)
    window.wait_signal(peer, False)
    view = window.map_remote_tensor(peer)
    dist.barrier(group=ctx.ref)
    window.tensor_deregister()
    second = torch.zeros(4, dtype=torch.int32)
    window.tensor_register(second)
    window.put(torch.full((1,), 9, dtype=torch.int32), peer, 3, False)
    window.signal(peer, False)
    window.wait_signal(peer, False)
    out = (failed, failed_s, first.tolist(), second.tolist(), view.tolist())
    dist.barrier(group=ctx.ref)
    del window, view
    dist.destroy_process_group(g)
    return out


def test_a_failed_registration_raises_on_every_rank_and_a_window_registers_again(groups):
    for rank, (failed, failed_s, first, second, view) in enumerate(groups(2).run(_reregister)):
        if rank == 1:
            assert "the tensor must be dense and contiguous" in failed, failed
        else:
            assert "rank 1 could not register: " in failed, failed
            assert "the tensor must be dense and contiguous" in failed, failed
        assert failed_s < 10, failed_s
        assert first == [0.0, 3.0, 3.0] + [0.0] * 5, first
        assert second == [0, 0, 0, 9], second
        # The peer's first tensor, as it was when this rank deregistered.
        assert view == [0.0, 3.0, 3.0] + [0.0] * 5, view


def _lose_peer(rank, port, env, conn):
    try:
        os.environ.clear()
        os.environ.update(env)
        import tpcomm  # noqa: F401

        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("tpcomm", store=store, rank=rank, world_size=2,
                                timeout=timedelta(seconds=30))
        window = dist._new_window(torch.zeros(8))
        dist.barrier()
        if rank == 1:
            conn.send(("killed", time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        failure = error_message(lambda: window.wait_signal(1, False))
        conn.send(("ok", (failure, time.time())))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        conn.send(("error", traceback.format_exc() + f"\n{type(e).__name__}: {e}"))


def test_a_wait_on_a_peer_that_exited_ends_at_once_naming_it():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    answers = first_answers(_lose_peer, [(r, store.port) for r in range(2)], timeout_s=120)
    assert answers[1] is not None and answers[1][0] == "killed", answers
    assert answers[0] is not None and answers[0][0] == "ok", answers
    failure, at = answers[0][1]
    print(f"rank 0 after {at - answers[1][1]:.2f} s: {failure}")
    # The group's 30 s timeout is not what ended it.
    assert at - answers[1][1] < 5, at - answers[1][1]
    assert "wait_signal" in failure and "rank 1" in failure, failure


def test_the_window_benchmark_prints_its_figures():
    """python -m tpcomm.bench window --quick: the 4 B round against an
    allreduce and each put size against a copy, with the CPU named (the
    figures are the benchmark's, docs/benchmarks.md; not asserted here)."""
    out = subprocess.run([sys.executable, "-m", "tpcomm.bench", "window", "--quick", "--rounds",
                          "1"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    assert out.stdout.startswith("CPU: "), out.stdout
    assert re.search(r"4 B put \+ signal \+ wait_signal, one way: [\d.]+ us; 4 B all_reduce: "
                     r"[\d.]+ us; ratio [\d.]+", out.stdout), out.stdout
    for nbytes in (65536, 1048576, 4194304, 16777216):
        assert re.search(rf"^\s+{nbytes}\s+[\d.]+\s+[\d.]+\s+[\d.]+$", out.stdout, re.M), out.stdout
