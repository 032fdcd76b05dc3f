"""Message-queue round trips, the way a serving loop feels them: the writer
broadcasts, every reader acknowledges through a queue of its own back to the
writer (create_single_reader), and the writer waits for every acknowledgement.
Three variants in the same run, interleaved round by round (best round kept):

  mq        TPCOMM_MQ_SPIN_US polling, wake-ups only for sleepers, objects
            pickled into parts (large payloads by reference) and unpickled in
            place from the ring
  mq spin 0 the queue before those: 4,000 polls then a futex sleep, a wake-up
            system call after every publish, objects pickled to one bytes
            object and copied out of the ring before unpickling
  gloo      broadcast_object_list / one broadcast per tensor, acks by send/recv

Plus the CPU a reader burns while blocked in dequeue for a few seconds (its
process's utime + stime from /proc/self/stat), polling and spin 0 alike.
"""

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks
from tpcomm.bench.mq import gloo_broadcast_dict
from tpcomm.bench.mq import payloads as broadcast_payloads

VARIANTS = ("mq", "mq spin 0", "gloo")


def _payloads(quick):

    step = broadcast_payloads(quick)[0][1]
    small = {"ids": list(range(150)), "text": "x" * 200, "flags": (True, None, 0.5)}
    scale = 10 if quick else 1
    return [("~1 KB object", "obj", small, 2000 // scale),
            ("step tensor dict", "dict", step, 2000 // scale),
            ("step dict as object", "obj", step, 2000 // scale),
            ("1 MB object", "obj", b"\x01" * 1_000_000, 200 // scale),
            ("16 MB object", "obj", b"\x02" * (16 << 20), max(2, 20 // scale))]


def _cpu_seconds():
    """This process's user + system CPU time, from /proc/self/stat."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _worker(rank, world, port, quick, results):
    import tpcomm

    torch.set_num_threads(1)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    gloo = dist.new_group(backend="gloo")
    down = tpcomm.MessageQueue.create_from_process_group(dist.group.WORLD, writer_rank=0)
    up, acks = tpcomm.MessageQueue.create_single_reader(dist.group.WORLD, reader_rank=0,
                                                       blocking=True)
    queues = [down] + ([up] if up is not None else []) + acks
    ack = torch.zeros(1)

    spin = tpcomm._C.mq_default_spin_us()

    def configure(variant):
        for q in queues:
            q.set_spin_us(0 if variant == "mq spin 0" else spin)
            q._zero_copy = variant == "mq"

    def round_trip(kind, payload, variant):
        if variant == "gloo":
            if kind == "obj":
                box = [payload if rank == 0 else None]
                dist.broadcast_object_list(box, src=0, group=gloo)
            else:
                gloo_broadcast_dict(payload, 0, gloo)
            if rank == 0:
                for r in range(1, world):
                    dist.recv(ack, src=r, group=gloo)
            else:
                dist.send(ack, dst=0, group=gloo)
            return
        if kind == "obj":
            if rank == 0:
                down.enqueue(payload)
            else:
                down.dequeue()
        else:
            down.broadcast_tensor_dict(payload if rank == 0 else None)
        if rank == 0:
            for q in acks:
                q.dequeue()
        else:
            up.enqueue(True)

    rows = []
    rounds = 2 if quick else 3
    for name, kind, payload, iters in _payloads(quick):
        best = {v: float("inf") for v in VARIANTS}
        for _ in range(rounds):
            for variant in VARIANTS:
                configure(variant)
                for _ in range(max(1, iters // 10)):  # warm-up
                    round_trip(kind, payload, variant)
                dist.barrier(group=gloo)
                start = time.perf_counter()
                for _ in range(iters):
                    round_trip(kind, payload, variant)
                elapsed = (time.perf_counter() - start) / iters
                dist.barrier(group=gloo)
                best[variant] = min(best[variant], elapsed)
        rows.append((name, best))
    # Idle: the writer sleeps, every reader blocks in dequeue meanwhile.
    idle_s = 2.0 if quick else 5.0
    idle = {}
    for variant in ("mq", "mq spin 0"):
        configure(variant)
        dist.barrier(group=gloo)
        if rank == 0:
            time.sleep(idle_s)
            down.enqueue("wake")
            used = None
        else:
            cpu, wall = _cpu_seconds(), time.perf_counter()
            down.dequeue()
            used = (_cpu_seconds() - cpu) / (time.perf_counter() - wall)
        every = [None] * world
        dist.all_gather_object(every, used, group=gloo)
        idle[variant] = max(u for u in every if u is not None)
    if rank == 0:
        results.put((rows, idle, idle_s))
    for q in queues:
        q.shutdown()
    dist.destroy_process_group()


def run(readers_list, quick):
    from tpcomm import _C

    print(f"TPCOMM_MQ_SPIN_US={_C.mq_default_spin_us()}")
    print("Round trips: the writer broadcasts, every reader acknowledges through its own "
          "queue; best of interleaved rounds.")
    print("'mq spin 0' is the queue before TPCOMM_MQ_SPIN_US, sleeper counts and "
          "pickling to/from the ring (TPCOMM_MQ_SPIN_US=0 and the old pickling path).")
    print(f"{'payload':20s} {'readers':>7s} {'mq us':>9s} {'spin 0 us':>10s} {'gloo us':>10s} "
          f"{'vs spin 0':>9s} {'vs gloo':>8s}")
    idles = []
    for readers in readers_list:
        got = run_ranks(_worker, readers + 1, lambda r: (quick,), 1800)
        if got is None:
            print(f"readers={readers}: a worker failed")
            return 1
        rows, idle, idle_s = got
        for name, best in rows:
            new, old, gloo = (best[v] for v in VARIANTS)
            print(f"{name:20s} {readers:7d} {new * 1e6:9.1f} {old * 1e6:10.1f} {gloo * 1e6:10.1f} "
                  f"{old / new:8.2f}x {gloo / new:7.1f}x")
        idles.append((readers, idle, idle_s))
    for readers, idle, idle_s in idles:
        print(f"idle reader blocked {idle_s:.0f} s in dequeue ({readers} readers, the busiest): "
              f"mq {100 * idle['mq']:.2f}% of a core, spin 0 {100 * idle['mq spin 0']:.2f}%")
    return 0
