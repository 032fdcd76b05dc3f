"""The custom allreduce's host-side decisions through the Python bindings (no
GPU needed): eligibility over faked topologies, algorithm and block choice,
and the settings that size it."""

import subprocess
import sys

import pytest

from tpcomm import _C

pytestmark = pytest.mark.torch_version  # .ci/run runs these on torch 2.11 too


def test_group_eligibility_explains_itself():
    nv4 = ["nnnn"] * 4
    ok, reason = _C.car_group_eligibility(["h"] * 4, [0, 1, 2, 3], ["yyyy"] * 4, nv4, True)
    assert ok and reason == ""
    ok, reason = _C.car_group_eligibility(["h", "h", "g"], [0, 1, 2], ["yyy"] * 3, ["nnn"] * 3,
                                          True)
    assert not ok and reason == "ranks 0 and 2 are on different hosts ('h' and 'g')"
    ok, reason = _C.car_group_eligibility(["h", "h"], [0, 1], ["yx", "yy"], ["nn"] * 2, True)
    assert not ok and reason == "no P2P access from rank 0 (GPU 0) to rank 1 (GPU 1)"
    ok, reason = _C.car_group_eligibility(["h", "h"], [0, 0], ["xx"] * 2, ["pp"] * 2, True)
    assert ok, reason  # two ranks sharing one GPU
    ok, reason = _C.car_group_eligibility(["h"] * 4, [0, 1, 2, 3], ["????"] * 4, ["????"] * 4,
                                          True)
    assert ok, reason  # one visible GPU per process: the probe decides
    ok, reason = _C.car_group_eligibility(["h"] * 3, [0, 1, 2], ["yyy"] * 3, ["npn"] * 3, True)
    assert not ok and "not linked by NVLink; past 2 GPUs" in reason, reason
    ok, reason = _C.car_group_eligibility(["h", "h"], [0, 1], ["yy"] * 2, ["nn"] * 2, False,
                                          "rank 1 saw no write from ranks [0]")
    assert reason == "the IPC write probe failed: rank 1 saw no write from ranks [0]"


def test_call_eligibility_and_choices():
    assert _C.car_call_eligibility("bfloat16", 1024, 4096, 4096, 1 << 20) == (True, "")
    assert _C.car_call_eligibility("int32", 1024, 4096, 4096, 1 << 20)[1].startswith(
        "dtype int32")
    assert _C.car_choose_algorithm(2, 1 << 20, 8 << 20) == "oneshot"
    assert _C.car_choose_algorithm(2, (1 << 20) + 16, 8 << 20) == "twoshot"
    assert _C.car_choose_algorithm(8, 1 << 20, 8 << 20) == "twoshot"
    assert _C.car_choose_blocks("oneshot", 2, 16, 0) == 1
    with pytest.raises(ValueError, match="algorithm 'ring' is not one of"):
        _C.car_choose_blocks("ring", 2, 16, 0)


def test_settings_size_the_kernel():
    code = "from tpcomm import _C; print(sorted(_C.car_defaults().items()))"
    env = {"TPCOMM_CAR_MAX_BYTES": "65536", "TPCOMM_CAR_TIMEOUT_MS": "250",
           "TPCOMM_CAR_BLOCKS": "4", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[('blocks', 4), ('max_bytes', 65536), ('timeout_ms', 250)]"
    # Unset, a group's kernel waits as long as the group (test_registration);
    # the direct API, which has no group, waits 10 minutes as NCCL does.
    del env["TPCOMM_CAR_TIMEOUT_MS"]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[('blocks', 4), ('max_bytes', 65536), ('timeout_ms', 600000)]"
    env["TPCOMM_CAR_MAX_BYTES"] = "1000"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode != 0 and "TPCOMM_CAR_MAX_BYTES=1000 is not a multiple of 16" in out.stderr
