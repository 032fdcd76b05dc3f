"""tpcomm.MessageQueue through real process groups at world sizes 2 to 4,
including two simulated hosts (TPCOMM_HOST_ID) and subgroups."""

import glob
import os

import pytest
import torch
import torch.distributed as dist

from harness import Group


def _step_dict(step):
    g = torch.Generator().manual_seed(step)
    return {
        "input_ids": torch.randint(0, 32000, (4, 64), generator=g),
        "positions": torch.arange(64, dtype=torch.int64) + step,
        "slot_mapping": torch.randint(0, 1 << 20, (64,), generator=g),
        "block_table": torch.randint(0, 1000, (4, 16), generator=g).to(torch.int32),
        "hidden": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "mask": torch.rand(7, generator=g) > 0.5,
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "step": step,
        "temperature": 0.7,
        "greedy": True,
        "name": "decode",
        "nothing": None,
        "nested": {"a": [1, 2, (3, "x")], "b": {"c": step}},
    }


def assert_dicts_equal(got, want):
    assert list(got) == list(want), (list(got), list(want))
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def _roundtrips(ctx, writer_rank, chunk_bytes):
    from tpcomm import MessageQueue
    mq = MessageQueue.create_from_process_group(dist.group.WORLD, max_chunk_bytes=chunk_bytes,
                                                max_chunks=4, writer_rank=writer_rank)
    objects = [None, 0, "x" * 10, list(range(1000)), {"k": b"\x00" * 70000}, b""]
    for obj in objects:
        got = mq.broadcast_object(obj if mq.is_writer else None)
        assert got == obj, (got, obj)
    for step in range(20):
        want = _step_dict(step)
        got = mq.broadcast_tensor_dict(want if mq.is_writer else None)
        assert_dicts_equal(got, want)
    big = {"w": torch.arange(3 << 20, dtype=torch.float32)}  # 12 MiB through a small ring
    got = mq.broadcast_tensor_dict(big if mq.is_writer else None)
    assert_dicts_equal(got, big)
    return len(mq.local_readers), len(mq.remote_readers)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_objects_and_tensor_dicts_reach_every_reader(groups, world_size):
    for writer_rank in {0, world_size - 1}:
        results = groups(world_size).run(_roundtrips, writer_rank, 4096)
        assert results[0] == (world_size - 1, 0)  # one host: every reader on shared memory


def test_two_simulated_hosts():
    # Ranks 0,1 on host "a", ranks 2,3 on host "b": rank 1 reads shared memory,
    # ranks 2 and 3 receive through the CPU group.
    group = Group(4, env_per_rank={0: {"TPCOMM_HOST_ID": "a"}, 1: {"TPCOMM_HOST_ID": "a"},
                                   2: {"TPCOMM_HOST_ID": "b"}, 3: {"TPCOMM_HOST_ID": "b"}})
    try:
        results = group.run(_roundtrips, 0, 1 << 16)
        assert results[0] == (1, 2)
        results = group.run(_roundtrips, 3, 1 << 16)  # writer on host b
        assert results[0] == (1, 2)
        # One reader, every other rank a writer: shared memory from its own
        # host, the CPU group from the other.
        assert group.run(_single_reader, 0)[0] == [(1, 0), (0, 1), (0, 1)]
        assert group.run(_single_reader, 3)[3] == [(0, 1), (0, 1), (1, 0)]
    finally:
        group.close()


def _single_reader(ctx, reader_rank):
    from tpcomm import MessageQueue
    writer, readers = MessageQueue.create_single_reader(dist.group.WORLD, reader_rank,
                                                        max_chunk_bytes=4096, max_chunks=4)
    if ctx.rank != reader_rank:
        assert readers == [] and writer.is_writer
        writer.enqueue(("from", ctx.rank))  # blocking=False: the first write waits for the reader
        writer.broadcast_tensor_dict(_step_dict(ctx.rank))
        writer.shutdown()
        return None
    assert writer is None and len(readers) == ctx.world_size - 1
    senders = [r for r in range(ctx.world_size) if r != reader_rank]
    for r, q in zip(senders, readers):
        assert q.dequeue(timeout=30) == ("from", r)
        assert_dicts_equal(q.broadcast_tensor_dict(), _step_dict(r))
    counts = [(len(q.local_readers), len(q.remote_readers)) for q in readers]
    for q in readers:
        q.shutdown()
    return counts


def _subgroup_queue(ctx):
    from tpcomm import MessageQueue
    w = ctx.world_size
    odds = list(range(1, w, 2))
    evens = list(range(0, w, 2))
    groups = [dist.new_group(evens), dist.new_group(odds)]
    mine = groups[ctx.rank % 2]
    members = odds if ctx.rank % 2 else evens
    mq = MessageQueue.create_from_process_group(mine, writer_rank=len(members) - 1)
    got = mq.broadcast_object({"from": ctx.rank} if mq.is_writer else None)
    other = groups[1 - ctx.rank % 2]
    try:
        MessageQueue.create_from_process_group(other)
        refused = None
    except ValueError as e:
        refused = str(e)
    return got == {"from": members[-1]}, refused


def test_subgroups_have_their_own_queues(groups):
    for ok, refused in groups(4).run(_subgroup_queue):
        assert ok
        assert refused is not None and "is not a member of the group" in refused, refused


def _misuse(ctx):
    from tpcomm import MessageQueue
    mq = MessageQueue.create_from_process_group(dist.group.WORLD, writer_rank=0)
    messages = {}
    try:
        if mq.is_writer:
            mq.dequeue(timeout=1)
        else:
            mq.enqueue("x")
    except RuntimeError as e:
        messages["role"] = str(e)
    if not mq.is_writer:
        try:
            mq.dequeue(timeout=0.3)
        except TimeoutError as e:
            messages["timeout"] = str(e)
    try:
        MessageQueue.create_from_process_group(dist.group.WORLD, writer_rank=7)
    except ValueError as e:
        messages["writer_rank"] = str(e)
    dist.barrier()
    mq.shutdown()
    try:
        mq.broadcast_object("late" if mq.is_writer else None)
    except tpcomm_peer_lost() as e:
        messages["shutdown"] = str(e)
    return messages


def tpcomm_peer_lost():
    from tpcomm import PeerLostError
    return PeerLostError


def test_misuse_timeouts_and_shutdown_raise_clearly(groups):
    results = groups(2).run(_misuse)
    writer, reader = results
    assert "dequeue is for a reader; group rank 0 is the writer" in writer["role"]
    assert "enqueue is for the writer; group rank 1 is a reader" in reader["role"]
    assert "timed out" in reader["timeout"]
    for r in results:
        assert "writer_rank 7 is out of range for a group of 2" in r["writer_rank"]
        assert "shut down" in r["shutdown"]


def _leftovers(ctx):
    from tpcomm import MessageQueue
    mq = MessageQueue.create_from_process_group(dist.group.WORLD)
    mq.broadcast_object("hi" if mq.is_writer else None)
    return sorted(glob.glob("/dev/shm/tpcomm-mq-*"))


def test_nothing_left_in_dev_shm(groups):
    before = set(glob.glob("/dev/shm/tpcomm-mq-*"))
    for names in groups(3).run(_leftovers):
        assert not set(names) - before, names
    assert set(glob.glob("/dev/shm/tpcomm-mq-*")) <= before
    assert os.path.isdir("/dev/shm")


def _large_messages_never_alias(ctx):
    from tpcomm import MessageQueue
    mq = MessageQueue.create_from_process_group(dist.group.WORLD, max_chunk_bytes=1 << 20)
    kept = []
    for i in range(4):  # several large messages, all kept alive
        d = {"x": torch.full((1 << 20,), i, dtype=torch.int32)}  # 4 MiB: recycled buffers
        kept.append(mq.broadcast_tensor_dict(d if mq.is_writer else None))
    for i, d in enumerate(kept):
        assert torch.equal(d["x"], torch.full((1 << 20,), i, dtype=torch.int32)), i
    kept.clear()  # buffers come back; later messages reuse them
    for i in range(4):
        d = {"x": torch.full((1 << 20,), 10 + i, dtype=torch.int32)}
        got = mq.broadcast_tensor_dict(d if mq.is_writer else None)
        assert torch.equal(got["x"], d["x"]), i
    return True


def test_large_messages_never_alias_live_tensors(groups):
    assert all(groups(2).run(_large_messages_never_alias))


def _bad_arguments(ctx):
    import time

    from tpcomm import MessageQueue
    errors = {}
    cases = {
        "max_chunk_bytes=0": dict(max_chunk_bytes=0),
        "max_chunks=-1": dict(max_chunks=-1),
        "writer_rank='0'": dict(writer_rank="0"),
        "writer_rank=True": dict(writer_rank=True),
        "timeout=0": dict(timeout=0),
    }
    for name, kwargs in cases.items():
        start = time.monotonic()
        try:
            MessageQueue.create_from_process_group(dist.group.WORLD, **kwargs)
            errors[name] = "no error"
        except (TypeError, ValueError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
        assert time.monotonic() - start < 5, name  # at once, not at the group's timeout
    try:
        MessageQueue.create_single_reader(dist.group.WORLD, reader_rank="1")
        errors["reader_rank='1'"] = "no error"
    except TypeError as e:
        errors["reader_rank='1'"] = f"TypeError: {e}"
    # The group is still usable: a queue with good arguments works.
    mq = MessageQueue.create_from_process_group(dist.group.WORLD)
    assert mq.broadcast_object({"ok": ctx.rank if mq.is_writer else None})["ok"] == 0
    return errors


def test_bad_arguments_raise_on_every_rank_and_the_group_stays_usable(groups):
    results = groups(3).run(_bad_arguments)
    assert all(r == results[0] for r in results), results  # the same error everywhere
    errors = results[0]
    assert errors["max_chunk_bytes=0"] == \
        "ValueError: max_chunk_bytes must be in [64, 4294967232], got 0"
    assert errors["max_chunks=-1"] == "ValueError: max_chunks must be in [1, 1048576], got -1"
    assert errors["writer_rank='0'"] == "TypeError: writer_rank must be an int, got '0' (str)"
    assert errors["writer_rank=True"] == "TypeError: writer_rank must be an int, got True (bool)"
    assert errors["timeout=0"] == \
        "ValueError: timeout must be a positive number of seconds, got 0"
    assert errors["reader_rank='1'"] == "TypeError: reader_rank must be an int, got '1' (str)"


def _objects_outlive_the_ring(ctx):
    import numpy as np

    from tpcomm import MessageQueue
    # A 4-chunk ring of 4 KiB: small objects are unpickled in place, large ones
    # wrap or exceed the ring and are copied first.
    mq = MessageQueue.create_from_process_group(dist.group.WORLD, max_chunk_bytes=4096,
                                                max_chunks=4)
    kept = []
    for i in range(60):
        obj = {"array": np.arange(100 + 37 * i, dtype=np.int64) * i,
               "blob": bytearray([i % 251]) * (50 * i), "text": "x" * i}
        got = mq.broadcast_object(obj if mq.is_writer else None)
        kept.append((i, got))
    for i, got in kept:  # later messages overwrote the ring: nothing aliases it
        assert np.array_equal(got["array"], np.arange(100 + 37 * i, dtype=np.int64) * i), i
        assert got["blob"] == bytearray([i % 251]) * (50 * i) and got["text"] == "x" * i, i
    return True


def test_objects_unpickled_from_the_ring_outlive_it(groups):
    assert all(groups(2).run(_objects_outlive_the_ring))
