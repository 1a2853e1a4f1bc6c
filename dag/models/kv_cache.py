"""Past keys and values of one sequence in the decoder blocks a serving stage holds.

Preallocated for the session's whole length (prompt plus new tokens), so its bytes are known
when the session opens: a server admits or refuses a session on that number, and a sequence
never grows past what it was admitted for (``CacheFullError``).
"""

from dataclasses import dataclass

import torch

from fusionllm.common.errors import ConfigError


class CacheFullError(ConfigError):
    """More positions were asked of a cache than it was made for."""


@dataclass(frozen=True, kw_only=True)
class CacheShape:
    """What one block's cache holds: key/value heads, their width, and how many positions."""

    layers: int
    kv_heads: int
    head_dim: int
    max_len: int

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0 or (name != "layers" and value < 1):
                raise ConfigError(f"CacheShape.{name} must be a positive int, got {value!r}")

    def nbytes(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.max_len * self.head_dim * element


class KVCache:
    """Keys and values (1, kv_heads, max_len, head_dim) per layer; ``length`` positions filled."""

    def __init__(self, shape: CacheShape, *, dtype: torch.dtype, device: torch.device | str):
        size = (1, shape.kv_heads, shape.max_len, shape.head_dim)
        self.shape = shape
        self.keys = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.layers)]
        self.values = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.layers)]
        self.length = 0
        self.nbytes = shape.nbytes(dtype)

    def check_room(self, new: int) -> None:
        if new < 1 or self.length + new > self.shape.max_len:
            raise CacheFullError(
                f"{new} new positions after {self.length} do not fit a cache of "
                f"{self.shape.max_len}"
            )

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Store k, v (1, kv_heads, T, hd) after the filled positions; all keys and values so
        far (1, kv_heads, length + T, hd). ``advance`` moves ``length`` once every layer ran."""
        end = self.length + k.shape[-2]
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, new: int) -> None:
        self.length += new
