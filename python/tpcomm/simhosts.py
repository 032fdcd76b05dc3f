"""Separate hosts on this one machine, for tests, benchmarks and the demo
across hosts: each simulated host is a set of Linux namespaces made here with
`ip` and `unshare` (root only):

- network: its own namespace, one interface `eth0` with its own address on a
  private subnet, joined through a veth pair to a bridge in a namespace of
  its own; traffic never leaves the namespaces made here;
- UTS: its own host name (simhost0, simhost1, ...);
- mount: its own /dev/shm (a fresh tmpfs) and /proc;
- pid: its own pid namespace, so pids are not comparable across hosts.

With `link_gbit=G` each host's link runs at G Gbit/s each way, as a
cluster's network does: a token-bucket shaper (`tc qdisc ... tbf`) on the
host's eth0 (what it sends) and on its port of the bridge (what it
receives). Without it the veth pairs run as fast as this machine copies
memory (about 17 Gbit/s one way here), so time does not follow bytes.
Latency is not added (netem is not available in these namespaces).

The ranks of one host run under one launcher process (the pid namespace's
init), so that they share those namespaces as processes of one machine do.

    with SimulatedHosts(2) as hosts:
        procs = hosts.launch_ranks([[0, 1], [2, 3]], [sys.executable, "worker.py"])
        hosts.wait(procs, timeout=120)

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR
(the address of rank 0's host) and MASTER_PORT in its environment; Gloo
finds its interface by itself (tpcomm's choice: the address on the route to
the store) unless the caller sets GLOO_SOCKET_IFNAME=eth0.

`python <this file> --ranks 0,1 -- ARGV...` is the launcher a host runs
(internal). It is run as a file, not as `-m tpcomm.simhosts`: the package's
import would load torch (about 4 s of CPU) into a process that only starts
the ranks, once per host and test."""

import ctypes
import os
import random
import shutil
import signal
import subprocess
import sys
import time


_LAUNCHER = os.path.abspath(__file__)


class Unavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no `ip`/`unshare`, or the
    kernel refuses); the message says which."""


def _run(*argv):
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise Unavailable(f"'{' '.join(argv)}' failed: {done.stderr.strip() or done.returncode}")


def _die_with_parent():
    """In a launched child before exec: SIGKILL when the process that
    launched it dies (kept across exec), so that no simulated host outlives
    its test."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _sweep_stale():
    """Removes namespaces of earlier runs whose process is gone (a run that
    was killed before it cleaned up)."""
    try:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                               timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return
    for name in names:
        if not name.startswith("tpsim") or "-" not in name:
            continue
        pid = name[len("tpsim"):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def unavailable_reason():
    """None where SimulatedHosts can be made here, else why not."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"simulated hosts need the '{tool}' command (iproute2 / util-linux)"
    try:
        with SimulatedHosts(1):
            pass
    except Unavailable as e:
        return str(e)
    return None


class SimulatedHosts:
    """`count` hosts (see the module's text); a context manager that removes
    every namespace it made, and kills what still runs in them, on exit."""

    def __init__(self, count, hostnames=None, link_gbit=None):
        """`hostnames`: each host's name (default simhost0, simhost1, ...);
        equal names make hosts as containers with one name are.
        `link_gbit`: each host's link rate each way (None: unshaped)."""
        if link_gbit is not None and not 0.001 <= link_gbit <= 400:
            raise ValueError(f"link_gbit={link_gbit}: a rate from 0.001 to 400 Gbit/s, or None")
        self.count = count
        self.link_gbit = link_gbit
        self._names = list(hostnames) if hostnames else None
        self.tag = f"tpsim{os.getpid()}-{random.randrange(1 << 20):05x}"
        # A /24 in 10.0.0.0/8 picked at random (collisions with a real
        # network are harmless: the namespaces have no route outside).
        self.subnet = f"10.{random.randrange(100, 250)}.{random.randrange(256)}"
        self._made = []
        self._procs = []

    def namespace(self, h):
        return f"{self.tag}-h{h}"

    def address(self, h):
        return f"{self.subnet}.{h + 1}"

    def hostname(self, h):
        return self._names[h] if self._names else f"simhost{h}"

    def __enter__(self):
        _sweep_stale()
        bridge = f"{self.tag}-br"
        try:
            _run("ip", "netns", "add", bridge)
            self._made.append(bridge)
            _run("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", bridge, "link", "set", "br0", "up")
            for h in range(self.count):
                ns = self.namespace(h)
                _run("ip", "netns", "add", ns)
                self._made.append(ns)
                _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name",
                     f"p{h}", "netns", bridge)
                _run("ip", "-n", ns, "addr", "add", f"{self.address(h)}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "-n", bridge, "link", "set", f"p{h}", "master", "br0", "up")
                if self.link_gbit is not None:
                    self._shape(ns, "eth0")
                    self._shape(bridge, f"p{h}")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _shape(self, ns, device):
        """A token bucket of link_gbit on `device`'s egress: its bucket holds
        100 us of the rate (at least 32 KB, so whole segments pass), its queue
        50 ms."""
        rate = int(self.link_gbit * 1e9)
        burst = max(32 << 10, rate // 8 // 10000)
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", device, "root", "tbf",
             "rate", f"{rate}bit", "burst", str(burst), "latency", "50ms")

    def shaping(self, h):
        """What `tc` says of host h's eth0 qdisc (tests: the shaper is there)."""
        return subprocess.run(["ip", "netns", "exec", self.namespace(h), "tc", "qdisc", "show",
                               "dev", "eth0"], capture_output=True, text=True,
                              timeout=30).stdout.strip()

    def __exit__(self, *exc):
        for p in self._procs:
            self.kill(p)
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made = []
        return False

    def launch(self, h, ranks, argv, env, world, port, stdout=None, stderr=None):
        """Starts `argv` once per rank of `ranks` (group ranks) on host `h`;
        returns the host's launcher process."""
        env = dict(env)
        env.update({"WORLD_SIZE": str(world), "MASTER_PORT": str(port),
                    "LOCAL_WORLD_SIZE": str(len(ranks))})
        script = ('hostname "$0" && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && '
                  'exec "$@"')
        cmd = ["ip", "netns", "exec", self.namespace(h),
               "unshare", "--uts", "--mount", "--pid", "--fork", "--mount-proc",
               "--kill-child=SIGKILL", "--",
               "sh", "-c", script, self.hostname(h),
               sys.executable, "-I", _LAUNCHER, "--ranks",
               ",".join(str(r) for r in ranks), "--", *argv]
        proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr,
                                start_new_session=True, preexec_fn=_die_with_parent)
        self._procs.append(proc)
        return proc

    def launch_ranks(self, layout, argv, env=None, port=29500, stdout=None, stderr=None):
        """`layout`: the group ranks of each host (hosts 0, 1, ...); rank 0's
        host serves the store. Returns the hosts' launcher processes."""
        world = sum(len(r) for r in layout)
        root = next(h for h, ranks in enumerate(layout) if 0 in ranks)
        env = dict(os.environ if env is None else env)
        env["MASTER_ADDR"] = self.address(root)
        return [self.launch(h, ranks, argv, env, world, port, stdout, stderr)
                for h, ranks in enumerate(layout)]

    @staticmethod
    def kill(proc):
        """Kills a host: its launcher and every rank under it."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def wait(self, procs, timeout):
        """Waits for every host; returns their exit codes (None: killed at the
        timeout)."""
        deadline = time.monotonic() + timeout
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill(p)
                codes.append(None)
        return codes


def _launcher(argv):
    """A host's launcher: one process per rank, each with its rank in the
    environment; exits with the first failure's code (0 when all succeed).
    Runs as the pid namespace's init: when it dies the kernel kills the
    ranks."""
    ranks = [int(r) for r in argv[argv.index("--ranks") + 1].split(",")]
    command = argv[argv.index("--") + 1:]
    procs = []
    for local, rank in enumerate(ranks):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(local))
        procs.append(subprocess.Popen(command, env=env))
    code = 0
    for p in procs:
        rc = p.wait()
        if rc != 0 and code == 0:
            code = rc if rc > 0 else 128 - rc
    return code


if __name__ == "__main__":
    sys.exit(_launcher(sys.argv[1:]))
