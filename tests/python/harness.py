"""Real multi-process groups for tests.

A ``Group`` starts one process per rank; each joins a default process group
over backend "tpcomm" and also makes a plain "gloo" group over the same ranks,
the reference. ``group.run(fn, *args)`` calls the module-level function
``fn(ctx, *args)`` on every rank and returns the per-rank results; a failure on
any rank raises ``RankFailure`` with that rank's traceback. Every wait is
bounded: a rank that hangs or dies fails the test instead of hanging it.
Ranks are forked from a server that has imported torch (each starts with
the test process's environment, as a spawned one would, and imports tpcomm
itself).
"""

import importlib
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))


class RankFailure(AssertionError):
    pass


def error_message(call):
    """"Type: message" of what `call()` raised, or None when it returned."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        return f"{type(e).__name__}: {e}"
    return None


@dataclass
class Context:
    rank: int
    world_size: int
    ref: object  # the gloo reference group over all ranks


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks start as forks of one server process that imported torch once (about
# 4 s of CPU that each spawned rank spent on it, a few hundred ranks a
# suite). It imports torch with the device-backend autoload off: each rank
# runs the autoload itself (_tpcomm_autoload reads tpcomm's settings), once
# its environment is the test's.
_PRELOAD = ["torch", "torch.distributed"]
_rank_context = None


def _context():
    global _rank_context
    if _rank_context is None:
        from multiprocessing import forkserver

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        saved = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD")
        os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"]
            else:
                os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = saved
        _rank_context = ctx
    return _rank_context


def _worker(rank, world_size, port, env, pg_timeout_s, conn, paths, before_import, parent_env):
    # A spawned process's environment: the test's process's as it is now
    # (the server's is as it was when it started), then the rank's own.
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update(env)
    sys.path[:0] = paths
    try:
        import torch
        import torch.distributed as dist

        if torch._is_device_backend_autoload_enabled():
            torch._import_device_backends()

        if before_import is not None:
            module, name = before_import
            getattr(importlib.import_module(module), name)()
        import tpcomm  # noqa: F401  (registers the backend)

        # Every rank joins once every rank is ready to: the imports take
        # seconds on a loaded machine, and a short group timeout (a test of
        # timeouts) must not run out on one rank's slow start.
        conn.send(("imported", None))
        if conn.recv() != "go":
            return
        torch.manual_seed(1234 + rank)
        dist.init_process_group(
            "tpcomm",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        ctx = Context(rank, world_size, dist.new_group(backend="gloo"))
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        msg = conn.recv()
        if msg is None:
            break
        module, name, args = msg
        try:
            fn = getattr(importlib.import_module(module), name)
            conn.send(("ok", fn(ctx, *args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()
    # A forked rank ends in os._exit: what a spawned one runs at its exit
    # (atexit's functions) runs here.
    import atexit

    atexit._run_exitfuncs()


class Group:
    def __init__(self, world_size, env=None, pg_timeout_s=60, start_timeout_s=120,
                 env_per_rank=None, extra_paths=(), before_import=None):
        """`before_import`: (module, function name), called on every rank
        after `import torch` and before `import tpcomm` (a test that changes
        torch first)."""
        self.world_size = world_size
        ctx = _context()
        port = _free_port()
        paths = [HERE, os.path.dirname(HERE), *extra_paths]
        self._conns, self._procs = [], []
        for rank in range(world_size):
            rank_env = dict(env or {})
            rank_env.update((env_per_rank or {}).get(rank, {}))
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(rank, world_size, port, rank_env, pg_timeout_s, child, paths, before_import,
                      dict(os.environ)),
                daemon=True,
            )
            p.start()
            self._conns.append(parent)
            self._procs.append(p)
        try:
            self._collect("import", start_timeout_s)
            for conn in self._conns:
                conn.send("go")
            self._collect("start", start_timeout_s)
        except RankFailure:
            # The ranks that answered wait for "go" or in the group: none is left.
            self.close(kill=True)
            raise

    def _collect(self, what, timeout_s, grace_s=15):
        """Every rank's answer, in rank order. A rank that fails is reported
        at once with its traceback: the others get `grace_s` more (a rank
        often hangs because its peer failed), then count as not answering."""
        import time
        from multiprocessing.connection import wait

        deadline = time.monotonic() + timeout_s
        answers, failures = {}, []
        while len(answers) < len(self._conns):
            pending = [c for r, c in enumerate(self._conns) if r not in answers]
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for conn in wait(pending, timeout=left):
                rank = self._conns.index(conn)
                status, value = conn.recv()
                answers[rank] = value
                if status == "error":
                    failures.append(f"--- rank {rank} ---\n{value}")
                    deadline = min(deadline, time.monotonic() + grace_s)
        missing = [r for r in range(len(self._conns)) if r not in answers]
        if missing:
            self.close(kill=True)
            silent = f"rank(s) {missing} did not answer '{what}' within {timeout_s}s"
            if failures:
                silent = (f"{silent} (given {grace_s}s after another rank failed)\n"
                          + "\n".join(failures))
            raise RankFailure(silent)
        if failures:
            raise RankFailure(f"'{what}' failed:\n" + "\n".join(failures))
        return [answers[r] for r in range(len(self._conns))]

    def run(self, fn, *args, timeout_s=120):
        for conn in self._conns:
            conn.send((fn.__module__, fn.__name__, args))
        return self._collect(fn.__name__, timeout_s)

    def close(self, kill=False):
        for conn, proc in zip(self._conns, self._procs):
            if not kill:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self._procs:
            proc.join(timeout=0 if kill else 20)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs = []


def first_answers(target, args_list, timeout_s=180):
    """Runs target(*args, env, conn) in one process per entry of
    `args_list` (forked as the ranks are, with the test's environment) and
    returns, in order, the first thing each sent on `conn` (a test's
    processes send (status, value): "ok", "error", "killed" before a rank
    kills itself). Fails the test naming the processes that sent nothing
    within `timeout_s`; every process is joined, or killed, at the end."""
    ctx = _context()
    pipes = [ctx.Pipe() for _ in args_list]
    procs = [ctx.Process(target=target, args=(*args, dict(os.environ), pipe[1]), daemon=True)
             for args, pipe in zip(args_list, pipes)]
    for p in procs:
        p.start()
    try:
        answers = {}
        deadline = time.monotonic() + timeout_s
        while len(answers) < len(procs) and time.monotonic() < deadline:
            for i, (receiving, _) in enumerate(pipes):
                if i not in answers and receiving.poll(0.05):
                    answers[i] = receiving.recv()
        missing = [i for i in range(len(procs)) if i not in answers]
        assert not missing, f"processes {missing} did not answer; got {answers}"
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
    return [answers[i] for i in range(len(procs))]
