"""python -m tpcomm.info: this environment as tpcomm sees it, for bug reports
(as torch's `python -m torch.utils.collect_env`): versions, host identity,
the settings in force, and which paths this machine can use, with reasons.
`python -m tpcomm.info --settings-markdown` prints docs/settings.md, made
from the one settings table (common/settings.cpp);
`python -m tpcomm.info --cmake-prefix` prints the folder to put on
CMAKE_PREFIX_PATH for `find_package(tpcomm)` (docs/cpp.md)."""

import os
import platform
import sys


def _line(name, value):
    print(f"{name + ':':<28} {value}")


def _autoload():
    """Whether `import torch` registers the backend by itself, and why not."""
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="torch.backends") if e.name == "tpcomm"]
    if not found:
        return "no (the 'tpcomm' entry point of group torch.backends is not installed)"
    if os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "1":
        return "no (TORCH_DEVICE_BACKEND_AUTOLOAD is not 1)"
    if os.environ.get("TPCOMM_AUTOLOAD", "1") == "0":
        return "no (TPCOMM_AUTOLOAD=0)"
    return f"yes ({found[0].value} at `import torch`)"


def _shared_memory():
    from tpcomm import _C

    try:
        writer = _C.MqWriter(1, 1, 4096)
        writer.shutdown()
        return "yes (memfd regions map)"
    except Exception as e:  # noqa: BLE001  (reported as the reason)
        return f"no ({type(e).__name__}: {e})"


def _gpu_paths(torch):
    import torch.distributed as dist

    if not torch.cuda.is_available():
        why = "no CUDA device" if torch.version.cuda else "this torch has no CUDA"
        return f"no ({why})", f"no ({why})"
    n = torch.cuda.device_count()
    nccl = "yes" if dist.is_nccl_available() else "no (this torch has no NCCL)"
    if n < 2:
        custom = f"no ({n} GPU: the kernel needs two or more GPUs of one host with peer access)"
    else:
        peers = all(torch.cuda.can_device_access_peer(a, b)
                    for a in range(n) for b in range(n) if a != b)
        custom = (f"yes ({n} GPUs, peer access between all)" if peers
                  else f"no (not every pair of the {n} GPUs has peer access)")
    return custom, nccl


def cmake_prefix():
    """The CMake prefix of the installed C++ package
    (<site-packages>/tpcomm/share/cmake), found without importing torch, or
    None where the package has none (a source tree on sys.path)."""
    import importlib.util

    spec = importlib.util.find_spec("tpcomm")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        prefix = os.path.join(folder, "share", "cmake")
        if os.path.isfile(os.path.join(prefix, "tpcomm", "tpcommConfig.cmake")):
            return prefix
    return None


def settings_markdown():
    """docs/settings.md: every TPCOMM_* setting from the extension's own
    table, which the code reads (tests/python/integration/test_registration.py checks
    that the file is this text)."""
    from tpcomm import _C

    out = [
        "# Settings",
        "",
        "<!-- Made by `python -m tpcomm.info --settings-markdown > docs/settings.md` from the",
        "     table in common/settings.cpp; edit that table, not this file. -->",
        "",
        "Every setting is an environment variable, read once per process;",
        "`tpcomm.settings()` lists them and `python -m tpcomm.info` shows the ones set.",
        "",
        "| variable | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for name, type_, default, doc in _C.settings():
        shown = f"`{default}`" if default else "empty"
        out.append(f"| `{name}` | {type_} | {shown} | {doc.replace('|', '/')} |")
    return "\n".join(out) + "\n"


def main():
    if sys.argv[1:] == ["--settings-markdown"]:
        sys.stdout.write(settings_markdown())
        return 0
    if sys.argv[1:] == ["--cmake-prefix"]:
        prefix = cmake_prefix()
        if prefix is None:
            print("tpcomm's CMake package is not installed beside this tpcomm (a source tree?): "
                  "install tpcomm with pip first", file=sys.stderr)
            return 1
        print(prefix)
        return 0
    import torch
    import torch.distributed as dist

    import tpcomm
    from tpcomm import _C

    _line("tpcomm", f"{tpcomm.__version__} ({os.path.dirname(tpcomm.__file__)})")
    _line("compiled against torch", tpcomm._BUILD_TORCH or "unknown (a source tree)")
    _line("torch", torch.__version__)
    _line("python", f"{platform.python_version()} ({sys.executable})")
    _line("C++ package (CMake prefix)", cmake_prefix() or "not installed (a source tree)")
    build = tpcomm.build_info()
    cuda_build = build["cuda_version"]
    _line("CUDA (tpcomm's kernels)",
          f"{cuda_build // 1000}.{cuda_build % 1000 // 10}, SM {build['cuda_architectures']}")
    _line("CUDA (torch)", torch.version.cuda or "none")
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if (
        torch.version.cuda and dist.is_nccl_available()) else "none"
    _line("NCCL (torch)", nccl)
    _line("Gloo (torch)", "available" if dist.is_gloo_available() else "not available")
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    _line("GPUs", ", ".join(gpus) if gpus else "none")
    _line("host name", _C.host_name())
    _line("host identity", _C.host_id())
    _line("usable CPUs", f"{_C.usable_cpus()} ({_C.rank_cpus()}; NUMA nodes with memory: "
          f"{_C.numa_nodes()})")
    asked = os.environ.get("TPCOMM_CPU_REDUCE_ISA", "auto") or "auto"
    _line("CPU reduction kernels",
          f"{_C.cpu_reduce_isa_of(asked)} in use (TPCOMM_CPU_REDUCE_ISA={asked}; this CPU "
          f"runs {', '.join(_C.cpu_reduce_isas())})")
    _line("autoload at import torch", _autoload())
    capabilities = build["torch_capabilities"]
    _line("torch backend capabilities",
          ", ".join(f"{name} {'on' if on else 'off'}" for name, on in capabilities.items()))
    print("hooks into torch's internals (off: the calls take torch's own route):")
    for name, state in tpcomm.torch_hooks().items():
        _line(f"  {name}", state)
    print("settings in force (set in the environment):")
    names = [s[0] for s in tpcomm.settings()] + [
        "GLOO_SOCKET_IFNAME", "TORCH_DEVICE_BACKEND_AUTOLOAD", "TPCOMM_AUTOLOAD"]
    shown = [n for n in names if n in os.environ]
    for name in shown:
        print(f"  {name}={os.environ[name]}")
    if not shown:
        print("  none (every TPCOMM_* setting at its default; `tpcomm.settings()` lists them)")
    print("paths this machine can use:")
    _line("  CPU shared memory", _shared_memory())
    custom, nccl = _gpu_paths(torch)
    _line("  custom CUDA allreduce", custom)
    _line("  NCCL", nccl)
    _line("  Gloo between hosts", "yes" if dist.is_gloo_available() else "no")
    return 0


if __name__ == "__main__":
    sys.exit(main())
