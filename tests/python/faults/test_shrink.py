"""Going on after a lost rank: dist.shrink_group on a tpcomm group
(ProcessGroupTpcomm::shrink, GroupCoordinator::shrink), and dist._reconfigure
of the same group with the survivors' handles (backend/reconfigure.cpp).
Four ranks on one host run allreduces; one is killed with SIGKILL mid-loop;
the survivors see the fault, shrink or reconfigure, and run 1,000
allreduces on the group they then have, on the
shared-memory route (not Gloo), bitwise equal to a group of the survivors
made apart; then everything is destroyed and nothing of the old group is
left (no shared-memory mapping, socket or thread; with the default group
shrunk, no store key of tpcomm's). The store lives in the test's process,
so that any rank may die."""

import gc
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from harness import error_message, first_answers

SIZE = 4
LOST = 2
# dist._reconfigure where torch has it (2.15 on); a build against an older
# torch says reconfigure is off (test_backend_hooks.py's capability test).
HOWS = ["shrink"] + (["reconfigure"] if hasattr(dist, "_reconfigure") else [])
CALLS = 1000


def _resources():
    """Shared-memory mappings of tpcomm's, descriptors and threads of this
    process."""
    with open("/proc/self/maps") as f:
        mappings = sum(1 for line in f if "/dev/shm/tpcomm" in line)
    return mappings, len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def _settled(before, timeout_s=10.0):
    """The resources once they came back to `before` (a broken group's Gloo
    group is destroyed by a reaper thread, every 200 ms), or as they are."""
    deadline = time.monotonic() + timeout_s
    now = _resources()
    while now != before and time.monotonic() < deadline:
        time.sleep(0.1)
        now = _resources()
    return now


def _steady(timeout_s=5.0):
    """The resources once the same for half a second (a break's release
    runs on the watchdog's thread, which starts the reaper)."""
    deadline = time.monotonic() + timeout_s
    seen = [_resources()]
    while time.monotonic() < deadline and (len(seen) < 5 or len(set(seen[-5:])) > 1):
        time.sleep(0.1)
        seen.append(_resources())
    return seen[-1]


def _reconfigure(group, store, rank, survivors, uuid):
    """The survivors' handles, exchanged through the test's store, and the
    group re-formed of them in their order; returns the group."""
    mine = dist._get_reconfigure_handle(group)
    store.set(f"handle/{uuid}/{rank}", mine)
    handles = [store.get(f"handle/{uuid}/{r}").decode() for r in survivors]
    work = dist._reconfigure(uuid=uuid, handles=handles, group=group)
    if work is not None:
        work.wait()
    # A list of handles: this rank's place in it is its rank now.
    return handles.index(mine)


def _lose_and_shrink(rank, default, how, store, conn):
    """Runs the loop until the fault, shrinks or reconfigures, compares; what
    the test reads. Every group is destroyed and no reference to one is left
    at its end."""
    import tpcomm

    survivors = [r for r in range(SIZE) if r != LOST]
    apart = dist.new_group(survivors)
    group = dist.group.WORLD if default else dist.new_group(list(range(SIZE)))
    devices = sorted(str(d) for d in group._device_types)
    i = 0
    while True:
        if rank == LOST and i == 200:
            conn.send(("killed", time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.full((1024,), float(rank + i))
        failure = error_message(lambda: dist.all_reduce(x, group=group))
        if failure is not None:
            failed_at = time.time()
            break
        assert x[0].item() == sum(range(SIZE)) + SIZE * i, (i, x[0].item())
        i += 1
    if how == "reconfigure":
        place = _reconfigure(group if not default else None, store, rank, survivors, 7)
        shrunk = group
    else:
        shrunk = dist.shrink_group([LOST], group=group)
    del group
    if default and how == "shrink":
        # torch destroyed every other group: one made after the shrink.
        apart = dist.new_group(list(range(SIZE - 1)))
    tpcomm.reset_stats(shrunk)
    gen = torch.Generator().manual_seed(1234 + rank)
    for n in range(CALLS):
        x = torch.randn(257 + n % 7, generator=gen)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, group=shrunk)
        dist.all_reduce(b, group=apart)
        assert torch.equal(a, b), (n, (a - b).abs().max().item())
    stats = tpcomm.stats(shrunk)
    names = (shrunk.rank(), shrunk.size(),
             dist.get_process_group_ranks(shrunk) if how == "shrink" else place,
             tpcomm.describe(shrunk)["group"], devices,
             sorted(str(d) for d in shrunk._device_types))
    dist.destroy_process_group(apart)
    if not default:
        dist.destroy_process_group(shrunk)
    del shrunk
    dist.destroy_process_group()
    return (failure, failed_at, names, stats.get("cpu_shm", {}).get("calls", 0),
            stats.get("gloo", {}).get("calls", 0))


def _survive(rank, port, default, how, env, conn):
    try:
        os.environ.clear()
        os.environ.update(env)
        import tpcomm  # noqa: F401  (registers the backend)

        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        # What a process keeps for good once it made a group and one broke
        # (the fault watchdog's thread, the reaper of broken groups' Gloo
        # groups): measured after a group made, aborted and destroyed.
        dist.init_process_group("tpcomm", store=store, rank=rank, world_size=SIZE,
                                timeout=timedelta(seconds=20))
        dist.all_reduce(torch.ones(4))
        threads = len(os.listdir("/proc/self/task"))
        dist.group.WORLD._get_backend(torch.device("cpu")).abort()
        # The break's release (on the watchdog's thread) starts the reaper.
        deadline = time.monotonic() + 20
        while len(os.listdir("/proc/self/task")) <= threads and time.monotonic() < deadline:
            time.sleep(0.05)
        dist.destroy_process_group()
        gc.collect()
        before = _steady()
        dist.init_process_group("tpcomm", store=dist.PrefixStore("again", store), rank=rank,
                                world_size=SIZE, timeout=timedelta(seconds=20))
        found = _lose_and_shrink(rank, default, how, store, conn)
        gc.collect()
        conn.send(("ok", found + (before, _settled(before))))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        import traceback

        conn.send(("error", traceback.format_exc() + f"\n{type(e).__name__}: {e}"))


def _ours(keys):
    return sorted(k for k in keys if "tpcomm" in k)


@pytest.mark.torch_version
@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("default", [False, True], ids=["subgroup", "default_group"])
def test_survivors_shrink_and_go_on_on_shared_memory(default, how, monkeypatch):
    monkeypatch.setenv("TPCOMM_CPU_SHM", "1")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    keys_before = _ours(store.list_keys())
    answers = dict(enumerate(first_answers(
        _survive, [(r, store.port, default, how) for r in range(SIZE)])))
    for r, (status, value) in answers.items():
        assert status == ("killed" if r == LOST else "ok"), (r, value)
    killed_at = answers[LOST][1]
    survivors = [r for r in range(SIZE) if r != LOST]
    for new_rank, r in enumerate(survivors):
        failure, failed_at, names, shm_calls, gloo_calls, before, after = answers[r][1]
        print(f"rank {r}: the fault after {failed_at - killed_at:.2f} s: {failure}")
        print(f"rank {r}: shrunk group {names}; calls cpu_shm {shm_calls}, gloo {gloo_calls}; "
              f"(shm mappings, sockets, threads) before {before}, after {after}")
        assert failure is not None and f"rank {LOST}" in failure, failure
        # Seen within the group's 20 s timeout: the peer's death, not a timeout.
        assert failed_at - killed_at < 10, failed_at - killed_at
        # A shrunk group's ranks; a reconfigured one's rank is its handle's place.
        assert names[:3] == (new_rank, SIZE - 1,
                             survivors if how == "shrink" else new_rank), names
        # A shrink makes a group of its own; a reconfigure re-forms this one.
        assert names[3].endswith(":shrunk") == (how == "shrink"), names
        # The parent's devices (CPU and CUDA), not only the one torch registers.
        assert names[4] == names[5] == ["cpu", "cuda"], names
        # Every one of the shrunk group's allreduces on shared memory.
        assert shm_calls == CALLS and gloo_calls == 0, (shm_calls, gloo_calls)
        assert after == before, (before, after)
    if default:
        # Every group destroyed on every survivor, the lost rank's part of
        # the old group ended by the shrink: no key of tpcomm's left.
        assert _ours(store.list_keys()) == keys_before, _ours(store.list_keys())


def _misuse(ctx):
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    bad = {
        "flags": lambda: backend.shrink([1 - ctx.rank], 2, None),
        "none": lambda: backend.shrink([], 0, None),
        "outside": lambda: backend.shrink([ctx.world_size], 0, None),
        "twice": lambda: backend.shrink([1 - ctx.rank, 1 - ctx.rank], 0, None),
        "itself": lambda: backend.shrink([ctx.rank], 0, None),
    }
    out = {name: error_message(call) for name, call in bad.items()}
    out["supports"] = backend.supports_shrinking
    # The group still works after every refusal.
    x = torch.ones(4)
    dist.all_reduce(x)
    out["after"] = x.tolist()
    return out


@pytest.mark.torch_version
def test_a_wrong_shrink_is_refused_naming_what_is_wrong(groups):
    for rank, out in enumerate(groups(2).run(_misuse)):
        assert "neither SHRINK_DEFAULT (0) nor SHRINK_ABORT (1)" in out["flags"], out
        assert "no rank to exclude" in out["none"], out
        assert "rank 2 to exclude is not one of its 2 ranks" in out["outside"], out
        assert f"rank {1 - rank} is excluded twice" in out["twice"], out
        assert f"rank {rank} excludes itself" in out["itself"], out
        assert out["after"] == [2.0] * 4, out
        assert out["supports"] is True, out
