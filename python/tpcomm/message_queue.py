"""Broadcast objects and tensor dicts from one rank to the others of a group.

Readers on the writer's host read a shared-memory ring (one copy in; objects
without tensors are unpickled straight from the ring); readers on other
hosts receive the same bytes through the group's CPU path (Gloo). The ring is
anonymous memory (nothing in /dev/shm, ever), and waits poll for
TPCOMM_MQ_SPIN_US before they sleep.

CPU tensors anywhere inside an object or a tensor dict travel out of band:
their bytes raw beside the pickle stream (tpcomm._mq_pickle says what becomes
of every kind of tensor). CUDA tensors in a tensor dict travel through the
group's device path (NCCL) while their metadata travels through the queue.
With `arena_bytes`, the writer can place large tensors in shared memory
itself (`mq.empty`) and send them without any copy.

    mq = tpcomm.MessageQueue.create_from_process_group(pg, writer_rank=0)
    d = mq.broadcast_tensor_dict(d if mq.is_writer else None)
"""

import math
import numbers
import pickle

import torch
import torch.distributed as dist

from tpcomm import _C
from tpcomm import _mq_pickle
from tpcomm._tensor_dict import check_dense

PeerLostError = _C.PeerLostError


def _check_arguments(role, role_rank, max_chunk_bytes, max_chunks, timeout, arena_bytes=0):
    """The same arguments on every rank: checked before any collective step,
    so that every rank raises the same error and the group stays usable."""
    def integer(name, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        return int(value)

    integer(role, role_rank)
    for name, value, low, high in (("max_chunk_bytes", max_chunk_bytes, 64, (1 << 32) - 64),
                                   ("max_chunks", max_chunks, 1, 1 << 20)):
        if not low <= integer(name, value) <= high:
            raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    if max_chunk_bytes * max_chunks > 64 << 30:
        raise ValueError(f"a ring of {max_chunks} x {max_chunk_bytes} bytes exceeds 64 GiB")
    if not 0 <= integer("arena_bytes", arena_bytes) <= 64 << 30:
        raise ValueError(f"arena_bytes must be in [0, 64 GiB], got {arena_bytes}")
    if (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
            or not math.isfinite(timeout) or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def _agree(pg, failure, what):
    """Collective: every rank's failure message ('' when none); raises the
    first on every rank, naming its group rank."""
    failures = [None] * dist.get_world_size(pg)
    dist.all_gather_object(failures, failure, group=pg)
    for rank, text in enumerate(failures):
        if text:
            raise RuntimeError(f"message queue: {what} failed on group rank {rank}: {text}")


def _check_tensor_dict(tensor_dict):
    """Raises naming the first key whose entry a tensor dict cannot carry."""
    for key, value in tensor_dict.items():
        if not isinstance(key, str):
            raise TypeError(f"tensor dict keys must be str, got {key!r}")
        if isinstance(value, torch.Tensor):
            check_dense(key, value)
            if value.device.type not in ("cpu", "cuda"):
                raise ValueError(f"tensor {key!r} is on {value.device}; cpu and cuda "
                                 "tensors are supported")


def _failure(e):
    return f"{type(e).__name__}: {e}"


def _membership(pg, role, role_rank):
    """(pg, its global ranks, this process's group rank), refusing a
    non-member and a `role_rank` outside the group."""
    if pg is None:
        pg = dist.group.WORLD
    ranks = dist.get_process_group_ranks(pg)
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"rank {me} is not a member of the group {ranks}; only members "
                         "create its message queue")
    if not 0 <= role_rank < len(ranks):
        raise ValueError(f"{role} {role_rank} is out of range for a group of {len(ranks)}")
    return pg, ranks, ranks.index(me)


class MessageQueue:
    """One writer, the other members of `pg` readers. Use the constructor
    `create_from_process_group`; every member of `pg` must call it."""

    def __init__(self, pg, writer_rank, rank, local, remote, writer, reader, timeout,
                 device_group=None, arena=None):
        self._pg = pg
        self._device_pg = pg if device_group is None else device_group
        self._ranks = dist.get_process_group_ranks(pg)
        self.writer_rank = writer_rank  # group rank
        self.rank = rank  # group rank of this process
        self.local_readers = local
        self.remote_readers = remote
        self._writer = writer
        self._reader = reader
        self._timeout = timeout
        self._arena = arena
        self._dumper = _mq_pickle.Dumper()
        self._arena_bytes = 0 if arena is None else arena.capacity
        self._closed = False
        self._ready = writer is None
        # Objects pickled into parts and unpickled from the ring (False: one
        # bytes object each way, copied out first: the queue before this).
        self._zero_copy = True
        # Every other member reads: CUDA tensors are broadcast; otherwise they
        # go to each reader point to point.
        self._whole_group = len(local) + len(remote) == len(self._ranks) - 1

    @classmethod
    def create_from_process_group(cls, pg, max_chunk_bytes=1 << 20, max_chunks=8,
                                  writer_rank=0, timeout=300.0, blocking=True,
                                  device_group=None, arena_bytes=0):
        """Every member of `pg` calls this; `writer_rank` (a group rank) writes,
        the others read. With blocking=False the writer does not wait here for
        the readers to attach; wait_until_ready() (or the first write) does.
        CUDA tensors in tensor dicts travel over `device_group` (default `pg`),
        which must have the same members. `arena_bytes` > 0 gives the writer
        an arena of that many bytes of shared memory for `empty()` (zero-copy
        tensors). Bad arguments raise on every rank before any collective
        step; a rank that cannot create or attach its end makes every rank
        raise, naming it; the group stays usable."""
        _check_arguments("writer_rank", writer_rank, max_chunk_bytes, max_chunks, timeout,
                         arena_bytes)
        pg, ranks, rank = _membership(pg, "writer_rank", writer_rank)
        n = len(ranks)
        hosts = [None] * n
        dist.all_gather_object(hosts, _C.host_id(), group=pg)
        local = [r for r in range(n) if r != writer_rank and hosts[r] == hosts[writer_rank]]
        remote = [r for r in range(n) if r != writer_rank and hosts[r] != hosts[writer_rank]]
        writer = reader = arena = None
        name = [("ok", None)]
        if rank == writer_rank and local:
            try:
                writer = _C.MqWriter(len(local), max_chunks, max_chunk_bytes)
                if arena_bytes:
                    arena = _C.MqArena(arena_bytes)
                name = [("ok", (writer.name, arena.name if arena is not None else None))]
            except Exception as e:  # every rank hears of it below
                name = [("error", _failure(e))]
        dist.broadcast_object_list(name, src=ranks[writer_rank], group=pg)
        status, value = name[0]
        if status != "ok":
            raise RuntimeError(f"message queue: the writer (group rank {writer_rank}) could not "
                               f"create its ring: {value}")
        failure = ""
        if rank in local:
            try:
                ring_name, arena_name = value
                if arena_name is not None:
                    arena = _C.MqArena.attach(arena_name)
                reader = _C.MqReader(ring_name, local.index(rank))
            except Exception as e:
                failure = _failure(e)
        _agree(pg, failure, "attaching a reader")
        mq = cls(pg, writer_rank, rank, local, remote, writer, reader, timeout, device_group,
                 arena)
        mq._arena_bytes = arena_bytes
        if blocking:
            mq.wait_until_ready()
        return mq

    @classmethod
    def create_single_reader(cls, pg, reader_rank=0, max_chunk_bytes=1 << 20, max_chunks=8,
                             timeout=300.0, blocking=False, device_group=None):
        """Every member of `pg` calls this: each member but `reader_rank` (a
        group rank) gets a queue it writes to that rank alone; the reader gets
        one queue per writer. Returns (queue, []) on writers and
        (None, [queue of group rank 0, 1, ... skipping the reader]) on the
        reader. Arguments and failures as in create_from_process_group."""
        _check_arguments("reader_rank", reader_rank, max_chunk_bytes, max_chunks, timeout)
        pg, ranks, rank = _membership(pg, "reader_rank", reader_rank)
        n = len(ranks)
        host = _C.host_id()
        writer = None
        entry = (host, None)
        # Writers on the reader's host make a one-reader ring; its name goes
        # to the reader in a second all-gather.
        hosts = [None] * n
        dist.all_gather_object(hosts, host, group=pg)
        same_host = hosts[rank] == hosts[reader_rank]
        failure = ""
        if rank != reader_rank and same_host:
            try:
                writer = _C.MqWriter(1, max_chunks, max_chunk_bytes)
                entry = (host, writer.name)
            except Exception as e:
                failure = _failure(e)
        _agree(pg, failure, "creating a writer's ring")
        entries = [None] * n
        dist.all_gather_object(entries, entry, group=pg)
        attached = {}
        failure = ""
        if rank == reader_rank:
            try:
                for w in range(n):
                    if w != reader_rank and entries[w][1] is not None:
                        attached[w] = _C.MqReader(entries[w][1], 0)
            except Exception as e:
                failure = _failure(e)
        _agree(pg, failure, "attaching the reader")
        if rank != reader_rank:
            local, remote = ([reader_rank], []) if same_host else ([], [reader_rank])
            mq = cls(pg, rank, rank, local, remote, writer, None, timeout, device_group)
            if blocking:
                mq.wait_until_ready()
            return mq, []
        readers = []
        for w in range(n):
            if w == reader_rank:
                continue
            reader = attached.get(w)
            local, remote = ([rank], []) if reader is not None else ([], [rank])
            readers.append(cls(pg, w, rank, local, remote, None, reader, timeout, device_group))
        return None, readers

    def set_spin_us(self, us):
        """How long this rank's waits on the ring poll before they sleep
        (default TPCOMM_MQ_SPIN_US; 0: a fixed 4,000 polls)."""
        for end in (self._writer, self._reader):
            if end is not None:
                end.set_spin_us(int(us))

    def wait_until_ready(self, timeout=None):
        """Writer: waits until every reader on this host attached (then the
        descriptor they attach through is closed). Readers: returns at once."""
        if not self._ready:
            self._writer.wait_for_readers(self._timeout if timeout is None else timeout)
            if self._arena is not None:
                self._arena.close_descriptor()  # every reader mapped it before the ring
            self._ready = True

    @property
    def is_writer(self):
        return self.rank == self.writer_rank

    # -------------------------------------------------------------- raw bytes
    def _check(self, writer_side, what):
        if self._closed:
            raise PeerLostError(f"{what}: the message queue was shut down")
        if writer_side != self.is_writer:
            role = "the writer" if writer_side else "a reader"
            raise RuntimeError(f"{what} is for {role}; group rank {self.rank} is "
                               f"{'the writer' if self.is_writer else 'a reader'} "
                               f"(writer: group rank {self.writer_rank})")

    def _send(self, parts, timeout, tensors=None):
        """One message: the pickle stream `parts` and, when `tensors` is not
        None, as a frame with those tensors out of band."""
        timeout = self._timeout if timeout is None else timeout
        if self._writer is not None:
            self.wait_until_ready(timeout)
            if tensors is None:
                self._writer.write(parts, timeout)
            else:
                self._writer.write_frame(parts, tensors, timeout, self._arena)
        if self.remote_readers:
            if tensors is None:
                data = bytearray(b"".join(memoryview(p).cast("B") for p in parts))
                payload = torch.frombuffer(data, dtype=torch.uint8) if data else None
            else:
                payload = _C.mq_pack_frame(parts, tensors)
            length = 0 if payload is None else payload.numel()
            for r in self.remote_readers:
                dist.send(torch.tensor([length], dtype=torch.int64), group=self._pg, group_dst=r)
                if length:
                    dist.send(payload, group=self._pg, group_dst=r)

    def _recv(self, timeout):
        timeout = self._timeout if timeout is None else timeout
        if self._reader is not None:
            return self._reader.read(timeout)
        length = torch.empty(1, dtype=torch.int64)
        dist.recv(length, group=self._pg, group_src=self.writer_rank)
        buf = torch.empty(int(length), dtype=torch.uint8)
        if buf.numel():
            dist.recv(buf, group=self._pg, group_src=self.writer_rank)
        return buf

    def _recv_loaded(self, timeout, loads_frame):
        """The next message unpickled: a frame through `loads_frame`, a plain
        pickle stream through pickle.loads."""
        if self._reader is not None and self._zero_copy:
            return self._reader.read_object(self._timeout if timeout is None else timeout,
                                            loads_frame, self._arena)
        buf = self._recv(timeout)
        if _C.mq_is_frame(buf):
            return _C.mq_load_frame(buf, loads_frame, self._arena)
        return pickle.loads(buf.numpy())

    def _send_device(self, t):
        if self._whole_group:
            dist.broadcast(t, src=self._ranks[self.writer_rank], group=self._device_pg)
            return
        for r in self.local_readers + self.remote_readers:
            dist.send(t, group=self._device_pg, group_dst=r)

    def _recv_device(self, t):
        if self._whole_group:
            dist.broadcast(t, src=self._ranks[self.writer_rank], group=self._device_pg)
        else:
            dist.recv(t, group=self._device_pg, group_src=self.writer_rank)

    # -------------------------------------------------------------- objects
    def enqueue(self, obj, timeout=None):
        """Writer: sends `obj` (pickled, protocol 5) to every reader. The
        pickler writes into a list of parts, so large bytes-like payloads are
        passed by reference and copied once, into the ring; CPU tensors at any
        depth of `obj` travel out of band, their bytes raw (see
        tpcomm._mq_pickle for every kind of tensor); a CUDA tensor is refused
        (TypeError: send it with broadcast_tensor_dict)."""
        self._check(True, "enqueue")
        if not self._zero_copy:
            self._send([pickle.dumps(obj, protocol=5)], timeout)
            return
        parts, tensors, _ = self._dumper.dump(obj)
        try:
            self._send(parts, timeout, tensors if tensors else None)
        finally:
            self._dumper.clear()

    def dequeue(self, timeout=None):
        """Reader: the next object the writer enqueued. Raises TimeoutError.
        Readers on another host than the writer receive through the CPU group,
        whose own timeout bounds the wait instead of `timeout`.

        The CPU tensors inside it are this reader's own: views of one buffer
        per message that no later message changes (they keep that buffer
        alive while any of them lives). Tensors the writer placed in the
        arena (`empty`) are views of the arena instead: valid while they
        live (the writer never reuses their memory before they die), shared
        with the writer and every other reader of this host, so they are
        read-only by contract."""
        self._check(False, "dequeue")
        return self._recv_loaded(timeout, _mq_pickle.loads_object)

    def broadcast_object(self, obj=None):
        """The writer passes `obj`; every member returns it."""
        if self.is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    # -------------------------------------------------------------- arena
    def empty(self, shape, dtype=torch.float32, timeout=None):
        """Writer: an uninitialised CPU tensor in the queue's arena (create
        the queue with arena_bytes > 0). Fill it, then send it (in an object
        or a tensor dict, whole or any contiguous view of it): this host's
        readers receive views of the same memory, with no copy; readers on
        other hosts receive a copy. Do not write into it once sent: the
        readers see that memory. Its block is reused only after this tensor
        and every reader's view of it died; while the arena is full this
        waits up to `timeout` (default: the queue's) and then raises
        TimeoutError saying what holds it."""
        self._check(True, "empty")
        if self._arena is None:
            if self._arena_bytes and self._writer is None:
                # No reader on this host: every reader receives a copy anyway.
                return torch.empty(shape, dtype=dtype)
            raise ValueError("this message queue has no arena: create it with arena_bytes > 0")
        shape = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
        return self._arena.empty(list(shape), dtype,
                                 self._timeout if timeout is None else timeout, self._writer)

    def arena_use(self):
        """The writer's arena: bytes in use, by whom (a string), or None."""
        return None if self._arena is None else self._arena.describe_use()

    # -------------------------------------------------------------- tensor dicts
    def broadcast_tensor_dict(self, tensor_dict=None):
        """The writer passes a dict of str -> tensor | picklable value; every
        member returns an equal dict. CPU tensor bytes travel raw, out of band
        (never pickled; the received tensors are views of one buffer per
        message, or of the arena, as in dequeue); CUDA tensors are broadcast
        over the group's device path; empty tensors cost no bytes."""
        if self.is_writer:
            if not isinstance(tensor_dict, dict):
                raise TypeError(f"broadcast_tensor_dict needs a dict, got {type(tensor_dict)}")
            try:
                parts, tensors, device = self._dumper.dump(tensor_dict, _mq_pickle.COLLECT)
                if any(type(key) is not str for key in tensor_dict):
                    raise TypeError("tensor dict keys must be str")
            except (TypeError, ValueError):
                _check_tensor_dict(tensor_dict)  # names the key at fault
                raise
            self._check(True, "broadcast_tensor_dict")
            try:
                self._send(parts, None, tensors)
            finally:
                self._dumper.clear()
            for t in device:
                if t.numel():
                    self._send_device(t)
            return tensor_dict
        self._check(False, "broadcast_tensor_dict")
        got = self._recv_loaded(None, _mq_pickle.loads_tensor_dict)
        if not isinstance(got, tuple):
            raise OSError("broadcast_tensor_dict received a message that is not a tensor dict "
                          "(the writer sent an object: its calls and the readers' differ)")
        out, device = got
        for t in device:
            if t.numel():
                self._recv_device(t)
        return out

    def shutdown(self):
        """Wakes every waiter on this host's ring; later calls raise PeerLostError."""
        self._closed = True
        for end in (self._writer, self._reader):
            if end is not None:
                end.shutdown()
