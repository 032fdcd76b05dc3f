"""python -m tpcomm.bench cpu --hosts H [--ranks-per-host L]: CPU allreduce of
a group spread over H simulated hosts (tpcomm.simhosts: separate network,
UTS, mount and pid namespaces; root only), L ranks on each: µs per call,
and the bytes each host's interface sent per call (its kernel counter,
/sys/class/net/eth0/statistics/tx_bytes inside the host's namespace, read
by the host's first rank around the timed loop; the most of any host, as a
multiple of the payload: TCP/IP and Gloo headers included).

Every size is timed in one run, interleaved, on three groups of the same
ranks: tpcomm (hierarchical: shared memory inside each host, Gloo between),
plain Gloo (flat), and tpcomm with shared memory off (its Gloo route); plus
the same-host part alone: a tpcomm group of each host's ranks (shared
memory), timed one host at a time, so that its share of the hierarchical
time shows. Each figure is
the slowest rank's mean over a timed loop, the best of --rounds rounds.

Between the namespaces traffic crosses a veth pair and a bridge inside this
one kernel: latency is far below a real network's, so the ratios here are a
floor on what a real network gives (its hop costs more, and the hierarchical
path makes fewer of them)."""

import os
import sys
import time

SIZES = [4, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


_COUNTER = "/sys/class/net/eth0/statistics/tx_bytes"


def _sent():
    """Bytes this host's interface has sent (its network namespace's). A
    counter that cannot be read is an error, not a ratio of 0.00x."""
    try:
        with open(_COUNTER) as f:
            return int(f.read())
    except (OSError, ValueError) as e:
        raise RuntimeError(f"bench cpu --hosts: the host's interface counter {_COUNTER} cannot "
                           f"be read ({type(e).__name__}: {e}), so the bytes each host sends "
                           f"cannot be measured") from e


def _time(fn, iters, counts):
    """µs per call, and bytes this host sent per call (where `counts`)."""
    fn()
    sent = _sent() if counts else 0
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    took = (time.perf_counter() - start) / iters * 1e6
    return took, ((_sent() - sent) / iters if counts else 0.0)


def _worker(max_bytes, rounds, quick):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import tpcomm  # noqa: F401

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    dist.init_process_group("tpcomm", init_method="env://", timeout=timedelta(seconds=120))
    gloo = dist.new_group(backend="gloo")
    off = dist.new_group(backend="tpcomm")
    off._get_backend(torch.device("cpu")).set_cpu_shm_mode("0")
    hosts = world // local
    host_groups = [dist.new_group(list(range(h * local, (h + 1) * local)), backend="tpcomm")
                   for h in range(hosts)]
    host_group = host_groups[rank // local]
    groups = {"tpcomm": dist.group.WORLD, "gloo": gloo, "off": off}
    sizes = [s for s in SIZES if s <= max_bytes]
    if quick:
        sizes = [s for s in sizes if s in (4, 16 << 10, 64 << 10, 1 << 20)]
    counts = rank % local == 0  # the host's first rank reads its counter
    best = {}
    sent = {}
    for _ in range(rounds):
        for size in sizes:
            n = max(1, size // 4)
            iters = 200 if size <= (64 << 10) else 40 if size <= (1 << 20) else 8
            if quick:
                iters = max(4, iters // 4)
            for name, group in groups.items():
                x = torch.ones(n)
                dist.barrier(group=gloo)
                t, b = _time(lambda: dist.all_reduce(x, group=group), iters, counts)
                worst = torch.tensor([t, b], dtype=torch.float64)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=gloo)
                key = (name, size)
                best[key] = min(best.get(key, float("inf")), worst[0].item())
                sent[key] = min(sent.get(key, float("inf")), worst[1].item())
            # Each host's part alone (the other hosts wait), as inside the
            # hierarchical call, where the hosts' parts do not overlap with
            # the step between them.
            t = 0.0
            for h in range(hosts):
                if local > 1 and rank // local == h:
                    x = torch.ones(n)
                    t, _ = _time(lambda: dist.all_reduce(x, group=host_group), iters, False)
                dist.barrier(group=gloo)
            worst = torch.tensor([t], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=gloo)
            best[("host", size)] = min(best.get(("host", size), float("inf")), worst.item())
    if rank == 0:
        d = tpcomm.describe()["cpu_shm"]["across_hosts"]
        print(f"group: {d['hosts']}; {d['reason']}; slices from {d['slice_bytes']} B; "
              f"gather up to {d.get('gather_bytes', '?')} B")
        print(f"{'bytes':>10} {'tpcomm us':>10} {'gloo us':>10} {'speed-up':>9} "
              f"{'shm off us':>11} {'host part us':>13} {'host share':>11} "
              f"{'sent/host tpcomm':>17} {'sent/host gloo':>15}")
        for size in sizes:
            hier, flat, host = best[("tpcomm", size)], best[("gloo", size)], best[("host", size)]
            print(f"{size:>10} {hier:>10.1f} {flat:>10.1f} {flat / hier:>8.2f}x "
                  f"{best[('off', size)]:>11.1f} {host:>13.1f} {100 * host / hier:>10.0f}% "
                  f"{sent[('tpcomm', size)] / size:>16.2f}x {sent[('gloo', size)] / size:>14.2f}x")
        sys.stdout.flush()
    dist.destroy_process_group()


def run(hosts=2, ranks_per_host=2, max_mib=16, quick=False, rounds=3, link_gbit=None):
    from tpcomm import simhosts

    reason = simhosts.unavailable_reason()
    if reason is not None:
        print(f"cannot run across simulated hosts: {reason}")
        return 1
    layout = [list(range(h * ranks_per_host, (h + 1) * ranks_per_host)) for h in range(hosts)]
    print(f"CPU allreduce float32, {hosts} simulated hosts x {ranks_per_host} ranks, "
          f"links {'unshaped (as fast as memory)' if link_gbit is None else f'{link_gbit:g} Gbit/s'}"
          f", best of {rounds} rounds (slowest rank's mean)")
    argv = [sys.executable, "-m", "tpcomm.bench.cpu.hosts", str(max_mib << 20), str(rounds),
            "1" if quick else "0"]
    with simhosts.SimulatedHosts(hosts, link_gbit=link_gbit) as sim:
        # Plain Gloo binds to the host name's address, which a namespace's
        # name does not resolve to: name the interface for both backends.
        env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0")
        procs = sim.launch_ranks(layout, argv, env=env, port=29611)
        codes = sim.wait(procs, 1800)
    if codes != [0] * hosts:
        print(f"a host failed: exit codes {codes}")
        return 1
    return 0


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1")
