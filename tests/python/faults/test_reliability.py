"""Reliability: teardown never deadlocks, subgroups keep the job's timeout,
TPCOMM_DEBUG catches all-to-all, send/recv and one-rank mistakes and survives threads,
unsupported dtypes and sparse tensors are handled up front."""

import multiprocessing as mp
import os
import threading
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import Group, error_message

TEARDOWN_ROUNDS = 20


def _teardown_rank(rank, store_dir, conn):
    """The probe that deadlocked: keep the group's backend, destroy the
    group, start an allreduce on the saved backend that is still in flight
    (the peer arrives later), drop the backend."""
    os.environ["TPCOMM_CPU_SHM"] = "0"  # the allreduce goes to Gloo's worker thread
    try:
        import tpcomm  # noqa: F401

        for i in range(TEARDOWN_ROUNDS):
            dist.init_process_group("tpcomm", init_method=f"file://{store_dir}/round{i}",
                                    rank=rank, world_size=2, timeout=timedelta(seconds=20))
            backend = dist.group.WORLD._get_backend(torch.device("cpu"))
            dist.destroy_process_group()
            if rank == 1:
                time.sleep(0.1)
            backend.allreduce([torch.ones(1000)])
            del backend
        conn.send("ok")
    except BaseException as e:  # noqa: BLE001 - reported to the test
        conn.send(f"{type(e).__name__}: {e}")


def test_teardown_with_work_in_flight_never_deadlocks(tmp_path):
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_teardown_rank, args=(r, str(tmp_path), pipes[r][1]), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} hung in teardown"
    results = [pipes[r][0].recv() if pipes[r][0].poll(1) else "no answer" for r in range(2)]
    assert results == ["ok", "ok"], results


# ---------------------------------------------------------------- timeouts
def _subgroup_timeouts(ctx):
    import tpcomm

    tpcomm.init_distributed_environment()
    tpcomm.initialize_model_parallel(tensor_model_parallel_size=ctx.world_size)
    try:
        tp = tpcomm.get_tp_group()
        cpu = torch.device("cpu")
        seen = [tp.device_group._get_backend(cpu).options._timeout,
                tpcomm.get_world_group().device_group._get_backend(cpu).options._timeout]
        # One rank leaves the collective out: its peer raises within about
        # the job's timeout (3 s), not torch's 30-minute subgroup default.
        start = time.monotonic()
        error = None
        if ctx.rank == 0:
            try:
                tp.all_reduce(torch.ones(4))
            except Exception as e:  # noqa: BLE001
                error = type(e).__name__
        else:
            time.sleep(8)
        return seen, error, time.monotonic() - start
    finally:
        tpcomm.destroy_model_parallel()
        tpcomm.destroy_distributed_environment()


def test_subgroups_inherit_the_default_groups_timeout():
    group = Group(2, pg_timeout_s=3)
    try:
        results = group.run(_subgroup_timeouts, timeout_s=60)
    finally:
        group.close(kill=True)
    for seen, _, _ in results:
        assert seen == [timedelta(seconds=3)] * 2
    _, error, took = results[0]
    assert error is not None and took < 6.0, (error, took)


# ---------------------------------------------------------------- TPCOMM_DEBUG


def _run_debug(world_size, fn, pg_timeout_s, timeout_s):
    """fn's per-rank results on a fresh TPCOMM_DEBUG=1 group."""
    group = Group(world_size, env={"TPCOMM_DEBUG": "1"}, pg_timeout_s=pg_timeout_s)
    try:
        return group.run(fn, timeout_s=timeout_s)
    finally:
        group.close()


def _allreduce_ones():
    """An allreduce of ones, which a group that is still usable sums."""
    y = torch.ones(3)
    dist.all_reduce(y)
    return y.tolist()


def _debug_mismatches(ctx):
    w, r = ctx.world_size, ctx.rank
    out = {}
    # all_to_all_single: rank 0 sends one row too many to rank 1.
    in_splits = [1] * w
    if r == 0:
        in_splits[1] = 2
    x = torch.ones(sum(in_splits), 3)
    out["a2a_single"] = error_message(lambda: dist.all_to_all_single(
        torch.empty(w, 3), x, [1] * w, in_splits))
    # all_to_all with lists: rank 1 expects 5 elements from rank 0, gets 4.
    outs = [torch.empty(5 if (r == 1 and j == 0) else 4) for j in range(w)]
    out["a2a_list"] = error_message(lambda: dist.all_to_all(outs, [torch.ones(4)] * w))
    # scatter with a wrong list on the root only: every rank gets the error.
    scatter_list = [torch.ones(2)] * (w + 1) if r == 0 else None
    start = time.monotonic()
    out["scatter"] = error_message(lambda: dist.scatter(torch.empty(2), scatter_list, src=0))
    out["scatter_s"] = time.monotonic() - start
    out["after"] = _allreduce_ones()
    return out


def test_debug_catches_all_to_all_and_one_rank_refusals():
    results = _run_debug(3, _debug_mismatches, pg_timeout_s=30, timeout_s=60)
    for res in results:
        assert "split sizes do not match" in res["a2a_single"], res
        assert "rank 0 sends 6 elements to rank 1, which expects 3" in res["a2a_single"], res
        assert "rank 0 sends 4 elements to rank 1, which expects 5" in res["a2a_list"], res
        assert "scatter refused on this rank" in res["scatter"], res
        assert "the scatter list has 4 entries, expected 3" in res["scatter"], res
        assert res["scatter_s"] < 10, res
        assert res["after"] == [3.0] * 3


def _ring_step(value, prv, nxt, tag=0):
    """Sends `value` to the next rank (recv issued first) and returns what
    the previous rank sent."""
    got = torch.empty_like(value)
    for work in [dist.irecv(got, prv, tag=tag), dist.isend(value, nxt, tag=tag)]:
        work.wait()
    return got.tolist()


def _debug_send_recv(ctx):
    w, r = ctx.world_size, ctx.rank
    nxt, prv = (r + 1) % w, (r - 1) % w
    out = {}
    # Rank 0 sends 8 elements into rank 1's recv of 4 (Gloo would abort rank 1).
    if r == 0:
        out["size"] = error_message(lambda: dist.send(torch.ones(8), 1))
    elif r == 1:
        out["size"] = error_message(lambda: dist.recv(torch.empty(4), 0))
    # Equal byte counts, different dtypes (Gloo would reinterpret the bytes),
    # seen through the works' futures.
    if r == 0:
        out["dtype"] = error_message(
            lambda: dist.isend(torch.ones(4), 1, tag=3).get_future().wait())
    elif r == 1:
        out["dtype"] = error_message(lambda: dist.irecv(
            torch.empty(4, dtype=torch.int32), 0, tag=3).get_future().wait())
    # The next message on that lane pairs up and arrives intact.
    if r == 0:
        dist.send(torch.arange(6.0), 1)
    elif r == 1:
        after = torch.empty(6)
        dist.recv(after, 0)
        out["after_mismatch"] = after.tolist()
    # Matched patterns complete as on Gloo: a ring whose recvs are issued
    # before its sends, a batched ring, and three messages in a row.
    out["ring"] = _ring_step(torch.full((5,), float(r)), prv, nxt)
    got3 = torch.empty(3, dtype=torch.float64)
    ops = [dist.P2POp(dist.isend, torch.full((3,), 10.0 * r, dtype=torch.float64), nxt),
           dist.P2POp(dist.irecv, got3, prv)]
    for q in dist.batch_isend_irecv(ops):
        q.wait()
    out["batched"] = got3.tolist()
    out["sequence"] = [_ring_step(torch.full((2,), 100.0 * r + i), prv, nxt) for i in range(3)]
    # Crossed tags: rank 0's recv on tag 5 is issued first and is met only
    # after rank 1 received rank 0's send on tag 0.
    if r == 0:
        a = torch.empty(2)
        q5 = dist.irecv(a, 1, tag=5)
        dist.send(torch.full((2,), 3.0), 1, tag=0)
        q5.wait()
        out["crossed"] = a.tolist()
    elif r == 1:
        b = torch.empty(2)
        dist.recv(b, 0, tag=0)
        dist.send(b * 7, 0, tag=5)
    # A recv from any source names the rank it took, and is checked too.
    if r == 0:
        x = torch.empty(3)
        out["any"] = (dist.recv(x), x.tolist())
        out["any_mismatch"] = error_message(lambda: dist.recv(torch.empty(3)))
    elif r == 2:
        dist.send(torch.full((3,), 2.0), 0)
        out["any_mismatch"] = error_message(lambda: dist.send(torch.ones(6), 0))
    # A send nobody receives ends in a clear error within the group's timeout
    # (on every rank at once, so that no rank waits in the allreduce below
    # for longer than the timeout).
    start = time.monotonic()
    out["unmet"] = error_message(lambda: dist.isend(torch.ones(2), nxt, tag=9).wait())
    out["unmet_s"] = time.monotonic() - start
    # The recv that comes too late (after every rank gave up: the barrier on
    # the reference group) is refused, since nothing is posted to meet a
    # send that gave up, and the lane is still in step afterwards.
    dist.barrier(group=ctx.ref)
    out["late"] = error_message(lambda: dist.recv(torch.empty(2), prv, tag=9))
    out["after_timeout"] = _ring_step(torch.full((4,), 5.0 + r), prv, nxt, tag=9)
    out["allreduce"] = _allreduce_ones()
    return out


def test_debug_catches_send_recv_size_and_dtype_mismatches():
    results = _run_debug(3, _debug_send_recv, pg_timeout_s=4, timeout_s=90)
    w = 3
    for r, res in enumerate(results):
        assert res["ring"] == [float((r - 1) % w)] * 5, res
        assert res["batched"] == [10.0 * ((r - 1) % w)] * 3, res
        assert res["sequence"] == [[100.0 * ((r - 1) % w) + i] * 2 for i in range(3)], res
        assert res["allreduce"] == [3.0] * 3, res
    for r in (0, 1):
        size, dtype = results[r]["size"], results[r]["dtype"]
        assert size.startswith("RuntimeError") and "send/recv mismatch" in size, size
        assert "rank 0 called send float32[8] to rank 1 and rank 1 called recv float32[4] " \
            "from rank 0" in size, size
        assert dtype.startswith("RuntimeError: tpcomm: ") and \
            "rank 0 called send float32[4] to rank 1 and rank 1 called recv int32[4] " \
            "from rank 0 (tag 3, the 1st message" in dtype, dtype
    assert results[1]["after_mismatch"] == [float(i) for i in range(6)]
    assert results[0]["crossed"] == [21.0, 21.0]
    assert results[0]["any"] == (2, [2.0, 2.0, 2.0])
    for r in (0, 2):
        mismatch = results[r]["any_mismatch"]
        assert "rank 2 called send float32[6] to rank 0 and rank 0 called recv float32[3] " \
            "from any source (took rank 2's message)" in mismatch, mismatch
    for r, res in enumerate(results):
        assert f"rank {(r + 1) % w} has not called the recv that meets it within the group's " \
            "timeout (4000 ms)" in res["unmet"], res
        assert 3.5 < res["unmet_s"] < 2 * 4, res
        assert f"but rank {(r - 1) % w} had stopped waiting for it" in res["late"], res
        assert res["after_timeout"] == [5.0 + (r - 1) % w] * 4, res


def _debug_threads(ctx):
    """Two threads issue collectives of different shapes on one group."""
    errors, done = [], []

    def worker(n):
        for _ in range(30):
            try:
                t = torch.ones(n)
                dist.all_reduce(t)
                if not torch.equal(t, torch.full((n,), float(ctx.world_size))):
                    errors.append(f"wrong result {t.tolist()}")
            except Exception as e:  # noqa: BLE001
                errors.append(f"{type(e).__name__}: {e}")
        done.append(n)

    threads = [threading.Thread(target=worker, args=(n,)) for n in (4, 13)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return len(done), errors


def test_debug_with_two_threads_on_one_group_raises_clearly_never_crashes():
    group = Group(2, env={"TPCOMM_DEBUG": "1"}, pg_timeout_s=20)
    try:
        results = group.run(_debug_threads, timeout_s=150)
    finally:
        group.close(kill=True)
    every_error = [e for _, errors in results for e in errors]
    for finished, errors in results:
        assert finished == 2
        for e in errors:
            assert e.startswith("RuntimeError") and "TPCOMM_DEBUG" in e, e
            assert "wrong result" not in e
    # A rank names the threads once it has seen more than one call the group
    # (the rank where one thread happened to go first may not have yet).
    if every_error:
        assert any("from several threads" in e for e in every_error), every_error


# ---------------------------------------------------------------- dtypes
ODD_DTYPES = [torch.int16, torch.uint16, torch.uint32, torch.float8_e4m3fn]


def _odd_dtypes(ctx):
    w, r = ctx.world_size, ctx.rank
    out = {}
    for dt in ODD_DTYPES:
        name = str(dt)
        base = (torch.arange(6) % 5).to(dt)
        mine = ((torch.arange(6) + r) % 5).to(dt)
        b = base.clone() if r == 0 else torch.zeros(6, dtype=dt)
        dist.broadcast(b, 0)
        gathered = torch.empty(6 * w, dtype=dt)
        dist.all_gather_into_tensor(gathered, mine)
        a2a = torch.empty(2 * w, dtype=dt)
        dist.all_to_all_single(a2a, torch.full((2 * w,), r % 4).to(dt))
        out[name] = {
            "broadcast": b.view(torch.uint8).tolist() == base.view(torch.uint8).tolist(),
            "all_gather": all(
                gathered[6 * k:6 * k + 6].view(torch.uint8).tolist()
                == ((torch.arange(6) + k) % 5).to(dt).view(torch.uint8).tolist()
                for k in range(w)),
            "all_to_all": a2a.view(torch.uint8).tolist() == torch.cat(
                [torch.full((2,), k % 4).to(dt) for k in range(w)]).view(torch.uint8).tolist(),
            "all_reduce": error_message(lambda: dist.all_reduce(mine.clone())),
        }
    y = torch.ones(2)
    dist.all_reduce(y)
    out["after"] = y.tolist()
    return out


@pytest.mark.parametrize("shm", ["0", "1"])
def test_dtypes_gloo_lacks_move_exactly_and_reductions_are_refused(shm):
    group = Group(3, env={"TPCOMM_CPU_SHM": shm})
    try:
        results = group.run(_odd_dtypes)
    finally:
        group.close()
    for res in results:
        for dt in ODD_DTYPES:
            row = res[str(dt)]
            assert row["broadcast"] and row["all_gather"] and row["all_to_all"], (dt, row)
            msg = row["all_reduce"]
            assert msg.startswith("RuntimeError") and "DistBackendError" not in msg, msg
            assert "cannot be reduced" in msg and "float32, float64" in msg, msg
        assert res["after"] == [3.0, 3.0]


# ---------------------------------------------------------------- drop-in gaps
def _sparse_and_monitored(ctx):
    r = ctx.rank
    idx = torch.tensor([[r, 3]])
    s = torch.sparse_coo_tensor(idx, torch.tensor([1.0 + r, 2.0]), (5,))
    ref = s.clone()
    dist.all_reduce(s)
    dist.all_reduce(ref, group=ctx.ref)
    avg = error_message(lambda: dist.all_reduce(s.clone(), op=dist.ReduceOp.AVG))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.monitored_barrier(timeout=5.0)
    root = dist.BroadcastOptions()
    root.rootTensor = 5
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    assert "cannot be reduced" in error_message(lambda: dist.all_reduce(
        torch.sparse_coo_tensor([[0]], torch.tensor([1], dtype=torch.int16), (2,))))
    assert "0-dim" in error_message(lambda: dist.all_to_all_single(
        torch.empty(()), torch.ones(())))
    return (s.to_dense().tolist(), ref.to_dense().tolist(), avg,
            [str(w.message) for w in caught],
            error_message(lambda: backend.broadcast([torch.ones(2)], root)))


def test_sparse_allreduce_and_monitored_barrier_in_seconds_work_as_on_gloo(groups):
    for dense, ref, avg, warned, root in groups(3).run(_sparse_and_monitored):
        assert dense == ref == [1.0, 2.0, 3.0, 6.0, 0.0]
        assert "sparse tensors are reduced by SUM only" in avg, avg
        assert any("timedelta" in w for w in warned), warned
        assert "rootTensor 5 is not an index into the call's tensor list" in root, root


def _sparse_tensor_dict(ctx):
    import tpcomm

    c = tpcomm.GroupCoordinator([list(range(ctx.world_size))], ctx.rank,
                                use_message_queue_broadcaster=True, group_name="sparse")
    sparse = torch.sparse_coo_tensor([[0]], [1.0], (3,))
    try:
        first = error_message(lambda: c.mq_broadcaster.broadcast_tensor_dict({"s": sparse})) \
            if c.rank_in_group == 0 else None
        second = error_message(lambda: tpcomm._tensor_dict.split({"s": sparse}))
        return first, second
    finally:
        c.destroy()


def test_sparse_tensor_in_a_tensor_dict_is_refused_by_name(groups):
    first, second = groups(2).run(_sparse_tensor_dict)[0]
    for msg in (first, second):
        assert msg.startswith("ValueError") and "'s' is a torch.sparse_coo tensor" in msg, msg


# ---------------------------------------------------------------- soak probes
def _two_threads_two_groups(ctx):
    """Each thread owns a group: their calls interleave freely."""
    groups = [dist.new_group(list(range(ctx.world_size))) for _ in range(2)]
    results = {}

    def worker(i):
        total = 0.0
        for step in range(200):
            t = torch.full((7 + i,), float(step + ctx.rank))
            dist.all_reduce(t, group=groups[i])
            total += t[0].item()
        results[i] = total

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for g in groups:
        dist.destroy_process_group(g)
    return results


def test_two_threads_on_two_groups(groups):
    w = 3
    expected = float(sum(w * s + sum(range(w)) for s in range(200)))
    for res in groups(w).run(_two_threads_two_groups):
        assert res == {0: expected, 1: expected}


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def _rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _create_destroy_loop(ctx, rounds):
    import tpcomm

    def one_round():
        g = dist.new_group(list(range(ctx.world_size)), backend="tpcomm")
        x = torch.ones(16)
        dist.all_reduce(x, group=g)  # sets up the shared-memory path
        mq = tpcomm.MessageQueue.create_from_process_group(g, max_chunk_bytes=1 << 12,
                                                            max_chunks=2)
        assert mq.broadcast_object("hi" if mq.is_writer else None) == "hi"
        mq.shutdown()
        dist.destroy_process_group(g)
        return x[0].item()

    for _ in range(5):  # warm-up: allocator and import caches settle
        one_round()
    fds, rss = _open_fds(), _rss_kib()
    values = {one_round() for _ in range(rounds)}
    return values, _open_fds() - fds, _rss_kib() - rss


def test_create_destroy_loop_keeps_descriptors_and_memory_flat():
    group = Group(2)  # the shared-memory path on: its regions are made and freed too
    try:
        results = group.run(_create_destroy_loop, 60, timeout_s=300)
    finally:
        group.close()
    for values, fd_growth, rss_growth_kib in results:
        assert values == {2.0}
        assert fd_growth <= 2, fd_growth
        assert rss_growth_kib < 64 * 1024, rss_growth_kib


def _checksummed_queue(ctx, count):
    import zlib

    import tpcomm

    mq = tpcomm.MessageQueue.create_from_process_group(dist.group.WORLD, max_chunk_bytes=1 << 12,
                                                        max_chunks=4)
    bad = 0
    for i in range(count):
        payload = bytes((i * 7 + k) % 251 for k in range(i % 700)) if mq.is_writer else None
        msg = mq.broadcast_object((i, zlib.crc32(payload), payload) if mq.is_writer else None)
        seq, crc, data = msg
        bad += seq != i or zlib.crc32(data) != crc
    mq.shutdown()
    return bad


def test_ten_thousand_checksummed_queue_messages_arrive_intact(groups):
    assert groups(3).run(_checksummed_queue, 10_000, timeout_s=300) == [0, 0, 0]


def test_fault_probes_end_in_clear_errors_only():
    """python -m tpcomm.bench faults --quick: bad inputs, TPCOMM_DEBUG
    mistakes and kill -9 of three roles; every outcome a clear error (kills:
    within twice the 3 s timeout), none a timeout, crash or wrong result."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tpcomm.bench", "faults", "--quick"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "kill -9: queue writer (3 ranks)" in out.stdout, out.stdout
    total = [line for line in out.stdout.splitlines() if line.startswith("total")][0].split()
    tried, clear, timeouts, crashes, wrong = map(int, total[1:])
    assert tried == clear > 80 and timeouts == crashes == wrong == 0, out.stdout
