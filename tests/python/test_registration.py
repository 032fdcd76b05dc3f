"""Registration, settings and build facts, in this (single) process."""

import os
import re
import subprocess
import sys

import torch.distributed as dist

import tpcomm


def test_backend_is_registered_for_cpu_and_cuda():
    assert "TPCOMM" in dist.Backend._plugins
    assert dist.Backend("tpcomm") == "tpcomm"
    assert dist.Backend.backend_type_map["tpcomm"] == dist.ProcessGroup.BackendType.CUSTOM
    assert set(dist.Backend.backend_capability["tpcomm"]) == {"cpu", "cuda"}


def test_import_and_register_again_are_harmless():
    code = (
        "import importlib, tpcomm, torch.distributed as dist\n"
        "tpcomm.register(); importlib.reload(tpcomm); tpcomm.register()\n"
        "assert list(dist.Backend._plugins).count('TPCOMM') == 1\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_monitored_barrier_front_door_is_wrapped_once():
    assert getattr(dist.monitored_barrier, "_tpcomm_wrapped", False)
    assert dist.distributed_c10d.monitored_barrier is dist.monitored_barrier


def test_settings_are_documented():
    rows = tpcomm.settings()
    names = [r[0] for r in rows]
    assert "TPCOMM_DEBUG" in names
    for name, type_, default, doc in rows:
        assert name.startswith("TPCOMM_") and type_ and default is not None and len(doc) > 20
    with open(__file__.rsplit("/tests/", 1)[0] + "/README.md") as f:
        readme = f.read()
    for name in names:
        assert name in readme, f"{name} is not listed in the README"


def test_build_targets_a100_and_h100():
    """Without TORCH_CUDA_ARCH_LIST the build targets sm_80 and sm_90; a machine
    that sets it (some GPU images do) gets what it asked for."""
    info = tpcomm.build_info()
    assert info["cuda_version"] // 1000 == 13
    requested = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if requested is None:
        assert info["cuda_architectures"] == [800, 900]
    else:
        wanted = {int(m.group(1)) * 100 + int(m.group(2)) * 10
                  for m in re.finditer(r"(\d+)\.(\d)", requested)}
        assert set(info["cuda_architectures"]) == wanted
