"""The supported torch range is said once per place that needs it, and all
of them agree: pyproject.toml's dependency line (what pip admits),
cmake/torch_range.cmake (what the build accepts) and python/run.sh's list
(what the two commands install). The build's check refuses a torch outside
the range with a clear message, and the test command refuses to set up one."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.torch_version  # .ci/run runs these on torch 2.11 too

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RANGE_SCRIPT = os.path.join(ROOT, "cmake", "torch_range.cmake")


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def _cmake_range():
    text = _read("cmake", "torch_range.cmake")
    low = re.search(r'set\(TPCOMM_TORCH_MIN "([0-9.]+)"\)', text).group(1)
    below = re.search(r'set\(TPCOMM_TORCH_BELOW "([0-9.]+)"\)', text).group(1)
    return low, below


def _minor(version):
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2])


def test_pyproject_cmake_and_run_sh_name_the_same_range():
    low, below = _cmake_range()
    deps = re.search(r"^dependencies = \[(.*)\]$", _read("pyproject.toml"), re.M).group(1)
    assert f'"torch>={low},<{below}"' in deps, deps
    listed = re.search(r"^supported_torch=\(([^)]*)\)$", _read("python", "run.sh"), re.M).group(1).split()
    minors = sorted({_minor(v) for v in listed})
    expected = [(2, m) for m in range(_minor(low)[1], _minor(below)[1])]
    assert minors == expected, (listed, low, below)
    assert listed[0] == max(listed, key=lambda v: tuple(map(int, v.split(".")))), "newest first"


def test_this_torch_is_in_the_range_and_is_the_one_built_against():
    import tpcomm

    low, below = _cmake_range()
    assert _minor(low) <= _minor(torch.__version__) < _minor(below), torch.__version__
    assert tpcomm._BUILD_TORCH == torch.__version__


def _check(version, untested=False):
    cmake = os.path.join(os.path.dirname(sys.executable), "cmake")
    cmake = cmake if os.path.exists(cmake) else shutil.which("cmake")
    args = [cmake, f"-DTPCOMM_TORCH_VERSION={version}"]
    if untested:
        args.append("-DTPCOMM_TORCH_UNTESTED=ON")
    done = subprocess.run([*args, "-P", RANGE_SCRIPT], capture_output=True, text=True, timeout=60)
    return done.returncode, " ".join((done.stdout + done.stderr).split())


def test_the_build_accepts_every_release_of_the_range():
    for version in ("2.11.0", "2.12.0", "2.13.0", "2.14.0", "2.15.0", "2.13.1+cu130", "2.15.2"):
        rc, out = _check(version)
        assert rc == 0 and f"torch {version}: accepted" in out, (version, out)


def test_the_build_refuses_a_torch_outside_the_range_saying_what_to_do():
    for version in ("2.10.0", "2.16.0", "3.0.0", "1.13.1", "not-a-version"):
        rc, out = _check(version)
        assert rc != 0, (version, out)
        assert f"tpcomm supports torch >=2.11,<2.16 (2.11 through 2.15), but the environment given has torch {version}." in out, out
        assert "pip install torch==2.15.0" in out and "TPCOMM_TORCH_UNTESTED=ON" in out, out
    rc, out = _check("2.16.0", untested=True)
    assert rc == 0 and "CMake Warning" in out and "has torch 2.16.0" in out, out


def test_the_test_command_refuses_an_unsupported_torch_before_setting_anything_up():
    env = {**os.environ, "TPCOMM_TORCH": "2.10.0"}
    done = subprocess.run(["bash", os.path.join(ROOT, "python", "run.sh"), "test"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done
    assert "TPCOMM_TORCH=2.10.0: tpcomm supports torch 2.11 through 2.15" in done.stderr, done.stderr
    assert not os.path.exists(os.path.join(ROOT, ".venv-torch-2.10.0"))
