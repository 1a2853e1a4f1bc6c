"""Hard limits applied to every incoming frame before anything is allocated."""

from dataclasses import dataclass, field

from fusionllm.common.errors import ConfigError
from fusionllm.compression.dtypes import WIRE_DTYPES


@dataclass(frozen=True, kw_only=True)
class FrameLimits:
    """What a receiver accepts from a peer.

    max_elements bounds the decoded tensor, not the frame: a top-k frame of a few bytes may
    legitimately expand to many elements, so this is also the most memory one frame can make a
    node allocate (times the element size).
    """

    max_frame_bytes: int = 1 << 30
    max_rank: int = 8
    max_elements: int = 1 << 28
    allowed_dtypes: frozenset[str] = field(default_factory=lambda: frozenset(WIRE_DTYPES))
    allow_nonfinite: bool = False

    def __post_init__(self) -> None:
        if self.max_frame_bytes < 64:
            raise ConfigError(f"max_frame_bytes must be >= 64, got {self.max_frame_bytes}")
        if not 0 <= self.max_rank <= 32:
            raise ConfigError(f"max_rank must be in [0, 32], got {self.max_rank}")
        if not 1 <= self.max_elements <= 1 << 40:
            raise ConfigError(f"max_elements must be in [1, 2**40], got {self.max_elements}")
        unknown = set(self.allowed_dtypes) - set(WIRE_DTYPES)
        if unknown:
            raise ConfigError(f"unknown dtypes in allowed_dtypes: {sorted(unknown)}")


DEFAULT_LIMITS = FrameLimits()
