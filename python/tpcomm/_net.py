"""Networking: the interface the CPU group's Gloo traffic uses; locally
started ranks (a free TCP port for their rendezvous, a run of one process
per rank: the benchmarks)."""

import ipaddress
import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def _store_host(store):
    """The address of the TCPStore under `store` (through PrefixStores), or
    None for another kind of store."""
    seen = 0
    while isinstance(store, dist.PrefixStore) and seen < 64:
        store = store.underlying_store
        seen += 1
    return store.host if isinstance(store, dist.TCPStore) else None


def _route_source(host):
    """This host's address on the route to `host` (no packet is sent), or None."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        infos = socket.getaddrinfo(host, 9, family, socket.SOCK_DGRAM)
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])
            return s.getsockname()[0]
    except OSError:
        return None


def gloo_device_maker(store):
    """Makes the network devices of a tpcomm group's Gloo traffic (its CPU
    group, and the sub-groups between hosts or of a split), a new set per
    call: every Gloo group has a listener of its own, by whose address its
    connections are told apart (coordinator/faults/gloo_sockets.hpp). The
    interface is
    - GLOO_SOCKET_IFNAME (comma-separated interface names), as torch's gloo;
    - else, when the group's store is a TCPStore at an address other than
      loopback, this host's address on the route to that store: the address
      the other hosts reach this one by, whatever the host name resolves to
      (in a container or network namespace it often resolves to nothing,
      and torch's default then falls back to loopback, which no other host
      can reach);
    - else torch's default (the host name's address, else loopback)."""
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    if names:
        return lambda: [dist.ProcessGroupGloo.create_device(interface=n) for n in names]
    host = _store_host(store)
    if host:
        source = _route_source(host)
        if source and not ipaddress.ip_address(source.split("%")[0]).is_loopback:
            return lambda: [dist.ProcessGroupGloo.create_device(hostname=source)]
    return lambda: [dist.ProcessGroupGloo.create_default_device()]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The benchmarks' ranks are forks of a server process that imported torch
# once: a spawned rank spent about 4 s of CPU importing it, every run (a
# benchmark runs ranks many times). Each forked rank takes the environment
# its starter has when it starts (the server's is the one it started with),
# as a spawned one would.
_forkserver_started = False


def _rank_context():
    global _forkserver_started
    ctx = mp.get_context("forkserver")
    if not _forkserver_started:
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
        _forkserver_started = True
    return ctx


def _with_environ(environ, target, *args):
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def run_ranks(target, world, args_of, timeout_s):
    """Runs target(rank, world, port, *args_of(rank), results) in `world`
    processes and returns what one of them put on `results`, or None when a
    process failed or nothing was put."""
    ctx = _rank_context()
    port = free_port()
    results = ctx.SimpleQueue()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_with_environ,
                         args=(environ, target, r, world, port, *args_of(r), results))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if any(p.exitcode != 0 for p in procs) or results.empty():
        return None
    return results.get()
