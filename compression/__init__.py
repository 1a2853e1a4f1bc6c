"""Tensor codecs, the AdaTopK policy and the wire frame.

- frame.py:    ``pack_tensor`` / ``unpack_tensor``, the versioned msgpack frame;
               ``parse_frame`` / ``decode_frame``, the same in two halves (check, allocate)
- codecs.py:   ``IdentityCodec``, ``Float16Codec``, ``TopKCodec``, ``TernaryCodec`` (encode,
               validating decode)
- payload.py:  payload bytes <-> tensors (one copy out of a receive buffer, pinned if asked)
- half_scale.py: the power-of-two scale that fits a tensor into float16's range
- topk.py:     exact top-k selection faster than torch.topk on CPU; index bitmaps
- feedback.py: ``ErrorFeedback``, residuals for compressed gradients
- adaptive.py: ``AdaTopK`` (per-link ratio with hysteresis), ``target_ratio`` (pure),
               ``budget_codec`` / ``activation_codec`` (how a tensor spends a
               top-k ratio's bytes)
- limits.py:   ``FrameLimits``, what a receiver accepts
- dtypes.py:   the dtypes allowed on the wire
- wire_sizes.py: frame sizes and the AdaTopK ratio rule, arithmetic only (no torch)
"""

from fusionllm.common.lazy_exports import lazy_exports

# Names resolve on first use (PEP 562): the control plane prices links with wire_sizes and
# never pays for torch, which the codecs need.
_EXPORTS = {
    "FrameError": "fusionllm.common.errors",
    "AdaTopK": "fusionllm.compression.adaptive",
    "AdaTopKConfig": "fusionllm.compression.adaptive",
    "activation_codec": "fusionllm.compression.adaptive",
    "budget_codec": "fusionllm.compression.adaptive",
    "target_ratio": "fusionllm.compression.wire_sizes",
    "ternary_group_for": "fusionllm.compression.wire_sizes",
    "ternary_wire_bytes": "fusionllm.compression.wire_sizes",
    "topk_wire_bytes": "fusionllm.compression.wire_sizes",
    "topk_count": "fusionllm.compression.wire_sizes",
    "Codec": "fusionllm.compression.codecs",
    "Float16Codec": "fusionllm.compression.codecs",
    "IdentityCodec": "fusionllm.compression.codecs",
    "TernaryCodec": "fusionllm.compression.codecs",
    "TopKCodec": "fusionllm.compression.codecs",
    "ErrorFeedback": "fusionllm.compression.feedback",
    "FRAME_VERSION": "fusionllm.compression.frame",
    "ParsedFrame": "fusionllm.compression.frame",
    "decode_frame": "fusionllm.compression.frame",
    "pack_tensor": "fusionllm.compression.frame",
    "parse_frame": "fusionllm.compression.frame",
    "unpack_tensor": "fusionllm.compression.frame",
    "DEFAULT_LIMITS": "fusionllm.compression.limits",
    "FrameLimits": "fusionllm.compression.limits",
    "select_topk": "fusionllm.compression.topk",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
