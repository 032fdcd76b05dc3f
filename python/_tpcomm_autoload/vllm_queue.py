"""vLLM's executor queues on tpcomm's shared-memory ring (TPCOMM_VLLM=1).

vLLM's multiprocessing executor sends every step to its workers through a
message queue of its own (the scheduler's output, broadcast to every
worker) and receives each worker's answer through one more (a queue per
worker). Its readers poll in Python, yielding the core, for a second after
each message before they wait on a socket. tpcomm's ring polls in C++ and
then sleeps on a futex that the writer wakes only when someone sleeps:
a step's round trip (one broadcast to 2 workers, both answering) took 34 us
against 101 on 2 cores (AMD EPYC Zen 4; python -m tpcomm.bench vllm-cpu
--queues, docs/vllm.md).

`executor_queue(vllm_queue)` gives the class the plugin puts in the
executor's module in place of vLLM's MessageQueue: it makes a tpcomm ring
where every reader is on this host and no zero-copy arena was asked for,
and vLLM's own queue otherwise (readers on other hosts, the arena), so
the executor's calls reach whichever it got. The handle it exports is
pickled into the workers' start arguments; this module imports nothing of
tpcomm until a queue is made.
"""

import logging
import os

# The ring: chunks of at most 1 MiB, 8 of them (a message of any size
# streams through; vLLM's own queue sizes chunks for its largest message).
_CHUNK_BYTES = 1 << 20
_CHUNKS = 8
# A read with no deadline (vLLM's None, an idle server's workers) waits this
# long (a year: the most the ring takes); the writer's exit and shutdown()
# end it at once (the ring's own checks), so nothing waits on a dead peer.
# One call, not a loop of shorter ones: a read that timed out part of the
# way through a message that wraps the ring cannot be resumed.
_NO_DEADLINE_S = 3.0e7
# Where a reader in this process attached to vLLM's own queue (its engine
# did not make rings: the plugin was not loaded there), this process's
# queues are vLLM's too, so that the engine can attach to its answers.
_state = {"vllm_peer": False}


def _bound():
    """What a write and the writer's wait for its readers may take (vLLM's
    own wait as long as it takes): the job's group timeout where this
    process has one (a worker), else 30 minutes (the engine core has no
    process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from tpcomm.coordinator import default_group_timeout

        timeout = default_group_timeout()
        if timeout is not None:
            return timeout.total_seconds()
    return 1800.0


class Handle:
    """What a reader attaches through: picklable, read by vLLM's executor
    for `local_reader_ranks` and `remote_subscribe_addr` as it reads its own
    handles."""

    def __init__(self, ring, readers, writer_pid):
        self.ring = ring
        self.local_reader_ranks = list(range(readers))
        self.remote_subscribe_addr = None  # every reader is local
        self.writer_pid = writer_pid

    def __repr__(self):
        readers = len(self.local_reader_ranks)
        return (f"{readers} reader{'s' if readers > 1 else ''}, the writer's pid "
                f"{self.writer_pid}")


class _Queue:
    """One end of a ring, with the calls vLLM's executor makes on its
    MessageQueue: enqueue, dequeue, export_handle, wait_until_ready,
    shutdown."""

    def __init__(self, writer=None, reader=None, readers=0):
        from tpcomm import _C, _mq_pickle

        self._C, self._pickle = _C, _mq_pickle
        self._writer, self._reader, self._readers = writer, reader, readers
        self._dumper = _mq_pickle.Dumper() if writer is not None else None
        self._ready = writer is None
        self.n_local_reader = readers
        self.n_remote_reader = 0
        self.shutting_down = False
        self._bound = _bound() if writer is not None else None

    @classmethod
    def writer(cls, readers):
        from tpcomm import _C

        return cls(writer=_C.MqWriter(readers, _CHUNKS, _CHUNK_BYTES), readers=readers)

    @classmethod
    def attach(cls, handle, rank):
        from tpcomm import _C

        readers = len(handle.local_reader_ranks)
        if not 0 <= rank < readers:
            raise ValueError(f"tpcomm ring ({handle!r}): reader rank {rank} is not one of its "
                             f"readers 0..{readers - 1}")
        return cls(reader=_C.MqReader(handle.ring, rank))

    def export_handle(self):
        if self._writer is None:
            raise RuntimeError("export_handle is for the writer; this end of the tpcomm ring "
                               "reads")
        return Handle(self._writer.name, self._readers, os.getpid())

    def wait_until_ready(self, timeout=None):
        """Writer: until every reader attached (the descriptor they attach
        through is then closed). Readers: at once."""
        if not self._ready:
            self._writer.wait_for_readers(self._bound if timeout is None else timeout)
            self._ready = True

    def enqueue(self, obj, timeout=None):
        if self._writer is None:
            raise RuntimeError("enqueue is for the writer; this end of the tpcomm ring reads")
        timeout = self._bound if timeout is None else timeout
        if not self._ready:
            self.wait_until_ready(timeout)
        try:
            parts, tensors, _ = self._dumper.dump(obj)  # CPU tensors out of band
            if tensors:
                self._writer.write_frame(parts, tensors, timeout)
            else:
                self._writer.write(parts, timeout)
        except TimeoutError:
            # Part of the message may be in the ring: no reader may take
            # what follows for a message; they hear PeerLostError instead.
            self._writer.shutdown()
            raise
        except self._C.PeerLostError as e:
            # Shut down (by vLLM's shutdown, on either end): dropped, as
            # vLLM's own queue drops it; the next dequeue of every reader
            # raises. A reader that died still raises here.
            if self.shutting_down or "was shut down" in str(e):
                return
            raise
        finally:
            self._dumper.clear()

    def dequeue(self, timeout=None, indefinite=False):
        """The next object; TimeoutError after `timeout` seconds (None: no
        deadline, as vLLM's; the writer's exit or shutdown() still raise
        PeerLostError at once)."""
        if self._reader is None:
            raise RuntimeError("dequeue is for a reader; this end of the tpcomm ring writes")
        return self._reader.read_object(_NO_DEADLINE_S if timeout is None else timeout,
                                        self._pickle.loads_object)

    def shutdown(self):
        """Wakes every waiter on this ring; later calls raise PeerLostError."""
        self.shutting_down = True
        for end in (self._writer, self._reader):
            if end is not None:
                end.shutdown()


def executor_queue(vllm_queue):
    """The class that stands for vLLM's MessageQueue in its executor."""

    class ExecutorQueue:
        _tpcomm = True

        def __new__(cls, n_reader, n_local_reader, local_reader_ranks=None,
                    max_chunk_bytes=None, max_chunks=None, connect_ip=None,
                    enable_shm_tensor_arena=False, **kwargs):
            if (n_reader != n_local_reader or n_local_reader < 1 or enable_shm_tensor_arena
                    or kwargs or local_reader_ranks not in (None, list(range(n_local_reader)))
                    or _state["vllm_peer"]):
                given = {k: v for k, v in (("max_chunk_bytes", max_chunk_bytes),
                                           ("max_chunks", max_chunks),
                                           ("connect_ip", connect_ip)) if v is not None}
                return vllm_queue(n_reader, n_local_reader, local_reader_ranks,
                                  enable_shm_tensor_arena=enable_shm_tensor_arena,
                                  **given, **kwargs)
            queue = _Queue.writer(n_local_reader)
            logging.getLogger("vllm.plugins.tpcomm").info(
                "tpcomm: a queue of vLLM's executor is tpcomm's shared-memory ring (%s)",
                queue.export_handle())  # says how many readers: the workers, or the engine
            return queue

        @staticmethod
        def create_from_handle(handle, rank):
            if isinstance(handle, Handle):
                return _Queue.attach(handle, rank)
            _state["vllm_peer"] = True
            return vllm_queue.create_from_handle(handle, rank)

    return ExecutorQueue
