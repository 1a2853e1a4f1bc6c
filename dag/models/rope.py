"""Rotary position embeddings: the settings (``RopeConfig``) and their inverse frequencies.

``inverse_frequencies`` computes, op for op, what Hugging Face's rope initialisers compute for
the kinds we support ("default", "linear", "llama3"), so logits match theirs in fp32. Kinds
whose tables depend on the sequence length at run time ("dynamic", "longrope") or that scale
the attention ("yarn") are refused rather than approximated.
"""

import math
from dataclasses import dataclass

import torch

from fusionllm.common.errors import ConfigError

ROPE_KINDS = ("default", "linear", "llama3")


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """One model's rotary settings; ``kind`` names Hugging Face's ``rope_type``."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0  # linear, llama3: how much longer the context is than trained
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ConfigError(f"rope type {self.kind!r} is not supported; use one of {ROPE_KINDS}")
        numbers = (self.theta, self.factor, self.low_freq_factor, self.high_freq_factor)
        if not all(isinstance(x, int | float) and math.isfinite(x) and x > 0 for x in numbers):
            raise ConfigError(
                f"rope theta, factor and frequency factors must be finite and > 0, got {numbers}"
            )
        if self.kind == "llama3" and not self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(
                f"llama3 rope needs low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.original_max_position_embeddings < 1:
            raise ConfigError(
                "rope original_max_position_embeddings must be >= 1, got "
                f"{self.original_max_position_embeddings}"
            )


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """(head_dim // 2,) float32 on the CPU, whatever the default device (meta included)."""
    if head_dim < 2 or head_dim % 2:
        raise ConfigError(f"rotary embeddings need an even head_dim >= 2, got {head_dim}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)  # (head_dim / 2,)
    if rope.kind == "linear":
        # Dividing the frequencies is dividing the positions by the factor.
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3(inv_freq, rope)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Long wavelengths slowed by ``factor``, short ones kept, a smooth ramp between."""
    context = rope.original_max_position_embeddings
    low_freq_wavelen = context / rope.low_freq_factor
    high_freq_wavelen = context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)
