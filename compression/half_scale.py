"""The power-of-two scale that fits a float tensor into float16's range (Float16Codec).

float16 keeps 10 mantissa bits (bfloat16: 7) but only reaches ±65504, and flushes magnitudes
below ~6e-8 to zero: gradients (loss-scaled or not) and activations routinely leave that
window. A frame therefore carries ``x * 2**e`` as float16 with one exponent ``e`` per tensor,
chosen so the largest magnitude lands in [2**14, 2**15): the largest values keep headroom
below 65504 and small ones stay as far from the subnormals as the tensor's spread allows.
A power of two scales exactly (no rounding beyond float16's own), and an integer exponent
travels in the frame's fast path (no float in the msgpack map) and is trivially bounded.
"""

import math

import torch

from fusionllm.common.errors import FrameError, peer_repr
from fusionllm.compression.dtypes import FLOAT16_MAX

# float32 can carry x * 2**e and back for any |e| <= 126 without an infinity of its own; a
# peer's exponent outside this is refused.
MAX_EXPONENT = 126
_TOP_BIT = 15  # the largest magnitude lands below 2**15 (float16's max is ~2**16)


def fit_exponent(peak: float) -> int | None:
    """``e`` with ``peak * 2**e`` in [2**14, 2**15), clamped to ±MAX_EXPONENT; 0 for a zero
    tensor; None when ``peak`` is not finite (such a tensor cannot travel as float16)."""
    if not math.isfinite(peak):
        return None
    if peak == 0.0:
        return 0
    _, k = math.frexp(peak)  # peak in [2**(k-1), 2**k)
    return max(-MAX_EXPONENT, min(MAX_EXPONENT, _TOP_BIT - k))


def check_exponent(exponent: object) -> int:
    """A peer's exponent: an int within ±MAX_EXPONENT (so 2**-e is finite and positive)."""
    if not isinstance(exponent, int) or isinstance(exponent, bool):
        raise FrameError(f"float16 scale exponent must be an integer, got {peer_repr(exponent)}")
    if not -MAX_EXPONENT <= exponent <= MAX_EXPONENT:
        raise FrameError(f"float16 scale exponent {exponent} outside ±{MAX_EXPONENT}")
    return exponent


def scaled_half(tensor: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(``tensor * 2**e`` as float16, e), or None if it holds a non-finite value or still
    overflows (an exponent clamped for float64's range)."""
    flat = tensor.reshape(-1)  # (N,)
    if flat.numel() == 0:
        return flat.to(torch.float16), 0
    low, high = torch.aminmax(flat)  # one pass, no |x| temporary; NaN propagates
    peak = max(-float(low), float(high))
    exponent = fit_exponent(peak)
    # Unclamped, the peak lands below 2**15 and rounds to at most that: only a clamped
    # exponent (a float64 input past float32's range) can still overflow.
    if exponent is None or peak * 2.0**exponent > FLOAT16_MAX:
        return None
    if exponent == 0:
        wire = flat.to(torch.float16)
    else:
        # One pass: the product is computed in the input's precision and rounded once.
        wire = torch.empty(flat.shape, dtype=torch.float16, device=flat.device)
        torch.mul(flat, 2.0**exponent, out=wire)
    return wire.view(tensor.shape), exponent
