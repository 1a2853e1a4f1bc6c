"""How many bytes a codec's frame of a tensor takes, and the AdaTopK ratio rule: arithmetic only.

The planner and the plan audit (the control plane) price links with these; they import no
torch, so a node that only agrees on plans never loads it. The codecs (codecs.py, topk.py) and
the stateful policy (adaptive.py) use the same functions, so what is priced is what is sent.
"""

import math

_TRITS_PER_BYTE = 5  # 3**5 = 243 <= 256

_VALUE_BYTES = 2  # top-k values travel as fp16/bf16
_INDEX_BYTES = 4  # int32 indices, unless a bitmap (1 bit per element) is smaller
_BITMAP_BYTES_PER_ELEMENT = 1 / 8
# A top-k ratio is always below 1.0, which means "dense": keeping (nearly) every element in
# fp16 + bitmap still costs about half of fp32's bytes, so it can fit where dense cannot.
_MAX_TOPK_RATIO = 0.99


def topk_wire_bytes(numel: int, ratio: float) -> int:
    """Payload bytes of a TopKCodec frame of ``numel`` elements (frame header not counted)."""
    k = topk_count(numel, ratio)
    return _VALUE_BYTES * k + min(_INDEX_BYTES * k, bitmap_bytes(numel))


def ternary_wire_bytes(numel: int, group: int) -> int:
    """Payload bytes of a TernaryCodec frame (frame header not counted)."""
    group = min(group, max(numel, 1))
    return ternary_bytes(numel) + _VALUE_BYTES * ternary_groups(numel, group)


def ternary_group_for(numel: int, ratio: float) -> int | None:
    """Smallest TernaryCodec group whose frame fits top-k's bytes at ``ratio``; None if none."""
    scales = (topk_wire_bytes(numel, ratio) - ternary_bytes(numel)) // _VALUE_BYTES
    if numel == 0:
        return 1
    if scales < 1:
        return None
    return -(-numel // scales)


def topk_count(numel: int, ratio: float) -> int:
    """k = ceil(ratio * numel), at least 1 for a non-empty tensor, at most numel."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    if numel == 0:
        return 0
    return min(numel, max(1, math.ceil(ratio * numel)))


def bitmap_bytes(numel: int) -> int:
    return (numel + 7) // 8


def ternary_groups(numel: int, group: int) -> int:
    return -(-numel // group)


def ternary_bytes(numel: int) -> int:
    """Bytes of ``numel`` packed ternary symbols."""
    return -(-numel // _TRITS_PER_BYTE)


def _topk_ratio_for_bytes_per_element(budget: float) -> float:
    """Largest kept fraction whose top-k wire bytes per tensor element fit ``budget``."""
    with_indices = budget / (_VALUE_BYTES + _INDEX_BYTES)
    if _INDEX_BYTES * with_indices <= _BITMAP_BYTES_PER_ELEMENT:
        return with_indices
    return (budget - _BITMAP_BYTES_PER_ELEMENT) / _VALUE_BYTES


def ratio_for_wire_fraction(
    wire_fraction: float, *, element_size: int, min_ratio: float, allow_fp16: bool
) -> float:
    """Kept fraction for a link allowed ``wire_fraction`` of the dense bytes; 1.0 = dense."""
    if wire_fraction >= 1.0 or (allow_fp16 and wire_fraction * element_size >= _VALUE_BYTES):
        return 1.0
    ratio = _topk_ratio_for_bytes_per_element(wire_fraction * element_size)
    return min(_MAX_TOPK_RATIO, max(min_ratio, ratio))


def target_ratio(
    bandwidth_bytes_per_s: float,
    dense_bytes: float,
    time_budget_s: float,
    *,
    min_ratio: float = 0.001,
    element_size: int = 4,
    allow_fp16: bool = True,
) -> float:
    """The pure AdaTopK rule: fraction of elements to send so the transfer fits the budget.

    1.0 means dense (float16 if that is what fits and ``allow_fp16``); otherwise the top-k ratio,
    clamped to [min_ratio, 0.99].
    """
    wire_fraction = _wire_fraction(bandwidth_bytes_per_s, dense_bytes, time_budget_s)
    return ratio_for_wire_fraction(
        wire_fraction, element_size=element_size, min_ratio=min_ratio, allow_fp16=allow_fp16
    )


def _wire_fraction(bandwidth_bytes_per_s: float, dense_bytes: float, time_budget_s: float) -> float:
    for name, value in (
        ("bandwidth_bytes_per_s", bandwidth_bytes_per_s),
        ("dense_bytes", dense_bytes),
        ("time_budget_s", time_budget_s),
    ):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be finite and >= 0, got {value}")
    if dense_bytes == 0:
        return 1.0
    return bandwidth_bytes_per_s * time_budget_s / dense_bytes
