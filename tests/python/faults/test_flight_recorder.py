"""tpcomm's calls in torch's own flight recorder: entries against the calls
made, across ranks and routes; dumps after a failure; torchfrtrace naming a
skipped call and the rank that skipped it."""

import os
import pickle
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from harness import Group


def _torchfrtrace(folder):
    """torchfrtrace's report on the dumps `trace_<rank>` in `folder`; it must succeed."""
    tool = os.path.join(os.path.dirname(sys.executable), "torchfrtrace")
    out = subprocess.run([tool, str(folder), "-p", "trace_"], capture_output=True, text=True,
                         timeout=120)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    return report


def _our_entries(dump, group="0"):
    return [e for e in dump["entries"] if e["process_group"][0] == group]


def _calls(ctx):
    t = torch.arange(4.0) + ctx.rank
    for _ in range(3):
        dist.all_reduce(t)
    out = [torch.empty(4) for _ in range(ctx.world_size)]
    dist.all_gather(out, t)
    dist.barrier()
    if ctx.rank == 0:
        dist.send(torch.ones(2, dtype=torch.int64), 1)
    elif ctx.rank == 1:
        dist.recv(torch.empty(2, dtype=torch.int64), 0)
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    rows = [(e["profiling_name"], e["collective_seq_id"], e["p2p_seq_id"], e["state"],
             e["input_sizes"], e["input_dtypes"], e["output_sizes"], e["is_p2p"])
            for e in _our_entries(dump)]
    return backend.describe()["flight_recorder"], rows, dump["pg_config"]["0"]


@pytest.mark.parametrize("route", ["cpu_shm", "gloo"])
def test_every_call_is_recorded_with_agreeing_sequence_ids(route):
    env = {"TPCOMM_CPU_SHM": "1" if route == "cpu_shm" else "0"}
    group = Group(3, env=env)
    try:
        results = group.run(_calls)
    finally:
        group.close()
    for rank, (status, rows, config) in enumerate(results):
        assert status.startswith("on (torch's recorder"), status
        assert config["ranks"] == "[0, 1, 2]" and config["desc"] == "default_pg", config
        collectives = [r for r in rows if not r[7]]
        want = ([f"nccl:all_reduce tpcomm/{route}"] * 3 + [f"nccl:all_gather tpcomm/{route}",
                                                          f"nccl:all_reduce_barrier tpcomm/{route}"])
        assert [r[0] for r in collectives] == want, rows
        assert [r[1] for r in collectives] == [1, 2, 3, 4, 5]  # the same on every rank
        assert all(r[3] == "completed" for r in rows), rows
        assert collectives[0][4] == [[4]] and collectives[0][5] == ["Float"], collectives[0]
        assert collectives[3][6] == [[4]] * 3, collectives[3]  # all-gather outputs
        p2p = [r for r in rows if r[7]]
        if rank == 0:
            assert [(r[0], r[2], r[4]) for r in p2p] == [("nccl:send 0->1", 1, [[2]])], p2p
        elif rank == 1:
            assert [(r[0], r[2], r[6]) for r in p2p] == [("nccl:recv 1<-0", 1, [[2]])], p2p
        else:
            assert p2p == []


def _wrapping(ctx):
    """Four different tpcomm calls and one of Gloo's (the reference group),
    five times, through a ring of 8 entries: each slot is written over by a
    call of another kind (other sizes, dtypes, name, point to point or not,
    tpcomm's or Gloo's) each time round; rank 1 then leaves a receive
    waiting on its last slot."""
    made = []  # every recorded call in order: tpcomm's as expected, Gloo's as None
    for i in range(5):
        t = torch.full((3, 5), float(i + ctx.rank))
        dist.all_reduce(t)
        made.append(("nccl:all_reduce tpcomm/cpu_shm", [[3, 5]], ["Float"], [[3, 5]], ["Float"],
                     False))
        dist.all_reduce(torch.ones(2), group=ctx.ref)
        made.append(None)
        x = torch.ones(7, dtype=torch.bfloat16)
        out = torch.empty(7 * ctx.world_size, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(out, x)
        made.append(("nccl:_all_gather_base tpcomm/cpu_shm", [[7]], ["BFloat16"],
                     [[7 * ctx.world_size]], ["BFloat16"], False))
        if ctx.rank == 0:
            dist.send(torch.ones(2, 2, 2, dtype=torch.int64), 1)
            made.append(("nccl:send 0->1", [[2, 2, 2]], ["Long"], [], [], True))
        else:
            dist.recv(torch.empty(2, 2, 2, dtype=torch.int64), 0)
            made.append(("nccl:recv 1<-0", [], [], [[2, 2, 2]], ["Long"], True))
        dist.barrier()
        made.append(("nccl:all_reduce_barrier tpcomm/cpu_shm", None, None, None, None, False))
    pending = None
    if ctx.rank == 1:
        got = torch.zeros(3)
        pending = dist.irecv(got, 0)  # rank 0 sends only after this rank's dump
        made.append(("nccl:recv 1<-0", [], [], [[3]], ["Float"], True))
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    dist.barrier(group=ctx.ref)
    if ctx.rank == 0:
        dist.send(torch.ones(3), 1)
    else:
        pending.wait()
    entries = [(e["process_group"][0], e["profiling_name"], e["input_sizes"], e["input_dtypes"],
                e["output_sizes"], e["output_dtypes"], e["is_p2p"], e["state"],
                e["collective_seq_id"], e["p2p_seq_id"], e.get("time_discovered_completed_ns"))
               for e in dump["entries"]]
    return made, entries


def test_a_full_ring_holds_each_calls_own_entry():
    # Once the ring is full an entry is written over the one before it, into
    # that one's strings and vectors: nothing of the older call may remain,
    # whether tpcomm or torch (Gloo) wrote it.
    group = Group(2, env={"TPCOMM_CPU_SHM": "1", "TORCH_FR_BUFFER_SIZE": "8"})
    try:
        results = group.run(_wrapping)
    finally:
        group.close()
    for rank, (made, entries) in enumerate(results):
        assert len(entries) == 8, entries
        for want, entry in zip(made[-8:], entries):
            if want is None:
                assert entry[0] != "0" and entry[1] == "gloo:all_reduce", entry
                # (its state is torch's to keep: Gloo's entries stay "scheduled")
                assert entry[2:6] == ([[2]], ["Float"], [[2]], ["Float"]), entry
                continue
            name, *tensors, p2p = want
            assert entry[0] == "0" and entry[1] == name and entry[6] == p2p, (want, entry)
            if tensors[0] is not None:  # (a barrier's tensor is tpcomm's own)
                assert list(entry[2:6]) == tensors, (want, entry)
        ours = [e for e in entries if e[0] == "0"]
        # Rank 1's last entry is its receive, still waiting when it dumped:
        # started, with no completion time (its slot held a completed call).
        done = ours[:-1] if rank == 1 else ours
        assert all(e[7] == "completed" and e[10] is not None for e in done), ours
        if rank == 1:
            assert ours[-1][7] == "started" and ours[-1][10] is None, ours[-1]
        # Each entry has both counters as they stood: 3 collectives and 1
        # send or recv a round; the last 8 calls begin in round 4.
        want_ids = ([(11, 3), (11, 4), (12, 4), (13, 4), (14, 4), (14, 5), (15, 5)] if rank == 0
                    else [(11, 4), (12, 4), (13, 4), (14, 4), (14, 5), (15, 5), (15, 6)])
        assert [(e[8], e[9]) for e in ours] == want_ids, ours


def _unwaited(ctx):
    """An isend and an irecv nobody waits on (small and past the first part):
    their entries retire when they complete."""
    peer = 1 - ctx.rank
    works = []
    for n in (4, 100000):
        if ctx.rank == 0:
            works.append(dist.isend(torch.ones(n), peer))
        else:
            works.append(dist.irecv(torch.zeros(n), peer))
    deadline = time.monotonic() + 10
    while True:
        dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
        states = [(e["profiling_name"], e["state"]) for e in _our_entries(dump) if e["is_p2p"]]
        if all(state == "completed" for _, state in states) or time.monotonic() > deadline:
            return states, [w.is_completed() for w in works]


def test_an_unwaited_send_and_recv_retire_when_they_complete():
    group = Group(2, env={"TPCOMM_CPU_SHM": "0"})
    try:
        (sends, sent), (recvs, got) = group.run(_unwaited)
    finally:
        group.close()
    assert sends == [("nccl:send 0->1", "completed")] * 2, sends
    assert recvs == [("nccl:recv 1<-0", "completed")] * 2, recvs
    assert sent == [True, True] and got == [True, True], (sent, got)


def _recorders_of_a_group(ctx):
    c10d = dist.distributed_c10d
    hooks = getattr(c10d._world, "pg_flight_recorder_hooks", None)
    group = dist.new_group(backend="tpcomm")
    t = torch.ones(4)
    dist.all_reduce(t, group=group)
    dist.all_reduce(t, group=group)
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    name = group.group_name
    ours = [e["profiling_name"] for e in dump["entries"] if e["process_group"][0] == name]
    self_recording = getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    declared = None if self_recording is None else "tpcomm" in self_recording
    hooked = None if hooks is None else group in hooks
    return ours, declared, hooked


@pytest.mark.torch_version
def test_a_group_is_recorded_once_by_tpcomm_and_not_by_torchs_hook():
    # torch 2.15 attaches a recording hook to groups of backends that do not
    # record themselves; on a tpcomm group it recorded every call a second
    # time (in a recorder of its own) and gathered a Python stack per call.
    group = Group(2, env={"TPCOMM_CPU_SHM": "0"})
    try:
        results = group.run(_recorders_of_a_group)
    finally:
        group.close()
    for ours, declared, hooked in results:
        assert len(ours) == 2 and all(n.startswith("nccl:all_reduce ") for n in ours), ours
        if declared is None:
            # A torch without the set has no such hook either.
            assert not hasattr(dist.distributed_c10d, "_maybe_attach_flight_recorder")
        else:
            assert declared and hooked is False, (declared, hooked)


def _skips_a_call(ctx):
    t = torch.ones(4)
    try:
        for i in range(3):
            if ctx.rank == 1 and i == 2:
                continue  # rank 1 skips the third all_reduce
            dist.all_reduce(t)
        dist.barrier()
    except Exception as e:  # noqa: BLE001 (the failure is what this test is about)
        return str(e)
    return None


@pytest.mark.parametrize("world_size,route", [(2, "cpu_shm"), (4, "cpu_shm"),
                                              pytest.param(2, "gloo", marks=pytest.mark.torch_version)])
def test_torchfrtrace_names_the_skipped_call_and_the_rank(tmp_path, world_size, route):
    prefix = str(tmp_path / "trace_")
    env = {"TORCH_FR_DUMP_TEMP_FILE": prefix,
           "TPCOMM_CPU_SHM": "1" if route == "cpu_shm" else "0"}
    group = Group(world_size, env=env, pg_timeout_s=5)
    try:
        errors = group.run(_skips_a_call, timeout_s=90)
    finally:
        group.close(kill=True)
    for rank, error in enumerate(errors):
        assert error is not None, f"rank {rank} did not fail"
        assert f"flight recorder dumped to {prefix}{rank}" in error, error
    assert sorted(os.listdir(tmp_path)) == sorted(f"trace_{r}" for r in range(world_size))
    report = _torchfrtrace(tmp_path)
    assert "Collective sequence number: 3 has errors" in report, report
    assert f"collective: nccl:all_reduce tpcomm/{route}" in report, report
    assert "Culprit rank 1" in report and "COLLECTIVE_TYPE_MISMATCH" in report, report


def _two_recorders(ctx):
    """The dump another recorder of this rank writes through torch's writer
    (as ProcessGroupNCCL does after its failures: a group of its own, one
    completed all_reduce), before and after tpcomm's dump of a failure."""
    from tpcomm import _C

    dist.all_reduce(torch.ones(4))
    real = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    template = dict(_our_entries(real)[0])
    config = dict(real["pg_config"]["0"])

    def other_dump(state):
        e = dict(template, pg_id=99, record_id=0, process_group=("nccl-pg", "other recorder"),
                 collective_seq_id=1, p2p_seq_id=0, op_id=1, profiling_name="nccl:all_reduce",
                 state=state, time_created_ns=time.time_ns())
        pg = dict(config, name="nccl-pg", desc="other recorder")
        return pickle.dumps({"version": real["version"], "pg_config": {"nccl-pg": pg},
                             "pg_status": {"nccl-pg": {}}, "entries": [e]}, protocol=2)

    _C._write_fr_dump(ctx.rank, other_dump("started"))
    error = None
    try:
        for i in range(3):
            if ctx.rank == 1 and i == 2:
                continue  # rank 1 skips the third all_reduce
            dist.all_reduce(torch.ones(4))
        dist.barrier()
    except Exception as e:  # noqa: BLE001 (the failure is what this test is about)
        error = str(e)
    _C._write_fr_dump(ctx.rank, other_dump("completed"))
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return error, backend.describe()["flight_recorder"]


def test_dumps_of_two_recorders_of_a_rank_go_into_one_file_torchfrtrace_reads(tmp_path):
    prefix = str(tmp_path / "trace_")
    group = Group(2, env={"TORCH_FR_DUMP_TEMP_FILE": prefix, "TPCOMM_CPU_SHM": "1"},
                  pg_timeout_s=5)
    try:
        results = group.run(_two_recorders, timeout_s=90)
    finally:
        group.close(kill=True)
    for rank, (error, status) in enumerate(results):
        assert error is not None and f"flight recorder dumped to {prefix}{rank}" in error, error
        assert f"merged into {prefix}{rank})" in status, status
    assert sorted(os.listdir(tmp_path)) == ["trace_0", "trace_1"]
    for rank in range(2):
        with open(tmp_path / f"trace_{rank}", "rb") as f:
            dump = pickle.load(f)
        groups = {e["process_group"][0]: e for e in dump["entries"]}
        # The other recorder's entry, as its last dump had it, and tpcomm's.
        assert groups["nccl-pg"]["state"] == "completed", groups
        assert sum(e["profiling_name"] == "nccl:all_reduce tpcomm/cpu_shm"
                   for e in dump["entries"]) == (3 if rank == 0 else 2) + 1, dump["entries"]
        assert {"0", "nccl-pg"} <= set(dump["pg_config"]), dump["pg_config"]
    report = _torchfrtrace(tmp_path)
    assert "Collective sequence number: 4 has errors" in report, report
    assert "Culprit rank 1" in report, report


def _recorder_off(ctx):
    dist.all_reduce(torch.ones(2))
    dump = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return backend.describe()["flight_recorder"], len(_our_entries(dump))


def test_a_zero_buffer_turns_recording_off():
    group = Group(2, env={"TORCH_FR_BUFFER_SIZE": "0"})
    try:
        for status, entries in group.run(_recorder_off):
            assert status == "off: TORCH_FR_BUFFER_SIZE=0" and entries == 0, (status, entries)
    finally:
        group.close()
