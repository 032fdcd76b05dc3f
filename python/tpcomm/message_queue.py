"""Broadcast objects and tensor dicts from one rank to the others of a group.

Readers on the writer's host read a shared-memory ring (one copy in; objects
are unpickled straight from the ring, tensor dicts copied out once); readers
on other hosts receive through the group's CPU path (Gloo). The ring is
anonymous memory (nothing in /dev/shm, ever), and waits poll for
TPCOMM_MQ_SPIN_US before they sleep.
CUDA tensors in a tensor dict travel through the group's device path (NCCL)
while their metadata travels through the queue.

    mq = tpcomm.MessageQueue.create_from_process_group(pg, writer_rank=0)
    d = mq.broadcast_tensor_dict(d if mq.is_writer else None)
"""

import math
import numbers
import pickle
import struct

import torch
import torch.distributed as dist

from tpcomm import _C
from tpcomm._tensor_dict import check_dense

PeerLostError = _C.PeerLostError

_ALIGN = 64  # tensor bytes start 64-byte aligned inside a message
_LEN = struct.Struct("<Q")


def _raw_bytes(t):
    """A CPU tensor's bytes as a buffer, without a copy for contiguous tensors."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


class _Parts:
    """A file for pickle.Pickler that keeps what it is given: small pieces
    and, for large bytes-like payloads, the payload itself (no copy)."""

    def __init__(self, parts):
        self.write = parts.append


def _check_arguments(role, role_rank, max_chunk_bytes, max_chunks, timeout):
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
                 device_group=None):
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
                                  device_group=None):
        """Every member of `pg` calls this; `writer_rank` (a group rank) writes,
        the others read. With blocking=False the writer does not wait here for
        the readers to attach; wait_until_ready() (or the first write) does.
        CUDA tensors in tensor dicts travel over `device_group` (default `pg`),
        which must have the same members. Bad arguments raise on every rank
        before any collective step; a rank that cannot create or attach its
        end makes every rank raise, naming it; the group stays usable."""
        _check_arguments("writer_rank", writer_rank, max_chunk_bytes, max_chunks, timeout)
        pg, ranks, rank = _membership(pg, "writer_rank", writer_rank)
        n = len(ranks)
        hosts = [None] * n
        dist.all_gather_object(hosts, _C.host_id(), group=pg)
        local = [r for r in range(n) if r != writer_rank and hosts[r] == hosts[writer_rank]]
        remote = [r for r in range(n) if r != writer_rank and hosts[r] != hosts[writer_rank]]
        writer = reader = None
        name = [("ok", None)]
        if rank == writer_rank and local:
            try:
                writer = _C.MqWriter(len(local), max_chunks, max_chunk_bytes)
                name = [("ok", writer.name)]
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
                reader = _C.MqReader(value, local.index(rank))
            except Exception as e:
                failure = _failure(e)
        _agree(pg, failure, "attaching a reader")
        mq = cls(pg, writer_rank, rank, local, remote, writer, reader, timeout, device_group)
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

    def _send(self, parts, timeout):
        timeout = self._timeout if timeout is None else timeout
        if self._writer is not None:
            self.wait_until_ready(timeout)
            self._writer.write(parts, timeout)
        if self.remote_readers:
            data = bytearray(b"".join(memoryview(p).cast("B") for p in parts))
            length = len(data)
            payload = torch.frombuffer(data, dtype=torch.uint8) if length else None
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
        passed by reference and copied once, into the ring."""
        self._check(True, "enqueue")
        if not self._zero_copy:
            self._send([pickle.dumps(obj, protocol=5)], timeout)
            return
        parts = []
        pickle.Pickler(_Parts(parts), protocol=5).dump(obj)
        self._send(parts, timeout)

    def dequeue(self, timeout=None):
        """Reader: the next object the writer enqueued. Raises TimeoutError.
        Readers on another host than the writer receive through the CPU group,
        whose own timeout bounds the wait instead of `timeout`."""
        self._check(False, "dequeue")
        if self._reader is not None and self._zero_copy:
            # Unpickled straight from the ring (no copy out first).
            return self._reader.read_object(self._timeout if timeout is None else timeout)
        return pickle.loads(self._recv(timeout).numpy())

    def broadcast_object(self, obj=None):
        """The writer passes `obj`; every member returns it."""
        if self.is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    # -------------------------------------------------------------- tensor dicts
    def broadcast_tensor_dict(self, tensor_dict=None):
        """The writer passes a dict of str -> tensor | picklable value; every
        member returns an equal dict. CPU tensor bytes are copied raw (never
        pickled); CUDA tensors are broadcast over the group's device path;
        empty tensors cost no bytes."""
        if self.is_writer:
            if not isinstance(tensor_dict, dict):
                raise TypeError(f"broadcast_tensor_dict needs a dict, got {type(tensor_dict)}")
            meta, raws, cuda = [], [], []
            for key, value in tensor_dict.items():
                if not isinstance(key, str):
                    raise TypeError(f"tensor dict keys must be str, got {key!r}")
                if not isinstance(value, torch.Tensor):
                    meta.append((key, "obj", value, None, 0))
                    continue
                check_dense(key, value)
                if value.is_cuda:
                    meta.append((key, "cuda", value.dtype, tuple(value.shape), 0))
                    if value.numel():
                        cuda.append(value.contiguous())
                elif value.device.type == "cpu":
                    nbytes = value.numel() * value.element_size()
                    meta.append((key, "cpu", value.dtype, tuple(value.shape), nbytes))
                    if nbytes:
                        raws.append(_raw_bytes(value))
                else:
                    raise ValueError(f"tensor {key!r} is on {value.device}; cpu and cuda "
                                     "tensors are supported")
            header = pickle.dumps(meta, protocol=5)
            message = [_LEN.pack(len(header)), header]
            pos = _LEN.size + len(header)
            for raw in raws:
                pad = -pos % _ALIGN
                if pad:
                    message.append(bytes(pad))
                message.append(raw)
                pos += pad + raw.nbytes
            self._check(True, "broadcast_tensor_dict")
            self._send(message, None)
            for t in cuda:
                self._send_device(t)
            return tensor_dict
        self._check(False, "broadcast_tensor_dict")
        buf = self._recv(None)  # uint8 tensor; the received tensors are views of it
        raw = buf.numpy()
        if len(raw) < _LEN.size:
            raise OSError(f"tensor dict message of {len(raw)} bytes has no header")
        (hlen,) = _LEN.unpack_from(raw, 0)
        if hlen > len(raw) - _LEN.size:
            raise OSError(f"tensor dict header of {hlen} bytes overruns a {len(raw)}-byte message")
        meta = pickle.loads(raw[_LEN.size:_LEN.size + hlen])
        pos = _LEN.size + hlen
        out = {}
        for key, kind, a, shape, nbytes in meta:
            if kind == "obj":
                out[key] = a
            elif kind == "cpu":
                if nbytes:
                    pos += -pos % _ALIGN
                    if pos + nbytes > len(raw):
                        raise OSError(f"tensor {key!r} overruns the {len(raw)}-byte message")
                    out[key] = buf[pos:pos + nbytes].view(a).reshape(shape)
                    pos += nbytes
                else:
                    out[key] = torch.empty(shape, dtype=a)
            else:
                t = torch.empty(shape, dtype=a, device=torch.cuda.current_device())
                if t.numel():
                    self._recv_device(t)
                out[key] = t
        return out

    def shutdown(self):
        """Wakes every waiter on this host's ring; later calls raise PeerLostError."""
        self._closed = True
        for end in (self._writer, self._reader):
            if end is not None:
                end.shutdown()
