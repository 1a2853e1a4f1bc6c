"""The skip mark of tests that need the testbed's home routers (nftables)."""

import pytest

from fusionllm.testbed.router import unavailable

needs_routers = pytest.mark.skipif(
    unavailable() is not None, reason=f"no home routers in the testbed: {unavailable()}"
)
