"""The wire frame of one tensor: a versioned msgpack map, validated before anything is allocated.

    {"v": 1, "c": codec id, "dt": dtype name, "sh": [dims...], <codec fields, payloads as bin>}

The decoded tensor always has the sender's dtype and shape; codecs only change what travels.
"""

import math
from typing import Any

import msgpack
import torch

from fusionllm.common.errors import FrameError
from fusionllm.compression.codecs import CODECS, Codec, DecodeTarget, IdentityCodec, is_int
from fusionllm.compression.dtypes import dtype_from_wire, wire_name
from fusionllm.compression.limits import DEFAULT_LIMITS, FrameLimits

FRAME_VERSION = 1
_MAX_FRAME_KEYS = 16
_MAX_STR_LEN = 32


def pack_tensor(tensor: torch.Tensor, codec: Codec | None = None) -> bytes:
    """One frame for ``tensor`` (any device, shape and wire dtype), compressed by ``codec``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"pack_tensor takes a torch.Tensor, got {type(tensor).__name__}")
    codec = codec if codec is not None else IdentityCodec()
    tensor = tensor.detach().contiguous()
    frame = frame_header(tensor, codec)
    frame.update(codec.encode(tensor))
    return msgpack.packb(frame, use_bin_type=True)


def frame_header(tensor: torch.Tensor, codec: Codec) -> dict[str, Any]:
    """The fields every frame carries; the codec adds its own."""
    return {
        "v": FRAME_VERSION,
        "c": codec.codec_id,
        "dt": wire_name(tensor.dtype),
        "sh": list(tensor.shape),
    }


def unpack_tensor(
    data: bytes | bytearray | memoryview,
    *,
    limits: FrameLimits | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The tensor in a frame from a peer, on ``device`` (CPU by default).

    Raises FrameError for anything malformed or over ``limits``; never another exception type.
    """
    limits = limits if limits is not None else DEFAULT_LIMITS
    frame = _parse(data, limits)
    codec = _codec_of(frame)
    target = _target_of(frame, limits, torch.device(device) if device is not None else None)
    codec.check_keys(frame)
    try:
        return codec.decode(frame, target, limits)
    except FrameError:
        raise
    except (ValueError, TypeError, RuntimeError, IndexError, OverflowError) as exc:
        # A check we missed must still surface as the peer's fault, not crash the caller.
        raise FrameError(f"{codec.codec_id} frame failed to decode: {exc}") from exc


def _parse(data: object, limits: FrameLimits) -> dict[str, Any]:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise FrameError(f"a frame must be bytes, got {type(data).__name__}")
    if len(data) > limits.max_frame_bytes:
        raise FrameError(f"frame of {len(data)} bytes exceeds {limits.max_frame_bytes}")
    try:
        frame = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=_MAX_STR_LEN,
            max_bin_len=limits.max_frame_bytes,
            max_array_len=limits.max_rank,
            max_map_len=_MAX_FRAME_KEYS,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types for bad input; all mean the same here
        raise FrameError(f"not a valid msgpack frame: {type(exc).__name__}: {exc}") from exc
    if not isinstance(frame, dict):
        raise FrameError(f"a frame must be a msgpack map, got {type(frame).__name__}")
    version = frame.get("v")
    if version != FRAME_VERSION or not is_int(version):
        raise FrameError(f"unsupported frame version {version!r}; this node speaks {FRAME_VERSION}")
    return frame


def _codec_of(frame: dict[str, Any]) -> type[Codec]:
    codec_id = frame.get("c")
    codec = CODECS.get(codec_id) if isinstance(codec_id, str) else None
    if codec is None:
        raise FrameError(f"unknown codec {codec_id!r}; known: {sorted(CODECS)}")
    return codec


def _target_of(
    frame: dict[str, Any], limits: FrameLimits, device: torch.device | None
) -> DecodeTarget:
    dtype = dtype_from_wire(frame.get("dt"), limits.allowed_dtypes)
    shape = frame.get("sh")
    if not isinstance(shape, list) or len(shape) > limits.max_rank:
        raise FrameError(f"shape must be a list of at most {limits.max_rank} dims, got {shape!r}")
    if not all(is_int(dim) and dim >= 0 for dim in shape):
        raise FrameError(f"shape dims must be non-negative integers, got {shape!r}")
    numel = math.prod(shape)
    if numel > limits.max_elements:
        raise FrameError(f"tensor of {numel} elements exceeds the limit of {limits.max_elements}")
    return DecodeTarget(
        shape=tuple(shape), numel=numel, dtype=dtype, device=device or torch.device("cpu")
    )
