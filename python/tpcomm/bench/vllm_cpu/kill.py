"""python -m tpcomm.bench vllm-cpu --serve --kill-worker: one of vLLM's
OpenAI server's workers killed (SIGKILL) while concurrent clients keep it
busy, per way: how long until every client's request in flight has failed
and until the server has exited. A server must fail fast, not hang: its
clients (or their load balancer) retry elsewhere only once it answers.

`--serve --check` runs it once on the tpcomm server and fails unless the
requests fail and the server exits within a minute (serve.py)."""

import os
import signal
import threading
import time

from tpcomm.bench.vllm_cpu.offline import _process_tree, _prompts
from tpcomm.bench.vllm_cpu.serve import _percentile, _Server

# How long a killed server may take to fail its requests and exit before
# this benchmark calls it hung.
_PATIENCE_S = 60.0


def _worker_pid(server, rank):
    """The server's tensor-parallel worker of `rank`: vLLM titles it
    VLLM::Worker_TP<rank> (whole in /proc/PID/cmdline; /proc/PID/stat's
    name is cut to 15 characters, the same for both)."""
    titles = {}
    for pid, (name, _) in _process_tree(server.proc.pid).items():
        if name.startswith("VLLM::Worker"):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    titles[pid] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
    found = [pid for pid, title in titles.items() if title.startswith(f"VLLM::Worker_TP{rank}")]
    if len(found) != 1:
        raise RuntimeError(f"{server.way}: no one worker titled VLLM::Worker_TP{rank} below the "
                           f"server (/proc): {sorted(titles.values())}")
    return found[0]


def kill_round(way, model, args, log, rank=1):
    """Worker `rank` killed: {"failed_s": seconds from the kill until the
    last client's request failed (None: some still ran after _PATIENCE_S),
    "exited_s": until the server exited (None: still up), "answered":
    requests completed before}. Rank 0 answers the engine (vLLM reads
    only its answers); rank 1 is noticed by rank 0, in their collectives."""
    server = _Server(way, model, args, log)
    failed, answered, stop = {}, [0], threading.Event()
    killed = [None]
    try:
        server.wait_ready(args.timeout)
        prompts = _prompts(args.clients, args.prompt_len)

        def client(i):
            while not stop.is_set():
                try:
                    server.complete(prompts[i], args.tokens, _PATIENCE_S)
                    answered[0] += 1
                except Exception:  # the failure this round waits for
                    if killed[0] is not None:
                        failed[i] = time.monotonic() - killed[0]
                        return
                    raise

        threads = [threading.Thread(target=client, args=(i,), daemon=True)
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(2.0)  # every client has a request in flight
        if any(not t.is_alive() for t in threads):
            raise RuntimeError(f"{way}: a client failed before any worker was killed; the "
                               f"server's output ends:\n{server.output()[-4000:]}")
        pid = _worker_pid(server, rank)
        killed[0] = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(max(0.0, killed[0] + _PATIENCE_S - time.monotonic()))
        stop.set()
        exited = None
        while time.monotonic() < killed[0] + _PATIENCE_S:
            if server.proc.poll() is not None:
                exited = time.monotonic() - killed[0]
                break
            time.sleep(0.05)
    finally:
        stop.set()
        server.stop()
    last = max(failed.values()) if len(failed) == args.clients else None
    return {"failed_s": last, "first_s": min(failed.values()) if failed else None,
            "exited_s": exited, "answered": answered[0]}


def kill(args, model, log):
    """Every way, --rounds rounds alternated: the table of how each server
    failed."""
    rounds = {(w, rank): [] for w in args.ways for rank in (0, 1)}
    for r in range(args.rounds):
        for way in (args.ways if r % 2 == 0 else tuple(reversed(args.ways))):
            for rank in (0, 1):
                rounds[way, rank].append(kill_round(way, model, args, log, rank))
    print(f"A worker of vLLM's OpenAI server (TP=2) killed (SIGKILL) under {args.clients} "
          f"concurrent clients; seconds after the kill, median (min-max) of {args.rounds} "
          f"round(s) per way and rank (-: not within {_PATIENCE_S:.0f} s)")
    head = (f"{'way':>11} | {'killed':>6} | {'first request failed':>20} | "
            f"{'every request failed':>20} | {'server exited':>17}")
    print(head)
    print("-" * len(head))

    def cell(runs, key):
        values = [x[key] for x in runs]
        if any(v is None for v in values):
            return "-"
        return f"{_percentile(values, 0.5):.2f} ({min(values):.2f}-{max(values):.2f})"

    for (way, rank), runs in rounds.items():
        print(f"{way:>11} | {'TP' + str(rank):>6} | {cell(runs, 'first_s'):>20} | "
              f"{cell(runs, 'failed_s'):>20} | {cell(runs, 'exited_s'):>17}")
    print(f"The servers' output: {log}")
    return rounds


def check(args, model, log):
    """The tpcomm server, worker 0 (the one that answers the engine, through
    tpcomm's ring) killed under load: every request in flight fails and the
    server exits, each within _PATIENCE_S."""
    got = kill_round("tpcomm", model, args, log, rank=0)
    problems = []
    if got["failed_s"] is None:
        problems.append(f"requests of the tpcomm server still ran or waited {_PATIENCE_S:.0f} s "
                        "after one of its workers was killed")
    if got["exited_s"] is None:
        problems.append(f"the tpcomm server was still up {_PATIENCE_S:.0f} s after one of its "
                        "workers was killed")
    if problems:
        print("FAILED:\n  " + "\n  ".join(problems) + f"\n  (the servers' output: {log})")
        return 1
    print(f"OK: a worker of the tpcomm server killed under load (TP0): its {args.clients} clients' "
          f"requests failed within {got['failed_s']:.2f} s, the server exited after "
          f"{got['exited_s']:.2f} s")
    return 0
