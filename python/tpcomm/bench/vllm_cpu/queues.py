"""python -m tpcomm.bench vllm-cpu --queues: vLLM's executor queues against
tpcomm's ring in their place (the plugin's, TPCOMM_VLLM=1), as vLLM's
multiprocessing executor uses them: the engine broadcasts a step to its
workers through one queue and each worker answers through one of its own.
Per way, the time of one round trip (a step sent, every worker's answer
received) and the CPU time each process took per round trip (polling
included), rounds interleaved. The step is a decode step's worth of
scheduler output for 12 requests; the answer a few sampled token ids.
Every answer is checked against the step it answers. With --step-ms each
worker sleeps that long before it answers, as a model step keeps the
engine waiting: then the engine's waits outlast the ring's polling, which
tpcomm's readers learn to skip ("tpcomm's ring" against "fixed polling",
TPCOMM_MQ_SPIN_ADAPT=0)."""

import multiprocessing
import os
import statistics
import time

WAYS = ("vllm", "tpcomm", "tpcomm-fixed")


def _step(i):
    ids = [f"req-{r}" for r in range(12)]
    return ("execute_model", ({"step": i, "req_ids": ids,
                               "num_scheduled_tokens": {r: 1 for r in ids},
                               "new_block_ids": [[b, b + 1] for b in range(12)],
                               "total_num_scheduled_tokens": 12},), {}, 0)


def _answer(step, rank):
    return ("ok", rank, step[1][0]["step"] * 12 + rank, [7] * 12)


def _queue_type(way):
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    if way == "vllm":
        return MessageQueue
    from _tpcomm_autoload.vllm_queue import executor_queue

    return executor_queue(MessageQueue)


def _worker(way, handle, rank, step_s, conn):
    queue = _queue_type(way)
    steps = queue.create_from_handle(handle, rank)
    answers = queue(1, 1)
    conn.send(answers.export_handle())
    steps.wait_until_ready()
    answers.wait_until_ready()
    cpu = time.process_time()
    count = 0
    while True:
        step = steps.dequeue(indefinite=True)
        if step is None:
            break
        if step_s:
            time.sleep(step_s)
        answers.enqueue(_answer(step, rank))
        count += 1
    conn.send((count, time.process_time() - cpu))


def _engine(way, workers, seconds, step_s, conn):
    """One round in a process of its own (its settings read afresh)."""
    conn.send(_round(way, workers, seconds, step_s))


def _round(way, workers, seconds, step_s):
    context = multiprocessing.get_context("spawn")
    queue = _queue_type(way)
    steps = queue(workers, workers)
    procs, pipes = [], []
    for rank in range(workers):
        mine, theirs = context.Pipe()
        procs.append(context.Process(target=_worker, args=(way, steps.export_handle(), rank,
                                                           step_s, theirs), daemon=True))
        procs[-1].start()
        pipes.append(mine)
    try:
        answers = []
        for p in pipes:
            if not p.poll(120):
                raise RuntimeError(f"{way}: a worker did not start within 120 s")
            answers.append(queue.create_from_handle(p.recv(), 0))
        steps.wait_until_ready()
        for a in answers:
            a.wait_until_ready()
        for i in range(200 if not step_s else 50):  # warm-up, checked too
            steps.enqueue(_step(i))
            for rank, a in enumerate(answers):
                if a.dequeue(timeout=60) != _answer(_step(i), rank):
                    raise RuntimeError(f"{way}: worker {rank} answered step {i} wrongly")
        count, cpu, start = 0, time.process_time(), time.perf_counter()
        while time.perf_counter() - start < seconds:
            step = _step(count)
            steps.enqueue(step)
            for rank, a in enumerate(answers):
                if a.dequeue(timeout=60) != _answer(step, rank):
                    raise RuntimeError(f"{way}: worker {rank} answered step {count} wrongly")
            count += 1
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        steps.enqueue(None)
        theirs = []
        for p in pipes:
            if not p.poll(60):
                raise RuntimeError(f"{way}: a worker did not finish within 60 s")
            theirs.append(p.recv())
        for proc in procs:
            proc.join(60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        steps.shutdown()
    return {"us": 1e6 * elapsed / count,
            "cpu_us": [1e6 * cpu / count] + [1e6 * c / count for _, c in theirs]}


def _spawned_round(way, workers, seconds, step_s):
    """A round run by an engine process of its own: "tpcomm-fixed" is
    tpcomm's ring with TPCOMM_MQ_SPIN_ADAPT=0 there and in its workers."""
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    saved = os.environ.get("TPCOMM_MQ_SPIN_ADAPT")
    os.environ["TPCOMM_MQ_SPIN_ADAPT"] = "0" if way == "tpcomm-fixed" else "1"
    try:
        # Not a daemon: it starts the workers.
        engine = context.Process(target=_engine, args=(way.replace("-fixed", ""), workers,
                                                       seconds, step_s, theirs))
        engine.start()
    finally:
        if saved is None:
            os.environ.pop("TPCOMM_MQ_SPIN_ADAPT")
        else:
            os.environ["TPCOMM_MQ_SPIN_ADAPT"] = saved
    try:
        deadline = time.monotonic() + seconds + 300
        while not mine.poll(0.5):
            if not engine.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{way}: the round's engine did not report (exit code "
                                   f"{engine.exitcode}; its error is printed above)")
        return mine.recv()
    finally:
        engine.join(60)
        if engine.is_alive():
            engine.kill()


def queues(args):
    step_ms = getattr(args, "step_ms", 0.0) or 0.0
    results = {w: [] for w in WAYS}
    seconds = 2.0
    for r in range(args.rounds):
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            results[way].append(_spawned_round(way, 2, seconds, step_ms / 1e3))
    print(f"vLLM's executor queues, 1 engine and 2 workers, a step broadcast and both answers "
          f"back" + (f", each worker answering {step_ms:g} ms after the step (a sleep)"
                     if step_ms else "")
          + f"; median of {args.rounds} interleaved round(s) of {seconds:.0f} s")
    print(f"{'queue':>14} | {'us a round trip':>15} | CPU us a round trip: engine, workers")
    names = {"vllm": "vLLM's", "tpcomm": "tpcomm's ring", "tpcomm-fixed": "fixed polling"}
    for way in WAYS:
        runs = results[way]
        cpu = [statistics.median(x["cpu_us"][i] for x in runs) for i in range(3)]
        print(f"{names[way]:>14} | {statistics.median(x['us'] for x in runs):15.1f} | "
              + ", ".join(f"{c:.1f}" for c in cpu))
    return 0
