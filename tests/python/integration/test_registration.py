"""Registration, settings, build facts, describe() and TPCOMM_LOG=routes."""

import os
import re
import subprocess
import sys

import pytest
import torch.distributed as dist

import tpcomm

pytestmark = pytest.mark.torch_version  # .ci/run runs these on torch 2.11 too


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
    # docs/settings.md is made from the same table: a setting added, changed
    # or removed without remaking it fails here.
    from tpcomm.info import settings_markdown
    with open(__file__.rsplit("/tests/", 1)[0] + "/docs/settings.md") as f:
        page = f.read()
    assert page == settings_markdown(), (
        "docs/settings.md differs from the settings table: remake it with "
        "`python -m tpcomm.info --settings-markdown > docs/settings.md`")
    for name in names:
        assert f"| `{name}` |" in page


def test_the_extension_uses_no_iostreams():
    # torch's libc10 exports weak copies of the iostream classes; an extension
    # built by another gcc that uses them binds to those copies and crashes
    # (the GPU machine's gcc 13 build segfaulted in message formatting, and
    # later at the first autotune cache write). Messages go through
    # detail::concat, files through stdio.
    root = __file__.rsplit("/tests/", 1)[0]
    banned = re.compile(r"#include <(sstream|fstream|iostream)>|std::(o|i)?(string|f)stream\b"
                        r"|std::(cout|cerr|clog)\b")
    found = []
    for top in ("common", "backend", "coordinator", "custom_allreduce", "message_queue", "python",
                "cpp"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in files:
                if not name.endswith((".cpp", ".hpp", ".cu", ".cuh", ".h")):
                    continue
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    for number, line in enumerate(f, 1):
                        if banned.search(line) and not line.lstrip().startswith("//"):
                            found.append(f"{os.path.relpath(path, root)}:{number}: {line.strip()}")
    assert not found, "iostreams in the extension:\n" + "\n".join(found)


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


def _describe(ctx):
    import torch.distributed as dist

    import tpcomm

    d = tpcomm.describe()
    assert d["rank"] == ctx.rank and d["world_size"] == ctx.world_size
    assert d["cpu_backend"] == "gloo" and d["device_backend"] == "nccl (not created)"
    custom = d["custom_allreduce"]
    # A CPU-only job never sets up the kernel (that needs a CUDA allreduce).
    assert custom["available"] is False
    assert custom["reason"] == "not set up yet (at the group's first CUDA allreduce)"
    assert custom["max_bytes"] == 8 << 20 and custom["zero_copy"] == {}
    # The kernel waits for a peer as long as any collective of the group: the
    # harness's init_process_group(timeout=60 s), then what set_timeout sets.
    assert custom["timeout_ms"] == 60_000
    from datetime import timedelta
    dist.group.WORLD.set_timeout(timedelta(seconds=75))
    assert tpcomm.describe()["custom_allreduce"]["timeout_ms"] == 75_000
    dist.group.WORLD.set_timeout(timedelta(seconds=60))
    assert d["device"] is None and d["autotune"] == "off"
    assert d["route_mode"] == "auto"
    assert d["cuda_allreduce_routes"] == [{"route": "nccl", "from_bytes": 0, "to_bytes": None}]
    return d["group"]


def _cpu_side_of_the_cuda_api(ctx):
    import pytest
    import torch

    import tpcomm

    # all_reduce_into and graph_capture() on CPU tensors: a copy and Gloo, and
    # a registration with nothing to register (no rank set a kernel up).
    x = torch.arange(6, dtype=torch.float64) * (ctx.rank + 1)
    out = torch.empty_like(x)
    with tpcomm.graph_capture():
        tpcomm.all_reduce_into(x, out)
    n = ctx.world_size
    assert torch.equal(out, torch.arange(6, dtype=torch.float64) * (n * (n + 1) // 2))
    assert torch.equal(x, torch.arange(6, dtype=torch.float64) * (ctx.rank + 1))  # untouched
    tpcomm.all_reduce_into(x, out, average=True)
    assert torch.allclose(out, torch.arange(6, dtype=torch.float64) * (n + 1) / 2)
    with pytest.raises(RuntimeError, match="has 5 elements, expected 6"):
        tpcomm.all_reduce_into(x, torch.empty(5, dtype=torch.float64))
    backend = tpcomm._backend_of(None)
    with pytest.raises(ValueError, match="routing mode 'fast' is not one of auto, nccl"):
        backend.set_route_mode("fast")
    backend.set_route_mode("twoshot")
    assert tpcomm.describe()["route_mode"] == "twoshot"
    backend.set_route_mode("auto")
    # An error inside the context still finishes the registration on every rank.
    with pytest.raises(KeyError):
        with tpcomm.graph_capture():
            raise KeyError("body")
    return True


def test_cpu_side_of_the_cuda_api(group):
    assert all(group.run(_cpu_side_of_the_cuda_api))


def test_describe_on_cpu(group):
    names = group.run(_describe)
    assert len(set(names)) == 1  # every rank describes the same group


def test_log_routes_writes_each_decision_once():
    code = (
        "import socket, torch, torch.distributed as dist, tpcomm\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "dist.init_process_group('tpcomm', init_method=f'tcp://127.0.0.1:{port}', rank=0,"
        " world_size=1)\n"
        "for n in (4, 8, 4):\n"
        "    dist.all_reduce(torch.ones(n))\n"
        "dist.all_reduce(torch.ones(3, dtype=torch.int64), op=dist.ReduceOp.MAX)\n"
        "dist.destroy_process_group()\n"
    )
    env = dict(os.environ, TPCOMM_LOG="routes")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    lines = [l for l in out.stderr.splitlines() if l.startswith("tpcomm route:")]
    assert lines == [
        "tpcomm route: group '0' rank 0: allreduce SUM float32 16 B -> cpu_shm (one host)",
        "tpcomm route: group '0' rank 0: allreduce MAX int64 24 B -> cpu_shm (one host)",
    ], out.stderr
