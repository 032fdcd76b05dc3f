import pytest

from harness import Group

_groups = {}


# The suite that compares tpcomm bit for bit with plain Gloo runs with the CPU
# shared-memory path off: with it on, reductions are rank-ordered float32/
# float64 sums (bitwise equal across ranks, not to Gloo's order), which
# tests/python/test_cpu_shm.py checks against float64 references instead.
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


@pytest.fixture(scope="session")
def shm_groups():
    """Shared worker groups keyed by world size with the CPU shared-memory
    path on (TPCOMM_CPU_SHM=1: a failed set-up is an error, not Gloo)."""

    def get(world_size):
        if world_size not in _shm_groups:
            _shm_groups[world_size] = Group(world_size, env={"TPCOMM_CPU_SHM": "1"})
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
