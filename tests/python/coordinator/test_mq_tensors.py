"""CPU tensors inside message-queue objects (out of band, against plain
pickling), received tensors never aliasing later messages, corrupt frames,
and the zero-copy arena."""

import pickle

import pytest
import torch
import torch.distributed as dist

from harness import Group


class _Tagged(torch.Tensor):
    """A tensor subclass: travels through torch's own pickling."""


def _all_kinds():
    """An object holding every kind of tensor the queue treats differently."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 8, generator=g)
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
              torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
              torch.complex64, torch.complex128]
    by_dtype = {str(d): (torch.randn(5, 3, generator=g) * 4).to(d) for d in dtypes}
    # dtypes torch's own pickling cannot carry (its unpickler fails on them)
    exotic = {str(d): (torch.randn(5, 3, generator=g) * 4).to(d)
              for d in (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32)}
    leaf = torch.randn(4, generator=g, requires_grad=True)
    shared = torch.arange(10.0)
    loaded = torch.nn.Parameter(torch.randn(3, generator=g))
    loaded.weight_loader = "column"  # attributes travel with a tensor, as with pickle
    tagged = torch.arange(3)
    tagged.tag = {"shard": 1}
    return {
        "by_dtype": by_dtype,
        "exotic": exotic,
        "views": [base[1:4], base.t(), base[:, ::3], base[2], base.expand(2, 6, 8)],
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3, dtype=torch.int32),
        "empty_scalarless": torch.empty(7, 0),
        "conj": torch.randn(3, dtype=torch.complex64, generator=g).conj(),
        "neg": torch.randn(3, dtype=torch.complex64, generator=g).conj().imag,
        "param": torch.nn.Parameter(torch.randn(2, 2, generator=g)),
        "frozen_param": torch.nn.Parameter(torch.randn(2, generator=g), requires_grad=False),
        "leaf_grad": leaf,
        "non_leaf": leaf * 2,
        "subclass": torch.randn(3, generator=g).as_subclass(_Tagged),
        "with_attributes": [loaded, tagged],
        "nested": torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)]),
        "sparse": torch.randn(4, 4, generator=g).relu().to_sparse(),
        "csr": torch.eye(3).to_sparse_csr(),
        "quantized": torch.quantize_per_tensor(torch.randn(5, generator=g), 0.1, 3, torch.qint8),
        "meta": torch.empty(3, 4, device="meta"),
        "same_twice": (shared, shared),
        "tuple": (1, "two", [torch.ones(2, dtype=torch.int16), {"deep": torch.zeros(1)}]),
        "big": torch.arange(300_000, dtype=torch.float32),  # crosses the small ring's chunks
    }


def _same(got, want, path="obj"):
    """got (through the queue) matches want (through plain pickling): same
    types, dtypes, shapes, values and requires_grad; tensors contiguous."""
    assert type(got) is type(want), (path, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.__dict__ == want.__dict__, path
        if want.is_nested:
            assert got.is_nested and all(torch.equal(a, b) for a, b in zip(got.unbind(),
                                                                              want.unbind()))
            return
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert got.requires_grad == want.requires_grad, path
        assert got.layout == want.layout and got.device == want.device, path
        if want.is_meta:
            return
        if want.is_quantized:
            assert torch.equal(got.int_repr(), want.int_repr()), path
            assert got.q_scale() == want.q_scale() and got.q_zero_point() == want.q_zero_point()
            return
        if want.layout != torch.strided:
            assert torch.equal(got.to_dense(), want.to_dense()), path
            return
        if type(want) in (torch.Tensor, torch.nn.Parameter):
            assert got.is_contiguous(), path  # sent as contiguous bytes
        a, b = got.detach(), want.detach()
        if a.dtype.itemsize == 1 and a.dtype.is_floating_point:  # float8: compare the bits
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        elif a.dtype in (torch.uint16, torch.uint32):
            a, b = a.to(torch.int64), b.to(torch.int64)
        assert torch.equal(a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()), path
        return
    if isinstance(want, dict):
        assert list(got) == list(want), path
        for k in want:
            _same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            _same(a, b, f"{path}[{i}]")
    else:
        assert got == want, path


def _objects_round_trip(ctx, writer_rank):
    from tpcomm import MessageQueue
    mq = MessageQueue.create_from_process_group(dist.group.WORLD, max_chunk_bytes=1 << 16,
                                                max_chunks=4, writer_rank=writer_rank)
    # The reference: plain pickling, and the values themselves for the
    # dtypes plain pickling cannot carry.
    plain = _all_kinds()
    exotic = plain.pop("exotic")
    want = pickle.loads(pickle.dumps(plain))
    want = dict(**{k: want[k] for k in ("by_dtype",)}, exotic=exotic,
                **{k: v for k, v in want.items() if k != "by_dtype"})
    got = mq.broadcast_object(_all_kinds() if mq.is_writer else None)
    if not mq.is_writer:
        _same(got, want)
        assert got["same_twice"][0] is got["same_twice"][1]  # one tensor, twice (pickle's memo)
        assert type(got["param"]) is torch.nn.Parameter and got["non_leaf"].is_leaf
    # The same tensors as a tensor dict's values, nested: out of band too.
    tensors = {k: v for k, v in _all_kinds().items()
               if k not in ("sparse", "csr", "meta", "nested")}  # dense tensors only
    got = mq.broadcast_tensor_dict(tensors if mq.is_writer else None)
    if not mq.is_writer:
        _same(got, {k: want[k] for k in tensors})
    mq.shutdown()
    return len(mq.local_readers), len(mq.remote_readers)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_tensors_inside_objects_match_plain_pickling(groups, world_size):
    for writer_rank in {0, world_size - 1}:
        assert groups(world_size).run(_objects_round_trip, writer_rank)[writer_rank] == (
            world_size - 1, 0)


def test_tensors_inside_objects_reach_a_remote_reader():
    # Ranks 0, 1 on host "a", rank 2 on host "b": rank 2 receives the same
    # frame through the CPU group.
    group = Group(3, env_per_rank={0: {"TPCOMM_HOST_ID": "a"}, 1: {"TPCOMM_HOST_ID": "a"},
                                   2: {"TPCOMM_HOST_ID": "b"}})
    try:
        assert group.run(_objects_round_trip, 0)[0] == (1, 1)
        assert group.run(_objects_round_trip, 2)[2] == (0, 2)
        assert group.run(_arena)[0] == (1, 1)
    finally:
        group.close()


def _no_aliasing(ctx):
    from tpcomm import MessageQueue
    mq = MessageQueue.create_from_process_group(dist.group.WORLD, max_chunk_bytes=4096,
                                                max_chunks=2, writer_rank=0)
    kept = []
    for step in range(40):
        # Small messages in place in the ring, large ones wrapping it and
        # through recycled receive buffers.
        n = 100 if step % 2 else 200_000
        obj = {"step": step, "t": torch.full((n,), float(step)), "i": torch.arange(3) + step}
        got = mq.broadcast_object(obj if mq.is_writer else None)
        if not mq.is_writer:
            kept.append(got)
            got["t"].add_(1000)  # a reader's tensors are its own
    bad = [s for s, got in enumerate(kept)
           if not (torch.all(got["t"] == s + 1000) and torch.equal(got["i"], torch.arange(3) + s))]
    mq.shutdown()
    return bad


def test_received_tensors_never_change_with_later_messages(groups):
    assert groups(3).run(_no_aliasing) == [[], [], []]


def _device_tensor_refused(ctx):
    from tpcomm import MessageQueue
    mq = MessageQueue.create_from_process_group(dist.group.WORLD, writer_rank=0)
    if mq.is_writer:
        with pytest.raises(TypeError, match="broadcast_tensor_dict"):
            mq.broadcast_object({"x": torch.ones(2, device="cuda")})
        mq.broadcast_object("next")
        d = mq.broadcast_tensor_dict({"x": torch.arange(4, device="cuda"), "y": torch.ones(2)})
        return None
    got = mq.broadcast_object()
    d = mq.broadcast_tensor_dict()
    return got, d["x"].cpu().tolist(), d["x"].device.type, d["y"].tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA tensors)")
def test_cuda_tensors_inside_objects_are_refused_naming_tensor_dicts():
    group = Group(2)
    try:
        assert group.run(_device_tensor_refused)[1] == ("next", [0, 1, 2, 3], "cuda", [1.0, 1.0])
    finally:
        group.close()


def test_corrupt_and_truncated_frames_raise_clearly():
    from tpcomm import _C, _mq_pickle
    obj = {"a": torch.arange(10), "b": [torch.ones(2, 3, dtype=torch.bfloat16)], "c": "x"}
    parts, tensors, _ = _mq_pickle.Dumper().dump(obj)
    parts = list(parts)
    frame = _C.mq_pack_frame(parts, tensors)
    _same(_C.mq_load_frame(frame, _mq_pickle.loads_object), obj)
    for n in range(frame.numel()):  # every truncation
        with pytest.raises((OSError, pickle.UnpicklingError, EOFError)):
            cut = frame[:n].clone()
            if not _C.mq_is_frame(cut):
                raise OSError("not a frame")
            _C.mq_load_frame(cut, _mq_pickle.loads_object)
    # Header and table fields set to absurd values.
    g = torch.Generator().manual_seed(0)
    for field in (4, 8, 16, 24, 25, 26, 28, 32, 40, 48):
        for value in (0xFF, 0x7F, 0x01):
            bad = frame.clone()
            bad[field] = value
            bad[field + 1:field + 3] = torch.randint(0, 256, (2,), generator=g, dtype=torch.uint8)
            try:
                got = _C.mq_load_frame(bad, _mq_pickle.loads_object)
            except (OSError, pickle.UnpicklingError, EOFError, IndexError, ValueError) as e:
                assert "corrupt" in str(e) or not isinstance(e, OSError), e
                continue
            # A change that keeps the frame valid gives tensors of its sizes.
            assert isinstance(got, dict)


def _arena(ctx):
    from tpcomm import MessageQueue
    mq = MessageQueue.create_from_process_group(dist.group.WORLD, writer_rank=0,
                                                max_chunk_bytes=1 << 16, max_chunks=4,
                                                arena_bytes=1 << 20, timeout=20)
    local = mq.is_writer or ctx.rank in mq.local_readers
    if not mq.is_writer:
        with pytest.raises(RuntimeError, match="is for the writer"):
            mq.empty(4)
    # A filled arena tensor, a contiguous slice of it and a non-contiguous
    # view (copied) in one object; each reader sees the writer's values.
    if mq.is_writer:
        t = mq.empty((256, 256), torch.float32)  # 256 KiB
        t.copy_(torch.arange(65536.0).reshape(256, 256))
        obj = {"whole": t, "rows": t[10:20], "cols": t[:, 3], "tag": "first"}
    got = mq.broadcast_object(obj if mq.is_writer else None)
    want = torch.arange(65536.0).reshape(256, 256)
    assert torch.equal(got["whole"], want) and torch.equal(got["rows"], want[10:20])
    assert torch.equal(got["cols"], want[:, 3])
    # Zero copy on this host: the slice is a view of the same block as the whole.
    shares = got["rows"].data_ptr() == got["whole"].data_ptr() + 10 * 256 * 4
    assert shares == local or mq.is_writer
    if mq.is_writer:
        del t, obj
        # Readers still hold their views (`got`): 1 MiB minus 256 KiB held.
        a = mq.empty(3 << 18, torch.uint8)  # 768 KiB: fits beside it, exactly
        a.fill_(7)
        with pytest.raises(TimeoutError, match="held by readers' views"):
            mq.empty(1 << 18, torch.uint8, timeout=0.5)
        with pytest.raises(ValueError, match="does not fit an arena"):
            mq.empty(2 << 20, torch.uint8)
        del a
    dist.barrier()  # the writer saw the arena full while the readers kept `got`
    del got
    dist.barrier()
    # A block sent and dropped on every side is free again at once (nothing
    # of the last message stays referenced by the queue).
    for _ in range(3):
        if mq.is_writer:
            t = mq.empty(600 << 10, torch.uint8, timeout=5)  # more than half the arena
            t.fill_(3)
            mq.enqueue(t)
            del t
        else:
            assert int(mq.dequeue()[-1]) == 3
        dist.barrier()
    # A reader's forked child that drops its copy of a view does not give
    # back the reader's hold: the block stays the reader's while it lives.
    if mq.is_writer:
        t = mq.empty(600 << 10, torch.uint8)
        mq.enqueue(t)
        del t
    else:
        held = [mq.dequeue()]
        if local:
            _child_drops_its_copy(held)
    dist.barrier()
    if mq.is_writer and mq.local_readers:
        with pytest.raises(TimeoutError, match="held by readers' views"):
            mq.empty(600 << 10, torch.uint8, timeout=0.5)
    dist.barrier()
    held = None
    dist.barrier()
    # Readers dropped their views: the writer's blocks come back, and a new
    # message's tensor may reuse the memory of the first.
    for step in range(20):
        if mq.is_writer:
            t = mq.empty(1 << 18, torch.uint8, timeout=10)
            t.fill_(step)
            d = {"t": t, "step": step}
        got = mq.broadcast_tensor_dict(d if mq.is_writer else None)
        assert got["step"] == step and torch.all(got["t"] == step)
        if step == 0:
            first = got  # a reader keeps one message's view: it never changes
    assert torch.all(first["t"] == 0)
    mq.shutdown()
    return len(mq.local_readers), len(mq.remote_readers)


def _child_drops_its_copy(box):
    """Forks a child that drops its copy of the view in `box` (the only
    reference to it) and exits."""
    import gc
    import os
    pid = os.fork()
    if pid == 0:
        box.clear()
        gc.collect()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_arena_gives_zero_copy_views_with_safe_lifetimes(groups):
    assert groups(3).run(_arena)[0] == (2, 0)


def _no_arena(ctx):
    from tpcomm import MessageQueue
    mq = MessageQueue.create_from_process_group(dist.group.WORLD, writer_rank=0)
    if mq.is_writer:
        with pytest.raises(ValueError, match="no arena"):
            mq.empty(4)
    with pytest.raises(ValueError, match="arena_bytes"):
        MessageQueue.create_from_process_group(dist.group.WORLD, arena_bytes=-1)
    mq.shutdown()
    return True


def test_arena_is_opt_in_and_checked(groups):
    assert groups(2).run(_no_arena) == [True, True]
