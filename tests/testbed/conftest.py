"""Testbed tests need root, iproute2, /dev/net/tun and cgroup v1 CPU quotas: skip without."""

import pytest

from fusionllm.testbed.bed import unavailable


def pytest_collection_modifyitems(config, items):
    reason = unavailable()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"testbed unavailable: {reason}")
    for item in items:
        if "testbed" in item.keywords:
            item.add_marker(skip)
