"""A group's store keys end with its life (coordinator/group_life.hpp,
endLife): a serving process that makes and drops groups for days must not
grow its store. Two ranks make, use and destroy 1,000 groups on one
TCPStore, then abort and destroy 10 more; tpcomm's keys are counted before
and after."""

import re
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks

GROUPS = 1000


def _ours(keys):
    # tpcomm's own keys and everything under a life's prefix (its Gloo
    # groups' records, its device backend's).
    return sorted(k for k in keys if "tpcomm" in k)


def _worker(rank, world, port, groups, results):
    import tpcomm  # noqa: F401  (registers the backend)

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("tpcomm", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    x = torch.ones(4)
    dist.all_reduce(x)
    dist.barrier()
    before = store.list_keys()
    dist.barrier()
    for i in range(groups):
        group = dist.new_group(list(range(world)), backend="tpcomm")
        y = torch.full((4,), float(i))
        dist.all_reduce(y, group=group)
        assert y.tolist() == [2.0 * i] * 4, (i, y)
        dist.destroy_process_group(group)
    # Aborted groups (rank 0 aborts, the group breaks on both ranks) go too,
    # their fault lines included.
    for i in range(10):
        group = dist.new_group(list(range(world)), backend="tpcomm")
        dist.all_reduce(torch.ones(4), group=group)
        if rank == 0:
            group._get_backend(torch.device("cpu")).abort()
        try:
            dist.all_reduce(torch.ones(4), group=group)
        except Exception as e:  # noqa: BLE001 (the group is broken: any error)
            assert "aborted the group" in str(e), e
        else:
            raise AssertionError("an aborted group's call returned")
        dist.destroy_process_group(group)
    dist.barrier()
    after = store.list_keys()
    dist.barrier()
    if rank == 0:
        results.put((before, after))
    dist.destroy_process_group()


def test_a_thousand_groups_made_and_destroyed_leave_no_key_of_theirs():
    got = run_ranks(_worker, 2, lambda r: (GROUPS,), 600)
    assert got is not None, "a rank failed (see its output above)"
    before, after = got
    mine_before, mine_after = _ours(before), _ours(after)
    grew = sorted(set(after) - set(before))
    # torch's own keys (its rendezvous, store-based barriers), for the record.
    kinds = sorted({re.sub(r"\d+", "N", k) for k in grew})
    print(f"store keys: {len(before)} before, {len(after)} after {GROUPS} groups; "
          f"tpcomm's {len(mine_before)} -> {len(mine_after)}; new kinds: {kinds[:10]}")
    assert mine_after == mine_before, (
        f"{len(set(mine_after) - set(mine_before))} keys of tpcomm's left after {GROUPS} "
        f"groups were destroyed, e.g. {sorted(set(mine_after) - set(mine_before))[:5]}")
