import os
import sys

import pytest

from harness import Group

# Some tests run other folders' rank functions (test_cpu_shm runs
# test_users's): every folder is importable whichever subset runs.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _folder in sorted(os.listdir(_HERE)):
    if os.path.isfile(os.path.join(_HERE, _folder, "__init__.py")):
        continue
    if _folder.startswith(("_", ".")) or not os.path.isdir(os.path.join(_HERE, _folder)):
        continue
    if os.path.join(_HERE, _folder) not in sys.path:
        sys.path.append(os.path.join(_HERE, _folder))

_groups = {}


# The suite that compares tpcomm bit for bit with plain Gloo runs with the CPU
# shared-memory path off: with it on, reductions are rank-ordered float32/
# float64 sums (bitwise equal across ranks, not to Gloo's order), which
# tests/python/collectives/test_cpu_shm.py checks against float64 references instead.
GLOO_EXACT = {"TPCOMM_CPU_SHM": "0"}


@pytest.fixture(scope="session")
def groups():
    """Shared worker groups keyed by world size (CPU shared-memory path off:
    results bitwise equal to Gloo's), reused by all tests."""

    def get(world_size):
        if world_size not in _groups:
            _groups[world_size] = Group(world_size, env=GLOO_EXACT)
        return _groups[world_size]

    yield get
    for g in _groups.values():
        g.close()
    _groups.clear()


@pytest.fixture(params=[1, 2, 3, 4], ids=lambda n: f"ws{n}")
def group(request, groups):
    return groups(request.param)


_shm_groups = {}


# The CPU shared-memory path on (a failed set-up is an error, not Gloo),
# with small chunks (1 KiB of float32) and an early two-phase crossover, so
# that modest sizes cross chunk boundaries and both allreduce algorithms run.
SHM_SMALL_CHUNKS = {"TPCOMM_CPU_SHM": "1", "TPCOMM_CPU_SHM_BUFFER_BYTES": "4096",
                    "TPCOMM_CPU_SHM_TWO_PHASE_BYTES": "8192"}


@pytest.fixture(scope="module")
def shm_groups():
    """Worker groups keyed by world size with the CPU shared-memory path on
    (SHM_SMALL_CHUNKS), shared by one module's tests and closed after it."""

    def get(world_size):
        if world_size not in _shm_groups:
            _shm_groups[world_size] = Group(world_size, env=SHM_SMALL_CHUNKS)
        return _shm_groups[world_size]

    yield get
    for g in _shm_groups.values():
        g.close()
    _shm_groups.clear()


@pytest.fixture(scope="session", autouse=True)
def dev_shm_unchanged():
    """After the whole suite (crashes and killed ranks included) /dev/shm
    holds no entry that was not there before it."""
    import os

    def names():
        return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()

    before = names()
    yield
    # Worker groups shut down first (their fixtures end before this one).
    for g in list(_groups.values()) + list(_shm_groups.values()):
        g.close()
    left = sorted(n for n in names() - before if n.startswith("tpcomm"))
    assert not left, f"left in /dev/shm by the test suite: {left}"
