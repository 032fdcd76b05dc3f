"""Every GPU test depends on the torch version (its CUDA, NCCL and c10d
headers): all are marked torch_version, which .ci/run's second torch runs."""

import os

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(items):
    for item in items:
        if os.path.dirname(str(item.path)) == _HERE:
            item.add_marker(pytest.mark.torch_version)
