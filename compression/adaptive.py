"""AdaTopK: compress a link only when it is the bottleneck, just enough to hide under compute.

A link may spend ``time_budget_s`` (the slowest stage's compute time) moving a tensor, so it can
carry ``bandwidth x budget`` bytes. The policy picks the most faithful encoding that fits:
dense, then float16 (half the bytes of float32), then top-k with the largest ratio whose wire
bytes fit, never below ``min_ratio``. ``target_ratio`` is the pure rule (the planner uses it);
``AdaTopK`` is one link direction's stateful policy, which adds hysteresis so that a noisy
bandwidth estimate does not make the ratio flap between steps.

Activations spend a top-k ratio's bytes differently (``activation_codec``): while it fits, a
ternary code of every element (``TernaryCodec``) rather than a few exact values. Activations
have no error feedback (each micro-batch is new data), and at ratio 0.05 top-k left ~88% of a
GPT-2 residual stream's norm behind, the ternary code ~38%. Gradients default to top-k with
error feedback; ``budget_codec(ternary=True)`` gives them the ternary code too.
"""

import math
from dataclasses import dataclass

import torch

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.compression.codecs import (
    Codec,
    Float16Codec,
    IdentityCodec,
    TernaryCodec,
    TopKCodec,
)
from fusionllm.compression.wire_sizes import (  # noqa: F401 (re-exported: adaptive's API)
    _wire_fraction,
    ratio_for_wire_fraction,
    target_ratio,
    ternary_group_for,
    ternary_wire_bytes,
    topk_wire_bytes,
)

logger = get_logger(__name__)

# Above this ratio an activation stays top-k: on Gaussian data top-k leaves less error than the
# ternary code's ~19% of the energy once it keeps about a third of the entries (a quarter keeps
# a margin), and its bytes then buy several bits per element, more than ternary's 1.6.
_TERNARY_MAX_RATIO = 0.25


def budget_codec(
    numel: int, ratio: float, *, ternary: bool, value_dtype: torch.dtype = torch.float16
) -> Codec:
    """The codec for ``numel`` elements given top-k ``ratio``'s bytes.

    1.0: dense. With ``ternary`` and a ratio up to ``_TERNARY_MAX_RATIO``, a TernaryCodec with
    the smallest group that fits top-k's bytes (ratio 0.05 of a (B, T, 64) fp32 activation:
    groups of 81); otherwise, or where even one scale does not fit (ratios below about 0.038),
    top-k itself.
    """
    if ratio >= 1.0:
        return IdentityCodec()
    group = ternary_group_for(numel, ratio) if ternary and ratio <= _TERNARY_MAX_RATIO else None
    if group is None:
        return TopKCodec(ratio, value_dtype=value_dtype)
    return TernaryCodec(group, value_dtype=value_dtype)


def activation_codec(
    numel: int, ratio: float, *, value_dtype: torch.dtype = torch.float16
) -> Codec:
    """How an activation spends top-k ``ratio``'s bytes: ternary while it fits (see module)."""
    return budget_codec(numel, ratio, ternary=True, value_dtype=value_dtype)


@dataclass(frozen=True, kw_only=True)
class AdaTopKConfig:
    """Settings of one link direction's policy.

    hysteresis: the allowed wire fraction only moves when the measured one leaves
    [current / (1 + h), current * (1 + h)]; it then snaps down to a ladder of
    ``levels_per_octave`` steps per halving, so the link never overshoots its budget by more
    than the band.
    """

    min_ratio: float = 0.001
    hysteresis: float = 0.25
    levels_per_octave: int = 2
    allow_fp16: bool = True
    value_dtype: torch.dtype = torch.float16
    # Spend the top-k bytes on a ternary code while it fits (``budget_codec``): what an
    # activation link does; a gradient link may too (error feedback works with either).
    ternary: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.min_ratio <= 1.0:
            raise ConfigError(f"min_ratio must be in (0, 1], got {self.min_ratio}")
        if not 0.0 <= self.hysteresis <= 4.0:
            raise ConfigError(f"hysteresis must be in [0, 4], got {self.hysteresis}")
        if not 1 <= self.levels_per_octave <= 64:
            raise ConfigError(f"levels_per_octave must be in [1, 64], got {self.levels_per_octave}")
        if self.value_dtype not in (torch.float16, torch.bfloat16):
            raise ConfigError(f"value_dtype must be float16 or bfloat16, got {self.value_dtype}")


class AdaTopK:
    """One link direction's compression policy, with hysteresis across calls."""

    def __init__(self, config: AdaTopKConfig | None = None) -> None:
        self.config = config if config is not None else AdaTopKConfig()
        self._wire_fraction: float | None = None

    def ratio_for(
        self,
        bandwidth_bytes_per_s: float,
        dense_bytes: float,
        time_budget_s: float,
        *,
        element_size: int = 4,
    ) -> float:
        """Fraction of elements to send, in (0, 1]; 1.0 means dense."""
        wire_fraction = self._update(bandwidth_bytes_per_s, dense_bytes, time_budget_s)
        return ratio_for_wire_fraction(
            wire_fraction,
            element_size=element_size,
            min_ratio=self.config.min_ratio,
            allow_fp16=self.config.allow_fp16,
        )

    def codec_for(
        self,
        bandwidth_bytes_per_s: float,
        dense_bytes: float,
        time_budget_s: float,
        *,
        element_size: int = 4,
    ) -> Codec:
        """The codec that fits the budget: IdentityCodec, Float16Codec, TopKCodec, or with
        ``config.ternary`` TernaryCodec (see ``budget_codec``)."""
        ratio = self.ratio_for(
            bandwidth_bytes_per_s, dense_bytes, time_budget_s, element_size=element_size
        )
        if ratio < 1.0:
            return budget_codec(
                round(dense_bytes / element_size),
                ratio,
                ternary=self.config.ternary,
                value_dtype=self.config.value_dtype,
            )
        assert self._wire_fraction is not None
        if self._wire_fraction >= 1.0 or not self.config.allow_fp16 or element_size <= 2:
            return IdentityCodec()
        return Float16Codec(self.config.value_dtype)

    def _update(
        self, bandwidth_bytes_per_s: float, dense_bytes: float, time_budget_s: float
    ) -> float:
        measured = _wire_fraction(bandwidth_bytes_per_s, dense_bytes, time_budget_s)
        current = self._wire_fraction
        band = 1.0 + self.config.hysteresis
        if current is None or not current / band <= measured <= current * band:
            snapped = self._snap_down(measured)
            if snapped != current:
                logger.debug("wire fraction %s -> %s (measured %.4g)", current, snapped, measured)
            self._wire_fraction = snapped
        return self._wire_fraction

    def _snap_down(self, wire_fraction: float) -> float:
        if wire_fraction >= 1.0:
            return 1.0
        if wire_fraction <= 0.0:
            return 0.0
        steps = math.ceil(-math.log2(wire_fraction) * self.config.levels_per_octave - 1e-9)
        return 2.0 ** (-steps / self.config.levels_per_octave)
