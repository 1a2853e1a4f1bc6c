"""Tensor codecs, the AdaTopK policy and the wire frame.

- frame.py:    ``pack_tensor`` / ``unpack_tensor``, the versioned msgpack frame;
               ``parse_frame`` / ``decode_frame``, the same in two halves (check, allocate)
- codecs.py:   ``IdentityCodec``, ``Float16Codec``, ``TopKCodec``, ``TernaryCodec`` (encode,
               validating decode)
- topk.py:     exact top-k selection faster than torch.topk on CPU; index bitmaps
- feedback.py: ``ErrorFeedback``, residuals for compressed gradients
- adaptive.py: ``AdaTopK`` (per-link ratio with hysteresis), ``target_ratio`` (pure),
               ``budget_codec`` / ``activation_codec`` (how a tensor spends a
               top-k ratio's bytes)
- limits.py:   ``FrameLimits``, what a receiver accepts
- dtypes.py:   the dtypes allowed on the wire
"""

from fusionllm.common.errors import FrameError
from fusionllm.compression.adaptive import (
    AdaTopK,
    AdaTopKConfig,
    activation_codec,
    budget_codec,
    target_ratio,
    ternary_group_for,
    ternary_wire_bytes,
    topk_wire_bytes,
)
from fusionllm.compression.codecs import (
    Codec,
    Float16Codec,
    IdentityCodec,
    TernaryCodec,
    TopKCodec,
)
from fusionllm.compression.feedback import ErrorFeedback
from fusionllm.compression.frame import (
    FRAME_VERSION,
    ParsedFrame,
    decode_frame,
    pack_tensor,
    parse_frame,
    unpack_tensor,
)
from fusionllm.compression.limits import DEFAULT_LIMITS, FrameLimits
from fusionllm.compression.topk import select_topk, topk_count

__all__ = [
    "DEFAULT_LIMITS",
    "FRAME_VERSION",
    "AdaTopK",
    "AdaTopKConfig",
    "Codec",
    "ErrorFeedback",
    "Float16Codec",
    "FrameError",
    "FrameLimits",
    "IdentityCodec",
    "ParsedFrame",
    "TernaryCodec",
    "TopKCodec",
    "activation_codec",
    "budget_codec",
    "decode_frame",
    "pack_tensor",
    "parse_frame",
    "select_topk",
    "target_ratio",
    "ternary_group_for",
    "ternary_wire_bytes",
    "topk_count",
    "topk_wire_bytes",
    "unpack_tensor",
]
