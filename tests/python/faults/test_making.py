"""A group's making ends together (coordinator/group_life.hpp): no rank
returns a new group before every rank made its part, and a rank whose part
failed is named at once by every other.

Without it, a rank that made a group and destroyed it at once (vLLM's
switch of routes makes and drops groups this way) closed Gloo connections a
slower peer had not taken yet: that peer's making failed with "Connection
closed by peer" while the others went on, then waited out the timeout for
it in the next group. Here rank 0 is the slower one: its reads of the
peers' Gloo records come a second late, so every peer that opens its
connection to rank 0 is done with Gloo before rank 0 takes it.
"""

import time
from datetime import timedelta

import torch
import torch.distributed as dist

DELAY_S = 1.0


class _LateReads(dist.Store):
    """A Gloo group's store whose first read comes `delay_s` late: the rank's
    own record goes out at once, its connections a second later."""

    def __init__(self, inner, delay_s):
        super().__init__()
        self.inner, self.delay_s, self.late = inner, delay_s, True

    def set(self, key, value):
        return self.inner.set(key, value)

    def get(self, key):
        if self.late:
            self.late = False
            time.sleep(self.delay_s)
        return self.inner.get(key)

    def add(self, key, amount):
        return self.inner.add(key, amount)

    def check(self, keys):
        return self.inner.check(keys)

    def wait(self, keys, timeout=None):
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)


def _patched_gloo(ctx, rank, wrap):
    """Replaces, on `rank` only, how tpcomm makes its Gloo groups: `wrap(make)`
    is the new maker. Returns the function that puts the original back."""
    from tpcomm import _registration

    original = _registration._gloo_factory
    if ctx.rank == rank:
        _registration._gloo_factory = lambda make_devices: wrap(original(make_devices))

    def restore():
        _registration._gloo_factory = original
    return restore


def _made_and_dropped_at_once(ctx, rounds):
    restore = _patched_gloo(ctx, 0, lambda make: (
        lambda store, rank, size, timeout: make(_LateReads(store, DELAY_S), rank, size, timeout)))
    took = []
    try:
        for _ in range(rounds):
            start = time.monotonic()
            g = dist.new_group(list(range(ctx.world_size)), backend="tpcomm",
                               timeout=timedelta(seconds=60))
            took.append(time.monotonic() - start)
            dist.destroy_process_group(g)
            del g  # its Gloo group closes its connections now
    finally:
        restore()
    # Nothing of it is left behind: the world group still works.
    x = torch.full((3,), float(ctx.rank + 1))
    dist.all_reduce(x)
    return took, x.tolist()


def test_a_group_dropped_at_once_never_fails_a_slower_rank(groups):
    group = groups(4)
    rounds = 3
    results = group.run(_made_and_dropped_at_once, rounds, timeout_s=120)
    for rank, (took, world) in enumerate(results):
        assert len(took) == rounds
        # Every rank's new_group returned only once rank 0 (a second late)
        # had made its part.
        assert min(took) >= 0.9 * DELAY_S, (rank, took)
        assert world == [10.0] * 3, (rank, world)


class _Injected(RuntimeError):
    pass


def _one_part_fails(ctx, failing):
    """Rank `failing` makes its Gloo group, then its coordinator fails, while
    rank 0's Gloo reads come a second late: the failing rank must keep its
    Gloo group until rank 0 took its connections."""
    from tpcomm import _C

    original = _C.ProcessGroupTpcomm

    def failing_coordinator(*args, **kwargs):
        del args, kwargs  # the traceback keeps no reference to the Gloo group
        raise _Injected("injected failure after the Gloo group")

    if ctx.rank == failing:
        _C.ProcessGroupTpcomm = failing_coordinator
    restore = _patched_gloo(ctx, 0, lambda make: (
        lambda store, rank, size, timeout: make(_LateReads(store, DELAY_S), rank, size, timeout)))
    start = time.monotonic()
    try:
        dist.new_group(list(range(ctx.world_size)), backend="tpcomm",
                       timeout=timedelta(seconds=60))
        error = None
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        error = f"{type(e).__name__}: {e}"
    finally:
        _C.ProcessGroupTpcomm = original
        restore()
    took = time.monotonic() - start
    x = torch.full((3,), float(ctx.rank + 1))
    dist.all_reduce(x)
    return error, took, x.tolist()


def test_a_rank_whose_part_failed_is_named_at_once_by_every_rank(groups):
    group = groups(4)
    failing = 2
    results = group.run(_one_part_fails, failing, timeout_s=120)
    for rank, (error, took, world) in enumerate(results):
        assert error is not None, f"rank {rank} made a group rank {failing} failed to make"
        if rank == failing:
            assert "_Injected: injected failure after the Gloo group" in error, error
        else:
            assert "PeerLost" in error, error
            assert (f"rank {rank} made its part of the group, but not every rank did: "
                    f"rank {failing}: _Injected: injected failure after the Gloo group") in error, error
        # At once, not at the group's 60 s timeout.
        assert took < 30, (rank, took, error)
        assert world == [10.0] * 3, (rank, world)
