"""vLLM's executor queues on tpcomm's ring (python/_tpcomm_autoload/vllm_queue.py),
driven as vLLM's multiprocessing executor drives them: the executor makes a
queue to its workers and pickles its handle into their start arguments;
each worker attaches, makes a queue of its own for its answers and sends
that handle back; a stand-in for vLLM's own queue takes what the ring does
not (readers on another host, the zero-copy arena). vLLM itself runs on it
in test_vllm.py's server test."""

import multiprocessing
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from _tpcomm_autoload import vllm_queue
from _tpcomm_autoload.vllm_queue import Handle, executor_queue

pytestmark = pytest.mark.torch_version  # .ci/run runs these on torch 2.11 too


@pytest.fixture(autouse=True)
def _fresh_process_state(monkeypatch):
    # Whether this process attached to vLLM's own queue (it then makes
    # vLLM's queues only): each test starts as a fresh process does.
    monkeypatch.setitem(vllm_queue._state, "vllm_peer", False)


class StandIn:
    """vLLM's MessageQueue as the executor sees it: what it was made with."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    @staticmethod
    def create_from_handle(handle, rank):
        return ("vLLM's", handle, rank)


Queue = executor_queue(StandIn)


def _answer(message, rank):
    """What a worker answers: computed from the message, so that a wrong or
    stale message gives a wrong answer."""
    kind, payload = message
    if kind == "tensor":
        return payload.double() * 2 + rank
    if kind == "bytes":
        return len(payload), payload[::1 << 20]
    if kind == "array":
        return payload.sum() + rank
    return {k: v + rank for k, v in payload.items()}


def _worker(handle, rank, conn):
    steps = Queue.create_from_handle(handle, rank)
    answers = Queue(1, 1)
    conn.send(answers.export_handle())
    answers.wait_until_ready(timeout=60)
    while True:
        message = steps.dequeue(indefinite=True)  # as vLLM's workers wait
        if message is None:
            break
        answers.enqueue(("ok", rank, _answer(message, rank)))
    conn.close()


def _spawn(target, *args):
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    proc = context.Process(target=target, args=args + (theirs,), daemon=True)
    proc.start()
    theirs.close()
    return proc, mine


def _recv(conn, timeout=120):
    assert conn.poll(timeout), "the child process sent nothing"
    return conn.recv()


@pytest.mark.timeout(300)
def test_the_executors_steps_and_its_workers_answers_travel_through_tpcomms_ring():
    # As the executor makes it: every reader local, vLLM's chunk sizes given.
    steps = Queue(2, 2, max_chunk_bytes=16 << 20, max_chunks=10, connect_ip="127.0.0.1")
    handle = steps.export_handle()
    assert isinstance(handle, Handle) and handle.local_reader_ranks == [0, 1]
    assert handle.remote_subscribe_addr is None  # what the executor reads
    workers = [_spawn(_worker, handle, rank) for rank in range(2)]
    try:
        answers = [Queue.create_from_handle(_recv(conn), 0) for _, conn in workers]
        steps.wait_until_ready(timeout=60)
        g = torch.Generator().manual_seed(7)
        messages = [("dict", {"a": 1, "b": 40}),
                    ("tensor", torch.randn(3, 1000, generator=g, dtype=torch.float64)),
                    # Larger than the whole ring (8 x 1 MiB): streamed through it.
                    ("bytes", bytes(range(256)) * (80 << 12)),
                    ("array", np.arange(1000, dtype=np.int64)),
                    ("tensor", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)[:, 1:])]
        for _ in range(3):
            for message in messages:
                steps.enqueue(message)
                for rank, queue in enumerate(answers):
                    status, who, got = queue.dequeue(timeout=60)
                    want = _answer(message, rank)
                    assert (status, who) == ("ok", rank)
                    if isinstance(want, torch.Tensor):
                        assert got.dtype == want.dtype and torch.equal(got, want), (got, want)
                    else:
                        assert got == want, (message[0], got, want)
        steps.enqueue(None)
        for proc, _ in workers:
            proc.join(60)
            assert proc.exitcode == 0
    finally:
        for proc, _ in workers:
            if proc.is_alive():
                proc.kill()


def _writer_then_killed(conn):
    queue = Queue(1, 1)
    conn.send(queue.export_handle())
    queue.wait_until_ready(timeout=60)
    conn.send("attached")
    time.sleep(600)  # killed by the test


@pytest.mark.timeout(120)
def test_a_wait_with_no_deadline_ends_when_the_writer_dies_or_the_queue_is_shut_down():
    from tpcomm import _C

    proc, conn = _spawn(_writer_then_killed)
    try:
        reader = Queue.create_from_handle(_recv(conn), 0)
        assert _recv(conn) == "attached"
        os.kill(proc.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(_C.PeerLostError):
            reader.dequeue(timeout=None)
        assert time.monotonic() - start < 10
    finally:
        proc.kill()
        proc.join(10)
    # shutdown() from another thread (vLLM's on a worker's shutdown) wakes a
    # reader that waits with no deadline; a deadline gives TimeoutError.
    writer = Queue(1, 1)
    reader = Queue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready(timeout=10)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.2)
    assert 0.15 < time.monotonic() - start < 10
    threading.Timer(0.3, reader.shutdown).start()
    with pytest.raises(_C.PeerLostError):
        reader.dequeue()
    assert reader.shutting_down


def test_vllms_own_queue_takes_readers_on_other_hosts_the_arena_and_its_own_handles():
    queue = Queue(3, 1, None, max_chunk_bytes=1 << 20, connect_ip="10.0.0.1")
    assert isinstance(queue, StandIn)
    assert queue.args == (3, 1, None)
    assert queue.kwargs == {"max_chunk_bytes": 1 << 20, "connect_ip": "10.0.0.1",
                            "enable_shm_tensor_arena": False}
    arena = Queue(2, 2, enable_shm_tensor_arena=True)
    assert isinstance(arena, StandIn) and arena.kwargs["enable_shm_tensor_arena"] is True
    assert isinstance(Queue(2, 2, [1, 0]), StandIn)  # readers in another order
    assert isinstance(Queue(1, 1), vllm_queue._Queue)
    # A worker whose engine sent a handle of vLLM's queue (the plugin not
    # loaded there) answers through vLLM's queue too, which that engine reads.
    assert Queue.create_from_handle("a handle of vLLM's", 1) == ("vLLM's", "a handle of vLLM's", 1)
    assert isinstance(Queue(1, 1), StandIn)


def test_a_write_that_times_out_part_way_ends_the_ring_and_shutdown_drops_later_writes():
    from tpcomm import _C

    # The reader takes nothing: a message of 12 MiB fills the ring's 8 MiB
    # and the write times out part of the way through it. The reader must
    # then hear PeerLostError, never the first part of a message.
    writer = Queue(1, 1)
    reader = Queue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready(timeout=10)
    with pytest.raises(TimeoutError):
        writer.enqueue(bytes(12 << 20), timeout=0.3)
    with pytest.raises(_C.PeerLostError):
        reader.dequeue(timeout=10)
    # vLLM shuts a worker's answer queue down from the engine's end (its
    # reader) while the worker may still answer: the answer is dropped, as
    # vLLM's own queue drops it, and the reader's next read raises.
    writer = Queue(1, 1)
    reader = Queue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready(timeout=10)
    writer.enqueue("before")
    reader.shutdown()
    writer.enqueue("after")  # no error
    assert reader.dequeue(timeout=10) == "before"  # what was sent before is still read
    with pytest.raises(_C.PeerLostError):
        reader.dequeue(timeout=10)


def test_misuse_of_an_executor_queue_is_refused_naming_it():
    writer = Queue(2, 2)
    with pytest.raises(ValueError, match="reader rank 2 is not one of its readers 0..1"):
        Queue.create_from_handle(writer.export_handle(), 2)
    reader = Queue.create_from_handle(writer.export_handle(), 0)
    with pytest.raises(RuntimeError, match="enqueue is for the writer"):
        reader.enqueue("x")
    with pytest.raises(RuntimeError, match="dequeue is for a reader"):
        writer.dequeue(timeout=1)
    with pytest.raises(RuntimeError, match="export_handle is for the writer"):
        reader.export_handle()
