"""One rank of a test on simulated hosts (tpcomm.simhosts): `python
hosts_worker.py CASE OUTDIR`. The rank runs CASE and writes what it found to
OUTDIR/rank<R>.pt (torch.save of a dict), or its traceback to
OUTDIR/rank<R>.err; the test process compares them."""

import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import tpcomm  # noqa: F401  (registers the backend)

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
GONE = set()  # ranks a case ends on purpose (SIGKILL): no result comes from them

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64]


def inputs(rank, n, dtype, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64).to(dtype)


def case_identity(out):
    """Host identity and the route every collective takes."""
    out["host_id"] = tpcomm._C.host_id()
    out["hostname"] = tpcomm._C.host_name()
    x = torch.ones(4)
    dist.all_reduce(x)
    out["sum"] = x
    out["describe"] = tpcomm.describe()["cpu_shm"]
    out["stats"] = tpcomm.stats()


def case_collectives(out):
    """Every hierarchical collective, dtype, reduction and size that tests
    compare with float64 references and across ranks."""
    results = {}
    # TEST_SIZES: fewer sizes for the layouts of many ranks (2 cores).
    sizes = [int(n) for n in os.environ.get("TEST_SIZES", "1,7,1000,65536,300000").split(",")]
    for dtype in DTYPES:
        for n in sizes:
            if n == 300000 and dtype not in (torch.float32, torch.bfloat16):
                continue
            for op in ("sum", "avg", "max", "min", "premul"):
                if op == "avg" and not dtype.is_floating_point:
                    continue
                if op == "premul" and not dtype.is_floating_point:
                    continue
                x = inputs(RANK, n, dtype, seed=n)
                if op == "sum":
                    dist.all_reduce(x)
                elif op == "avg":
                    dist.all_reduce(x, op=dist.ReduceOp.AVG)
                elif op == "max":
                    dist.all_reduce(x, op=dist.ReduceOp.MAX)
                elif op == "min":
                    dist.all_reduce(x, op=dist.ReduceOp.MIN)
                else:
                    dist.all_reduce(x, op=dist._make_nccl_premul_sum(0.5))
                results[("allreduce", op, str(dtype), n)] = x
    # allreduce into another tensor, coalesced, all-gather, reduce-scatter,
    # broadcast from every root, barrier.
    for n in (5, 4096, 70000):
        x = inputs(RANK, n, torch.float32, seed=7)
        outs = [torch.empty(n) for _ in range(WORLD)]
        dist.all_gather(outs, x)
        results[("all_gather", n)] = torch.stack(outs)
        flat = torch.empty(WORLD * n)
        dist.all_gather_into_tensor(flat, x)
        results[("all_gather_into_tensor", n)] = flat
        big = inputs(RANK, WORLD * n, torch.float32, seed=9)
        part = torch.empty(n)
        dist.reduce_scatter_tensor(part, big)
        results[("reduce_scatter_tensor", n)] = part
        parts = list(inputs(RANK, WORLD * n, torch.bfloat16, seed=11).chunk(WORLD))
        mine = torch.empty(n, dtype=torch.bfloat16)
        dist.reduce_scatter(mine, parts, op=dist.ReduceOp.AVG)
        results[("reduce_scatter_avg_bf16", n)] = mine
        for root in range(WORLD):
            b = inputs(RANK, n, torch.int64, seed=13)
            dist.broadcast(b, src=root)
            results[("broadcast", root, n)] = b
    coalesced = [inputs(RANK, n, torch.float32, seed=17) for n in (3, 100, 5000)]
    dist.all_reduce_coalesced(coalesced)
    results[("coalesced",)] = torch.cat(coalesced)
    for _ in range(3):
        dist.barrier()
    out["results"] = results
    out["stats"] = tpcomm.stats()
    out["describe"] = tpcomm.describe()["cpu_shm"]


def case_mismatch(out):
    """Ranks on the last host call another collective (TEST_MISMATCH=sizes:
    the same allreduce of another size): every rank raises."""
    last_host_ranks = [int(r) for r in os.environ["TEST_LAST_HOST"].split(",")]
    x = torch.ones(256)
    dist.all_reduce(x)  # the path is set up
    try:
        if RANK in last_host_ranks and os.environ.get("TEST_MISMATCH") == "sizes":
            # 4 B rides in the descriptions' blocks, 1 KiB would follow them.
            dist.all_reduce(torch.ones(1))
        elif RANK in last_host_ranks:
            outs = [torch.empty(256) for _ in range(WORLD)]
            dist.all_gather(outs, x)
        else:
            dist.all_reduce(x)
        out["raised"] = None
    except Exception as e:  # noqa: BLE001  (the test reads the message)
        out["raised"] = f"{type(e).__name__}: {e}"


def case_host_lost(out):
    """The last host is killed by the test while the others wait in an
    allreduce: the others must raise, naming it."""
    last_host_ranks = [int(r) for r in os.environ["TEST_LAST_HOST"].split(",")]
    x = torch.ones(1024)
    dist.all_reduce(x)
    if RANK in last_host_ranks:
        open(os.path.join(os.environ["TEST_OUT"], f"ready{RANK}"), "w").close()
        time.sleep(600)  # killed
    start = time.monotonic()
    try:
        for _ in range(1000):
            dist.all_reduce(x)
            time.sleep(0.01)
        out["raised"] = None
    except Exception as e:  # noqa: BLE001
        out["raised"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - start


def case_host_lost_mid_call(out):
    """Every rank runs allreduces of TEST_ELEMENTS floats in a loop; the last
    host's ranks say they are ready after two and go on until the test
    kills their host, mid-call: the others record what they raised and
    when (time.monotonic, which the test's clock shares)."""
    last_host_ranks = [int(r) for r in os.environ["TEST_LAST_HOST"].split(",")]
    x = torch.ones(int(os.environ["TEST_ELEMENTS"]))
    out["raised"] = None
    try:
        for i in range(100000):
            dist.all_reduce(x)
            if i == 1 and RANK in last_host_ranks:
                open(os.path.join(os.environ["TEST_OUT"], f"ready{RANK}"), "w").close()
    except Exception as e:  # noqa: BLE001
        out["raised"] = f"{type(e).__name__}: {e}"
    out["raised_at"] = time.monotonic()


def _fault_case(out, misbehave):
    """Every rank but the last host's last makes an allreduce on the
    hierarchical path; that rank calls `misbehave()` instead. Records what
    each rank raised, how long it took, and what a later call raised."""
    bad = int(os.environ["TEST_LAST_HOST"].split(",")[-1])
    x = torch.ones(256)
    dist.all_reduce(x)  # the path is set up
    start = time.monotonic()
    try:
        misbehave() if RANK == bad else dist.all_reduce(x)
        out["raised"] = None
    except Exception as e:  # noqa: BLE001  (the test reads the message)
        out["raised"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - start
    out["bad"] = bad
    try:
        dist.all_reduce(x)
        out["later"] = None
    except Exception as e:  # noqa: BLE001
        out["later"] = f"{type(e).__name__}: {e}"


def case_refused(out):
    """One rank refuses the allreduce (a bitwise op on floats)."""
    _fault_case(out, lambda: dist.all_reduce(torch.ones(256), op=dist.ReduceOp.BAND))


def case_aborted(out):
    """One rank aborts the group instead of calling."""
    def abort():
        time.sleep(0.3)
        dist.group.WORLD._get_backend(torch.device("cpu")).abort()
    _fault_case(out, abort)


def case_message_queue(out):
    """The message queue with the writer on host 0 and readers everywhere:
    same-host readers read the ring, the others receive over Gloo."""
    from tpcomm.message_queue import MessageQueue
    mq = MessageQueue.create_from_process_group(dist.group.WORLD, writer_rank=0)
    got = []
    for i in range(5):
        obj = {"step": i, "tokens": list(range(i * 3)), "blob": b"x" * (1 << (10 + 2 * i))}
        got.append(mq.broadcast_object(obj if RANK == 0 else None))
    out["objects"] = got
    out["local"] = list(mq.local_readers)
    out["remote"] = list(mq.remote_readers)
    mq.shutdown()


def case_ddp(out):
    """DDP over the hierarchical path: a few steps of a small model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(5):
        g = torch.Generator().manual_seed(100 * step + RANK)
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["stats"] = tpcomm.stats()


def case_serving(out):
    """A program's own connections (an echo server and a client thread that
    keeps opening connections to it) while the first allreduce makes the
    Gloo groups between hosts; then rank 0 aborts the group: only the
    group's Gloo connections are shut down."""
    from tpcomm.bench.serving import EchoTraffic, inode_of, shut_down

    echo = EchoTraffic()
    echo.start_clients(every_s=0.0005, limit=300)
    time.sleep(0.02)
    before = echo.opened
    x = torch.ones(64)
    dist.all_reduce(x)  # the lazy set-up across hosts
    out["during"] = echo.opened - before
    echo.stop_clients()
    out["sum"] = x
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    fds, out["problem"] = backend._gloo_connections
    inodes = {fd: inode_of(fd) for fd in fds}
    out["gloo"] = len(fds)
    out["overlap"] = sorted(set(fds) & echo.fds())
    if RANK == 0:
        time.sleep(0.3)
        backend.abort()
    else:
        try:
            dist.all_reduce(torch.ones(256))
            out["error"] = None
        except Exception as e:  # noqa: BLE001
            out["error"] = f"{type(e).__name__}: {e}"
    deadline = time.monotonic() + 10
    while not all(shut_down(fd, i) for fd, i in inodes.items()) and time.monotonic() < deadline:
        time.sleep(0.01)
    out["shut"] = all(shut_down(fd, i) for fd, i in inodes.items())
    out["broken"] = echo.broken()
    echo.close()


def _sent():
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def _resent():
    """TCP segments this host's namespace sent again (RetransSegs): a
    shaped link drops what overflows its bucket, and those are sent twice."""
    with open("/proc/net/snmp") as f:
        tcp = [line.split() for line in f if line.startswith("Tcp:")]
    return int(tcp[1][tcp[0].index("RetransSegs")])


def case_bytes(out):
    """The bytes this host's interface sent per 1 MiB allreduce (float32),
    per 1 MiB broadcast from rank 0 and per reduce-scatter of 1 MiB per host
    (read by every rank around 5 calls; the host's ranks all call, so the
    counter is the host's)."""
    n = 1 << 18
    for name, call in (
            ("allreduce", lambda x: dist.all_reduce(x)),
            ("broadcast", lambda x: dist.broadcast(x, src=0)),
            ("reduce_scatter", lambda x: dist.reduce_scatter_tensor(
                torch.empty(n // WORLD), x[:n // WORLD * WORLD]))):
        x = torch.ones(n)
        call(x)
        dist.barrier()
        time.sleep(0.2)  # the barrier's own packets sent
        before, resent, start = _sent(), _resent(), time.perf_counter()
        for _ in range(5):
            call(x)
        out[name + "_s"] = time.perf_counter() - start
        out[name + "_calls"] = 5
        out[name] = (_sent() - before) / 5
        out[name + "_resent"] = (_resent() - resent) / 5
        dist.barrier()
    out["payload"] = n * 4
    with open("/sys/class/net/eth0/mtu") as f:
        out["segment_bytes"] = int(f.read()) + 14  # a full frame: the MTU and Ethernet's header
    out["inline_bytes"] = tpcomm.describe()["cpu_shm"]["across_hosts"]["inline_bytes"]
    # Small calls: what a 4 B and a 1 KiB allreduce send, over 20 calls.
    for name, elements in (("allreduce_4b", 1), ("allreduce_1kib", 256)):
        x = torch.ones(elements)
        dist.all_reduce(x)
        dist.barrier()
        time.sleep(0.2)
        before = _sent()
        for _ in range(20):
            dist.all_reduce(x)
        out[name] = (_sent() - before) / 20
        dist.barrier()
    out["stats"] = tpcomm.stats()


def case_collectives_and_bytes(out):
    """case_collectives, then case_bytes in the same group (one start of
    many ranks on 2 cores instead of two): the bytes under out["bytes"]."""
    case_collectives(out)
    out["bytes"] = {}
    case_bytes(out["bytes"])


def case_p2p_mismatch(out):
    """Rank 0 sends 8 floats to the last rank (on another host), which
    expects 4: the recv raises naming both, the sender's next call too."""
    last = WORLD - 1
    out["error"] = out["later"] = None
    try:
        if RANK == 0:
            dist.send(torch.ones(8), last)
        elif RANK == last:
            dist.recv(torch.zeros(4), 0)
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    try:
        dist.all_reduce(torch.ones(4))
    except Exception as e:  # noqa: BLE001
        out["later"] = f"{type(e).__name__}: {e}"


def _go_on_after_loss(out, how):
    """The last rank kills itself (SIGKILL) in a loop of allreduces; the
    others see it, go on with a group of themselves (`how`: "shrink", a
    shrunk group; "reconfigure", the default group re-formed in place from
    their handles, exchanged through the default store) and run 1,000
    allreduces on it and on a group of the same ranks made after it: the
    test compares them bit for bit and reads the routes."""
    import signal

    lost = WORLD - 1
    GONE.add(lost)  # (no result of it to wait for)
    out["raised"] = None
    for i in range(100000):
        if RANK == lost and i == 100:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            dist.all_reduce(torch.full((1024,), float(i)))
        except Exception as e:  # noqa: BLE001
            out["raised"] = f"{type(e).__name__}: {e}"
            break
    if how == "shrink":
        group = dist.shrink_group([lost])
    else:
        store = dist.distributed_c10d._get_default_store()
        mine = dist._get_reconfigure_handle()
        store.set(f"test-handle/{RANK}", mine)
        handles = [store.get(f"test-handle/{r}").decode() for r in range(lost)]
        dist._reconfigure(uuid=3, handles=handles).wait()
        group = dist.group.WORLD
    apart = dist.new_group(list(range(WORLD - 1)))
    tpcomm.reset_stats(group)
    differ = []
    g = torch.Generator().manual_seed(RANK)
    for n in range(1000):
        x = torch.randn(257 + n % 5, generator=g)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, group=group)
        dist.all_reduce(b, group=apart)
        if not torch.equal(a, b):
            differ.append(n)
    out["differ"] = differ
    out["stats"] = tpcomm.stats(group)
    # A shrunk group's ranks; a reconfigured one's rank is its handle's
    # place in the list.
    out["shrunk"] = (group.rank(), group.size(),
                     dist.get_process_group_ranks(group) if how == "shrink"
                     else handles.index(mine))
    dist.destroy_process_group(apart)


def case_shrink_after_loss(out):
    _go_on_after_loss(out, "shrink")


def case_reconfigure_after_loss(out):
    _go_on_after_loss(out, "reconfigure")


def case_window_across_hosts(out):
    """A window over ranks of two hosts: around a ring of puts and signals
    (ranks 1 -> 2 and 3 -> 0 cross hosts), a put of 5 MiB from rank 1 into
    rank 2's window (two messages), each checked against what its receiver
    computes; a remote rank's tensor is not mappable, a silent remote peer
    is named after the wait's timeout."""
    n = (6 << 20) // 4
    mine = torch.full((n,), float(RANK))
    window = dist._new_window(mine)
    right, left = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    window.put(torch.full((16,), 100.0 + RANK), right, 16 * RANK, False)
    window.signal(right, False)
    window.wait_signal(left, False)
    expected = torch.full((n,), float(RANK))
    expected[16 * left:16 * left + 16] = 100.0 + left
    out["ring"] = torch.equal(mine, expected)
    # Rank 1's next put lands in rank 2's window as it comes (a receiving
    # thread writes it): not before rank 2 has read the ring's.
    dist.barrier()
    big = torch.randn((5 << 20) // 4, generator=torch.Generator().manual_seed(7))
    if RANK == 1:
        window.put(big, 2, 1000, False)
        window.signal(2, False)
    if RANK == 2:
        window.wait_signal(1, False)
        out["big"] = torch.equal(mine[1000:1000 + big.numel()], big)
    # What host 0's interface sends per 1 KiB put from rank 1 to rank 2
    # (rank 0 waits in a barrier, which sends nothing before rank 1 comes).
    kib = torch.ones(256)
    dist.barrier()
    time.sleep(0.2)
    if RANK == 1:
        before = _sent()
        for _ in range(20):
            window.put(kib, 2, 0, False)
        time.sleep(0.2)  # the last bytes on the wire
        out["put_1kib_bytes"] = (_sent() - before) / 20
        window.signal(2, False)
    if RANK == 2:
        window.wait_signal(1, False)
        out["kib"] = mine[:256].eq(1.0).all().item()
    dist.barrier()
    remote = 2 if RANK < 2 else 0
    try:
        window.map_remote_tensor(remote)
        out["map"] = None
    except Exception as e:  # noqa: BLE001
        out["map"] = f"{type(e).__name__}: {e}"
    out["attr"] = (str(window.get_attr(remote).access_type),
                   str(window.get_attr(RANK ^ 1).access_type))
    opts = torch._C._distributed_c10d.WaitSignalOptions()
    opts.timeout = timedelta(milliseconds=300)
    try:
        window.wait_signal(remote, False, opts)
        out["silent"] = None
    except Exception as e:  # noqa: BLE001
        out["silent"] = f"{type(e).__name__}: {e}"
    dist.barrier()
    # Deregistered (every peer on another host closes) and registered again
    # with another tensor: a ring again, on the next registration's tag.
    window.tensor_deregister()
    again = torch.zeros(64, dtype=torch.int64)
    window.tensor_register(again)
    window.put(torch.full((8,), RANK + 1, dtype=torch.int64), right, 8 * RANK, False)
    window.signal(right, False)
    window.wait_signal(left, False)
    expected = torch.zeros(64, dtype=torch.int64)
    expected[8 * left:8 * left + 8] = left + 1
    out["again"] = torch.equal(again, expected)
    dist.barrier()
    del window
    x = torch.ones(4)
    dist.all_reduce(x)
    out["after"] = x.tolist()


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def _wait_for_every_rank(outdir, timeout_s):
    """Returns once every rank has written its result (or its error), or
    after timeout_s: rank 0's process holds the store, and a rank still
    reading its peers' positions from it after a failed call (to say what
    happened) read a broken pipe instead when rank 0 had already ended."""
    deadline = time.monotonic() + timeout_s
    names = [(f"rank{r}.pt", f"rank{r}.err") for r in range(WORLD) if r not in GONE]
    while time.monotonic() < deadline:
        if all(any(os.path.exists(os.path.join(outdir, n)) for n in pair) for pair in names):
            return
        time.sleep(0.01)


def main():
    case, outdir = sys.argv[1], sys.argv[2]
    out = {"rank": RANK}
    try:
        timeout = timedelta(seconds=float(os.environ.get("TEST_TIMEOUT_S", "60")))
        dist.init_process_group("tpcomm", init_method="env://", timeout=timeout)
        CASES[case](out)
        torch.save(out, os.path.join(outdir, f"rank{RANK}.pt"))
        _wait_for_every_rank(outdir, timeout.total_seconds())
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(outdir, f"rank{RANK}.err"), "w") as f:
            f.write(traceback.format_exc())
        sys.stdout.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
