"""Testbed tests need root, iproute2, /dev/net/tun and cgroup v1 CPU quotas: skip without.

Before they run, what testbeds of dead processes left behind (a run killed with SIGKILL) is
removed; a live process's testbed is never touched."""

import pytest

from fusionllm.common.logs import get_logger
from fusionllm.testbed.bed import sweep_stale, unavailable

logger = get_logger("tests.testbed")


def pytest_collection_modifyitems(config, items):
    reason = unavailable()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"testbed unavailable: {reason}")
    for item in items:
        if "testbed" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _no_stale_testbeds() -> None:
    if unavailable() is None:
        removed = sweep_stale()
        if removed:
            logger.warning("removed what dead testbeds left: %s", removed)
