"""Pieces every fusionllm package shares; imports nothing else of the project and not torch.

- errors.py: ``FusionError`` and its typed subclasses
- logs.py:   ``get_logger`` (one logger per module) and ``configure_logging`` for entry points
- cpus.py:   ``spread`` (cores for a group of local processes), ``pin`` (this process to cores)
"""

from fusionllm.common.errors import ConfigError, FrameError, FusionError, PeerError
from fusionllm.common.logs import configure_logging, get_logger

__all__ = [
    "ConfigError",
    "FrameError",
    "FusionError",
    "PeerError",
    "configure_logging",
    "get_logger",
]
