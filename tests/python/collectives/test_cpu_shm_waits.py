"""How the CPU shared-memory path's ranks wait for each other (the
**Waits** item of docs/cpu-shm.md): what describe()["cpu_shm"]["waits"]
counts.

The late-peer tests do not trust the scheduler to make rank 1 late: on a
shared machine either rank can lose its core for milliseconds. Each call is
stamped instead (CLOCK_MONOTONIC, the clock the waits are timed on) in a
file both ranks map: rank 0 just before its allreduce, rank 1 when it
starts its own, having spun until `late_us` after rank 0's stamp. Rank 0
reads its counters after every call, so each call's wait is checked
against how late rank 1 really was, and against the call's own length,
which bounds it."""

import mmap
import os
import struct
import time

import torch
import torch.distributed as dist

from harness import Group

_STAMP = struct.Struct("q")
# What the stamps do not see of a call's wait: a rank's way from its stamp
# to its arrival in shared memory (a few us, unless it loses its core right
# there), and after a sleep, the kernel's wake-up of the sleeper (tens of
# us on a virtual machine).
_SLACK_NS = 40_000
_WAKE_NS = 200_000


def _stamps(path, calls):
    """Both ranks' stamps: [rank][call] int64 ns, zero until written."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 2 * calls * _STAMP.size)
        return mmap.mmap(fd, 2 * calls * _STAMP.size)
    finally:
        os.close(fd)


def _late_peer(ctx, path, calls, late_us):
    """Rank 1 arrives `late_us` after rank 0 at every allreduce. Rank 0
    returns, per call: its stamp, the call's end, and what its waits
    counted in that call; rank 1 returns its stamps. Both return the
    number of wrong sums."""
    import tpcomm

    stamps = _stamps(path, calls)
    at = lambda rank, i: (rank * calls + i) * _STAMP.size  # noqa: E731
    wrong, per_call = 0, []
    dist.all_reduce(torch.ones(16))  # the first call sets up the path
    before = tpcomm.describe()["cpu_shm"]["waits"]
    for i in range(calls):
        x = torch.full((16,), float(ctx.rank + i))
        if ctx.rank == 0:
            start = time.monotonic_ns()
            _STAMP.pack_into(stamps, at(0, i), start)
            dist.all_reduce(x)
            end = time.monotonic_ns()
            after = tpcomm.describe()["cpu_shm"]["waits"]
            per_call.append((start, end, _delta(before, after)))
            before = after
        else:
            give_up = time.monotonic() + 10
            while (theirs := _STAMP.unpack_from(stamps, at(0, i))[0]) == 0:
                assert time.monotonic() < give_up, f"rank 0 never stamped call {i}"
            while time.monotonic_ns() < theirs + late_us * 1000:
                pass
            _STAMP.pack_into(stamps, at(1, i), time.monotonic_ns())
            dist.all_reduce(x)
        wrong += int(x[0].item() != 1 + 2 * i)
    mine = [_STAMP.unpack_from(stamps, at(1, i))[0] for i in range(calls)]
    stamps.close()
    return wrong, per_call if ctx.rank == 0 else mine


def _delta(before, after):
    return {k: ([a - b for a, b in zip(after[k], before[k])] if k == "late" else after[k] - before[k])
            for k in after}


def _late_run(tmp_path, spin_us, calls, late_us):
    """Rank 0's calls as (start, end, rank 1's stamp, waits counted) over
    `calls` allreduces with rank 1 `late_us` late, polling `spin_us`; fails
    on a wrong sum."""
    group = Group(2, env={"TPCOMM_CPU_SHM": "1", "TPCOMM_CPU_SHM_SPIN_US": str(spin_us)})
    try:
        (wrong0, calls0), (wrong1, stamps1) = group.run(
            _late_peer, str(tmp_path / "stamps"), calls, late_us)
    finally:
        group.close()
    assert wrong0 == wrong1 == 0
    return [(start, end, theirs, waits) for (start, end, waits), theirs in zip(calls0, stamps1)]


def _bucket(ns):
    """The `late` bucket of a wait of `ns` (under 2 us, then 2^b us)."""
    b, us = 0, ns // 2000
    while us > 0 and b + 1 < 17:
        us, b = us >> 1, b + 1
    return b


def _check_each_call(calls, spin_us):
    """Every call counted one wait in one place, within the call's length;
    returns how many calls' waits were counted as rank 1's stamp says: late
    by as much (less _SLACK_NS, plus _WAKE_NS), in that bucket, met polling
    within the polling window or asleep after it."""
    expected = 0
    for start, end, theirs, w in calls:
        assert w["waits"] == 1, w
        assert w["at_once"] + w["met_polling"] + w["slept"] == 1, w
        assert sum(w["late"]) == w["met_polling"] + w["slept"], w
        assert w["poll_us"] + w["sleep_us"] <= (end - start) // 1000, (end - start, w)
        if w["slept"] == 0:
            assert w["sleep_us"] == 0, w
        if w["at_once"]:
            assert w["poll_us"] == 0, w
            continue
        b = w["late"].index(1)
        assert b == 0 or 2 ** b <= (end - start) / 1000, (end - start, w)  # a wait is inside its call
        late = theirs - start
        waited = (w["poll_us"] + w["sleep_us"]) * 1000
        polled = late + _SLACK_NS < spin_us * 1000
        expected += (b in {_bucket(late - _SLACK_NS), _bucket(late + _WAKE_NS)}
                     and late - _SLACK_NS <= waited <= late + _WAKE_NS
                     and bool(w["met_polling"]) == polled and bool(w["slept"]) == (not polled))
    return expected


def test_a_late_peers_waits_are_counted_by_how_long_they_took(tmp_path):
    """Rank 1 comes 350 us after rank 0 to each of 300 allreduces, rank 0
    polling up to 1 ms: rank 0's waits are met polling, in the bucket of
    256-512 us, that long (a bucket off by one, or a wait uncounted or
    counted twice, fails). Where rank 1 lost its core and came later, the
    wait is checked against how late it came."""
    calls = _late_run(tmp_path, 1000, 300, 350)
    assert _check_each_call(calls, 1000) >= 0.8 * len(calls)


def test_a_wait_that_sleeps_is_counted_with_its_time_asleep(tmp_path):
    """With no polling (TPCOMM_CPU_SHM_SPIN_US=0) and rank 1 1.5 ms late to
    each of 100 allreduces, rank 0 sleeps on the futex: counted as slept,
    in the bucket of 1-2 ms, with the time asleep."""
    calls = _late_run(tmp_path, 0, 100, 1500)
    assert _check_each_call(calls, 0) >= 0.8 * len(calls)


def _waits_free_cores(ctx, calls):
    import tpcomm

    for i in range(calls):
        x = torch.full((16,), float(i))
        dist.all_reduce(x)
    return tpcomm.describe()["cpu_shm"]["waits"]


def test_the_waits_add_up():
    """Counted waits: one per step, each found its peers there, met them
    polling, or slept first; the late ones fall into the buckets by time."""
    group = Group(2, env={"TPCOMM_CPU_SHM": "1"})
    try:
        results = group.run(_waits_free_cores, 200)
    finally:
        group.close()
    for waits in results:
        assert waits["waits"] >= 200, waits
        assert waits["at_once"] + waits["met_polling"] + waits["slept"] == waits["waits"], waits
        assert sum(waits["late"]) == waits["met_polling"] + waits["slept"], waits
        assert len(waits["late"]) == 17
        assert waits["poll_us"] >= 0 and waits["sleep_us"] >= 0
        if waits["slept"] == 0:
            assert waits["sleep_us"] == 0, waits
