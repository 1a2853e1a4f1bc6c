"""The testbed's typed errors."""

from fusionllm.common.errors import ConfigError, FusionError


class TestbedError(FusionError):
    """Setting up, using or tearing down the emulated network failed."""

    __test__ = False  # not a pytest class, whatever its name


class TopologyError(ConfigError):
    """A topology file is malformed or inconsistent."""
