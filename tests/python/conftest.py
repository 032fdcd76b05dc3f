import pytest

from harness import Group

_groups = {}


@pytest.fixture(scope="session")
def groups():
    """Shared worker groups keyed by world size (plain settings), reused by all tests."""

    def get(world_size):
        if world_size not in _groups:
            _groups[world_size] = Group(world_size)
        return _groups[world_size]

    yield get
    for g in _groups.values():
        g.close()
    _groups.clear()


@pytest.fixture(params=[1, 2, 3, 4], ids=lambda n: f"ws{n}")
def group(request, groups):
    return groups(request.param)
