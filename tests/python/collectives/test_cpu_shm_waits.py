"""How the CPU shared-memory path's ranks wait for each other (the
**Waits** item of docs/cpu-shm.md): what describe()["cpu_shm"]["waits"]
counts."""

import time

import torch
import torch.distributed as dist

from harness import Group


def _late_peer(ctx, calls, late_us):
    """Rank 1 arrives about `late_us` after rank 0 at every allreduce;
    returns the wrong sums and what this rank's waits saw."""
    import tpcomm

    wrong = 0
    for i in range(calls):
        if ctx.rank == 1:
            until = time.perf_counter() + late_us * 1e-6
            while time.perf_counter() < until:
                pass
        x = torch.full((16,), float(ctx.rank + i))
        dist.all_reduce(x)
        wrong += int(x[0].item() != 1 + 2 * i)
    return wrong, tpcomm.describe()["cpu_shm"]["waits"]


def _late_run(spin_us, calls, late_us):
    """(wrong sums, waits) of ranks 0 and 1 over `calls` allreduces with
    rank 1 `late_us` late, polling `spin_us`."""
    group = Group(2, env={"TPCOMM_CPU_SHM": "1", "TPCOMM_CPU_SHM_SPIN_US": str(spin_us)})
    try:
        return group.run(_late_peer, calls, late_us)
    finally:
        group.close()


def test_a_late_peers_waits_are_counted_by_how_long_they_took():
    """Rank 1 comes about 300 us after rank 0 to each of 300 allreduces:
    rank 0's waits are late, met polling (1 ms window), and most fall in the
    bucket of 256-512 us (a bucket off by one, or a wait uncounted, fails)."""
    (wrong0, waits0), (wrong1, waits1) = _late_run(1000, 300, 300)
    assert wrong0 == wrong1 == 0
    late = waits0["met_polling"] + waits0["slept"]
    assert waits0["waits"] >= 300 and late >= 0.8 * 300, waits0
    assert sum(waits0["late"]) == late, waits0
    # late[8] counts waits of 256-512 us; rank 1 spins 300 us before each.
    assert waits0["late"][8] >= 0.5 * late, waits0
    assert sum(waits0["late"][:7]) <= 0.3 * late, waits0
    assert waits0["poll_us"] >= 0.6 * 300 * 256, waits0
    # Rank 1 mostly finds rank 0 there.
    assert waits1["at_once"] >= 0.6 * 300, waits1


def test_a_wait_that_sleeps_is_counted_with_its_time_asleep():
    """With no polling (TPCOMM_CPU_SHM_SPIN_US=0) and rank 1 about 1.5 ms
    late to each of 100 allreduces, rank 0 sleeps on the futex at nearly
    every call: counted as slept, with the time asleep, and in the bucket
    of 1-2 ms."""
    (wrong0, waits0), (wrong1, _) = _late_run(0, 100, 1500)
    assert wrong0 == wrong1 == 0
    assert waits0["slept"] >= 0.8 * 100, waits0
    assert sum(waits0["late"]) == waits0["met_polling"] + waits0["slept"], waits0
    assert waits0["late"][10] >= 0.5 * waits0["slept"], waits0
    assert waits0["sleep_us"] >= 0.8 * 100 * 1000, waits0


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
