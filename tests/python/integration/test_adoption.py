"""Using tpcomm without code changes: the backend name registered at `import
torch` (torch's autoload entry point), the version, the compiled-against
torch check, and `python -m tpcomm.info`."""

import importlib.metadata
import os
import subprocess
import sys
import time
import warnings

import pytest

import tpcomm
from tpcomm._net import free_port

# A script that never imports tpcomm: a one-rank group, one allreduce.
WITHOUT_IMPORT = """
import sys, torch, torch.distributed as dist
assert "tpcomm" not in sys.modules, "import torch loaded tpcomm"
dist.init_process_group({backend!r}, init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
x = torch.ones(3)
dist.all_reduce(x)
backend = dist.group.WORLD._get_backend(torch.device("cpu"))
print(dist.get_backend(), type(backend).__name__, x.tolist())
dist.destroy_process_group()
"""


def _python(code, env=None, timeout=120):
    full = dict(os.environ)
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, timeout=timeout)


@pytest.mark.torch_version
@pytest.mark.parametrize("backend", ["tpcomm", "cpu:tpcomm,cuda:tpcomm"])
def test_a_script_that_never_imports_tpcomm_gets_the_backend(backend):
    done = _python(WITHOUT_IMPORT.format(backend=backend, port=free_port()))
    assert done.returncode == 0, done.stderr
    assert "ProcessGroupTpcomm [1.0, 1.0, 1.0]" in done.stdout, done.stdout


@pytest.mark.torch_version
@pytest.mark.parametrize("switch", ["TORCH_DEVICE_BACKEND_AUTOLOAD", "TPCOMM_AUTOLOAD"])
def test_autoload_is_off_with_either_switch(switch):
    done = _python(WITHOUT_IMPORT.format(backend="tpcomm", port=free_port()), {switch: "0"})
    assert done.returncode != 0
    assert "tpcomm" in done.stderr and ("Invalid backend" in done.stderr
                                        or "Unknown backend" in done.stderr), done.stderr


def test_import_torch_costs_little_with_the_hook():
    """The hook registers a name and loads nothing of tpcomm; the cost is
    printed (one interpreter start each way: starts vary by more than the
    difference, so this is no measurement), not asserted."""
    code = ("import time; t = time.perf_counter(); import torch, sys; "
            "print(time.perf_counter() - t, 'tpcomm' in sys.modules, "
            "'TPCOMM' in torch.distributed.Backend._plugins)")
    on, off = [], []
    for env, out in (({}, on), ({"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}, off)):
        done = _python(code, env)
        assert done.returncode == 0, done.stderr
        seconds, loaded, registered = done.stdout.split()
        assert loaded == "False"
        assert registered == ("True" if not env else "False")
        out.append(float(seconds))
    # The hook itself, in one process: its import and its registration.
    code = ("import time, torch, torch.distributed as dist; "
            "dist.Backend._plugins.pop('TPCOMM', None); t = time.perf_counter(); "
            "import _tpcomm_autoload; _tpcomm_autoload.register(); "
            "print(time.perf_counter() - t, 'TPCOMM' in dist.Backend._plugins)")
    done = _python(code, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert done.returncode == 0, done.stderr
    hook, registered = done.stdout.split()
    assert registered == "True"
    print(f"\nimport torch: {1e3 * min(on):.1f} ms with the tpcomm hook, {1e3 * min(off):.1f} ms "
          f"without (one start each; interpreter starts vary by more than the difference); "
          f"the hook's import and registration alone: {1e3 * float(hook):.2f} ms")


def test_a_failing_hook_warns_and_never_breaks_import_torch(monkeypatch):
    import torch.distributed as dist

    import _tpcomm_autoload

    monkeypatch.setattr(dist.Backend, "_plugins", {})

    def broken(*args, **kwargs):
        raise OSError("simulated broken install")

    monkeypatch.setattr(dist.Backend, "register_backend", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _tpcomm_autoload.register()  # returns, never raises
    texts = [str(w.message) for w in caught]
    assert len(texts) == 1, texts
    assert "tpcomm" in texts[0] and "TPCOMM_AUTOLOAD=0" in texts[0]
    assert "simulated broken install" in texts[0]


def test_version_is_the_installed_distributions():
    assert tpcomm.__version__ == importlib.metadata.version("tpcomm")


@pytest.mark.torch_version
def test_another_torch_than_the_compiled_one_is_refused_at_import():
    assert tpcomm._BUILD_TORCH is not None
    tpcomm._check_build_torch("2.11.0", "2.11.0")
    with pytest.raises(ImportError, match="compiled against torch 2.11.0, but this environment "
                                          "has torch 2.11.9"):
        tpcomm._check_build_torch("2.11.0", "2.11.9")
    done = _python("import torch; torch.__version__ = '2.11.9'; import tpcomm")
    assert done.returncode != 0
    assert f"compiled against torch {tpcomm._BUILD_TORCH}" in done.stderr, done.stderr
    assert "rebuild tpcomm" in done.stderr
    # the rebuild it names keeps the environment's torch
    assert "pip install --no-build-isolation --no-deps --force-reinstall" in done.stderr, done.stderr


@pytest.mark.torch_version
def test_info_reports_versions_host_settings_and_paths():
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "tpcomm.info"], capture_output=True, text=True,
                          env=dict(os.environ, TPCOMM_CPU_SHM_SPIN_US="7"), timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "tpcomm:" in out and tpcomm.__version__ in out
    assert f"compiled against torch:      {tpcomm._BUILD_TORCH}" in out
    assert f"host identity:               {tpcomm._C.host_id()}" in out
    assert "TPCOMM_CPU_SHM_SPIN_US=7" in out
    assert "CPU shared memory:         yes" in out
    assert "autoload at import torch:    yes" in out
    assert "custom CUDA allreduce:" in out and "NCCL:" in out
    print(f"\n{out}(took {time.monotonic() - start:.1f} s)")


def _torchrun(*args):
    script = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples",
                          "torchrun_collectives.py")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", script, *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.torch_version
def test_torchrun_runs_a_gloo_script_on_tpcomm_by_the_backend_string_alone():
    ours, gloo = _torchrun(), _torchrun("--backend", "gloo")
    assert ours.returncode == 0, ours.stderr
    assert gloo.returncode == 0, gloo.stderr
    for rank in (0, 1):
        want = "all_reduce [1.0, 3.0, 5.0, 7.0], all_gather [0, 1], broadcast [7, 11]"
        assert f"rank {rank}/2 on tpcomm (ProcessGroupTpcomm): {want}" in ours.stdout, ours.stdout
        assert f"rank {rank}/2 on gloo (ProcessGroupGloo): {want}" in gloo.stdout, gloo.stdout


def test_the_wheel_installs_apart_and_serves_a_group(tmp_path):
    """`pip wheel` over this tree's build (incremental: the test command
    built it already in the build folder of this torch, which it names in
    TPCOMM_TEST_BUILD_DIR; else a build folder of the test's own), installed
    into a directory of its own that shadows the development install; a
    script that never imports tpcomm gets the backend from the wheel's entry
    point and runs a collective."""
    root = os.path.join(os.path.dirname(__file__), "..", "..", "..")
    build_dir = os.environ.get("TPCOMM_TEST_BUILD_DIR") or str(tmp_path / "build")
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-build-isolation", "--no-deps",
         "-w", str(wheels), "-C", f"build-dir={build_dir}",
         "-C", "cmake.define.TPCOMM_BUILD_TESTS=ON",
         "-C", f"cmake.define.Python_EXECUTABLE={sys.executable}", root],
        capture_output=True, text=True, timeout=1800)
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = list(wheels.glob("tpcomm-*.whl"))
    assert wheel.name.startswith(f"tpcomm-{tpcomm.__version__}-")
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
         str(wheel)], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-3000:]
    code = WITHOUT_IMPORT.format(backend="tpcomm", port=free_port()) + (
        "import tpcomm; print(tpcomm.__file__, tpcomm.__version__)\n")
    done = _python(code, {"PYTHONPATH": str(target)})
    assert done.returncode == 0, done.stderr
    assert "ProcessGroupTpcomm [1.0, 1.0, 1.0]" in done.stdout, done.stdout
    assert f"{target}/tpcomm/__init__.py {tpcomm.__version__}" in done.stdout, done.stdout


def test_transformers_tensor_parallelism_runs_on_tpcomm_under_torchrun():
    """transformers' own TP (DistributedConfig(tp_plan="auto")) at TP=2 on a
    small random Llama: logits within 1e-5 of one process, the same greedy
    tokens, every collective through tpcomm's shared memory."""
    import re

    script = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples",
                          "hf_tensor_parallel.py")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", script], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        # torchrun merges the ranks' output: a line may run into another's.
        line = re.search(rf"rank {rank}: max \|logit diff\| vs one process (\d\.\de[-+]\d+), "
                         rf"greedy tokens equal: (True|False), collectives (\{{[^}}]*\}})",
                         done.stdout)
        assert line, done.stdout
        assert float(line.group(1)) <= 1e-5, line.group(0)
        assert line.group(2) == "True", line.group(0)
        assert line.group(3).startswith("{'cpu_shm': "), line.group(0)


def test_transformers_fsdp2_with_tensor_parallelism_on_a_2x2_mesh():
    """transformers' DistributedConfig(tp_size=2, fsdp_size=2) on 4 ranks:
    one training step, parameters within 1e-5 of one process on both
    replicas' batches."""
    import re

    script = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "hf_fsdp_tp.py")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "4", script], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    # torchrun merges the ranks' output: a line may run into another's.
    found = dict(re.findall(r"rank (\d): loss \S+, max \|parameter diff\| vs one process after "
                            r"a step (\d\.\de[-+]\d+)", done.stdout))
    assert sorted(found) == ["0", "1", "2", "3"], done.stdout
    assert all(float(d) <= 1e-5 for d in found.values()), found
