"""The wire frame of one tensor: a versioned msgpack map, validated before anything is allocated.

    {"v": 1, "c": codec id, "dt": dtype name, "sh": [dims...], <codec fields, payloads as bin>}

The decoded tensor always has the sender's dtype and shape; codecs only change what travels.
"""

import math
import struct
from dataclasses import dataclass, replace
from typing import Any

import msgpack
import torch

from fusionllm.common.errors import FrameError, peer_repr
from fusionllm.compression.codecs import (
    CODECS,
    Codec,
    DecodeTarget,
    Float16Codec,
    IdentityCodec,
    is_int,
)
from fusionllm.compression.dtypes import dtype_from_wire, wire_name
from fusionllm.compression.limits import DEFAULT_LIMITS, FrameLimits

FRAME_VERSION = 1
_MAX_FRAME_KEYS = 16
_MAX_STR_LEN = 32
_FRAME_OVERHEAD_BYTES = 512


def pack_tensor(tensor: torch.Tensor, codec: Codec | None = None) -> bytes:
    """One frame for ``tensor`` (any device, shape and wire dtype), compressed by ``codec``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"pack_tensor takes a torch.Tensor, got {type(tensor).__name__}")
    codec = codec if codec is not None else IdentityCodec()
    tensor = tensor.detach().contiguous()
    frame = frame_header(tensor, codec)
    frame.update(codec.encode(tensor))
    return msgpack.packb(frame, use_bin_type=True)


def max_encoded_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """The most bytes any codec's frame of a tensor of this dtype and shape can take.

    Lets a receiver that knows what it expects refuse a longer body before reading it.
    Dense: numel x itemsize. Half-precision codecs spend at most 2 bytes per element on
    values plus 1/8 (top-k bitmap, int32 indices only when smaller) or 1/5 (ternary symbols)
    on positions: under 2.25 bytes per element. Map keys, strs and dims: well under 512.
    """
    if any(dim < 0 for dim in shape):
        return 0
    numel = math.prod(shape)
    return math.ceil(numel * max(dtype.itemsize, 2.25)) + _FRAME_OVERHEAD_BYTES + 9 * len(shape)


def frame_header(tensor: torch.Tensor, codec: Codec) -> dict[str, Any]:
    """The fields every frame carries; the codec adds its own."""
    return {
        "v": FRAME_VERSION,
        "c": codec.codec_id,
        "dt": wire_name(tensor.dtype),
        "sh": list(tensor.shape),
    }


@dataclass(frozen=True)
class ParsedFrame:
    """A frame whose map and common fields passed every check, nothing allocated yet.

    ``decoded_bytes`` is what decoding it will allocate (the tensor), known before it does:
    a small frame may expand to a large tensor, so callers decide where (or whether) to
    decode it from this, not from the frame's size.
    """

    fields: dict[str, Any]
    codec: type[Codec]
    target: DecodeTarget
    limits: FrameLimits

    @property
    def decoded_bytes(self) -> int:
        return self.target.numel * self.target.dtype.itemsize


def unpack_tensor(
    data: bytes | bytearray | memoryview,
    *,
    limits: FrameLimits | None = None,
    device: torch.device | str | None = None,
    expect_dtype: torch.dtype | None = None,
    expect_shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """The tensor in a frame from a peer, on ``device`` (CPU by default).

    ``expect_dtype``/``expect_shape``: what the receiver expects; a frame declaring anything
    else is refused before its tensor is allocated. Raises FrameError for anything malformed
    or over ``limits``; never another exception type.
    """
    parsed = parse_frame(
        data, limits=limits, device=device, expect_dtype=expect_dtype, expect_shape=expect_shape
    )
    return decode_frame(parsed)


def parse_frame(
    data: bytes | bytearray | memoryview,
    *,
    limits: FrameLimits | None = None,
    device: torch.device | str | None = None,
    expect_dtype: torch.dtype | None = None,
    expect_shape: tuple[int, ...] | None = None,
) -> ParsedFrame:
    """Check a peer's frame up to, not including, the allocation of its tensor.

    Cheap (no payload is copied for the frames ``pack_tensor`` writes), so a receiver can do
    it on its event loop and decode large frames elsewhere. FrameError for anything refused.
    """
    limits = limits if limits is not None else DEFAULT_LIMITS
    frame = _parse(data, limits)
    codec = _codec_of(frame)
    target = _target_of(frame, limits, torch.device(device) if device is not None else None)
    _check_expected(target, expect_dtype, expect_shape)
    codec.check_keys(frame)
    return ParsedFrame(fields=frame, codec=codec, target=target, limits=limits)


def decode_frame(parsed: ParsedFrame, *, pin_memory: bool = False) -> torch.Tensor:
    """The tensor of a parsed frame (allocates ``parsed.decoded_bytes``); FrameError only.

    ``pin_memory``: a dense frame decodes into page-locked host memory, written once from the
    payload, so a CUDA node's copy to the device needs no staging copy (compute.Staging).
    """
    codec, frame = parsed.codec, parsed.fields
    pin = pin_memory and parsed.target.device.type == "cpu"  # a device target needs no staging
    target = replace(parsed.target, pin_memory=True) if pin else parsed.target
    try:
        if codec is not IdentityCodec and codec is not Float16Codec:
            # Dense payloads are decoded straight from the receive buffer (one copy); the
            # other codecs' payloads are small and some of them want bytes.
            frame = {k: bytes(v) if isinstance(v, memoryview) else v for k, v in frame.items()}
        return codec.decode(frame, target, parsed.limits)
    except FrameError:
        raise
    except (ValueError, TypeError, RuntimeError, IndexError, OverflowError) as exc:
        # A check we missed must still surface as the peer's fault, not crash the caller.
        raise FrameError(f"{codec.codec_id} frame failed to decode: {exc}") from exc


def _check_expected(
    target: DecodeTarget, dtype: torch.dtype | None, shape: tuple[int, ...] | None
) -> None:
    if dtype is not None and target.dtype != dtype:
        raise FrameError(f"frame declares {target.dtype}, expected {dtype}")
    if shape is not None and target.shape != tuple(shape):
        raise FrameError(f"frame declares shape {list(target.shape)}, expected {list(shape)}")


def _parse(data: object, limits: FrameLimits) -> dict[str, Any]:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise FrameError(f"a frame must be bytes, got {type(data).__name__}")
    if len(data) > limits.max_frame_bytes:
        raise FrameError(f"frame of {len(data)} bytes exceeds {limits.max_frame_bytes}")
    frame = _scan(data, limits)
    if frame is None:
        frame = _unpack(data, limits)
    if not isinstance(frame, dict):
        raise FrameError(f"a frame must be a msgpack map, got {type(frame).__name__}")
    version = frame.get("v")
    if version != FRAME_VERSION or not is_int(version):
        raise FrameError(
            f"unsupported frame version {peer_repr(version)}; this node speaks {FRAME_VERSION}"
        )
    return frame


def _unpack(data: bytes | bytearray | memoryview, limits: FrameLimits) -> Any:
    try:
        return msgpack.unpackb(
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


# The fast path reads the frames pack_tensor writes without copying their payloads: msgpack
# returns every bin field as new bytes, which for a 64 MB tensor cost ~50 ms (fresh pages)
# before the payload was copied again into the tensor. It understands only a map of str keys
# to ints, short strs, None/bools, int arrays and bins; anything else (and anything malformed)
# returns None and goes to msgpack, so what it accepts, msgpack would have decoded the same way
# (bins excepted: they come back as read-only views of ``data``).
_INT_FORMATS = {
    0xCC: struct.Struct(">B"),
    0xCD: struct.Struct(">H"),
    0xCE: struct.Struct(">I"),
    0xCF: struct.Struct(">Q"),
    0xD0: struct.Struct(">b"),
    0xD1: struct.Struct(">h"),
    0xD2: struct.Struct(">i"),
    0xD3: struct.Struct(">q"),
}
_BIN_LENGTHS = {0xC4: struct.Struct(">B"), 0xC5: struct.Struct(">H"), 0xC6: struct.Struct(">I")}
_U16 = struct.Struct(">H")
_CONSTANTS = {0xC0: None, 0xC2: False, 0xC3: True}


class _NotSimpleError(Exception):
    """The frame is outside what the fast path reads; msgpack decides."""


def _scan(data: bytes | bytearray | memoryview, limits: FrameLimits) -> dict[str, Any] | None:
    try:
        view = memoryview(data).toreadonly().cast("B")
        frame, end = _scan_map(view, limits)
    except (_NotSimpleError, IndexError, struct.error, UnicodeDecodeError, TypeError):
        return None
    return frame if end == len(view) else None


def _scan_map(view: memoryview, limits: FrameLimits) -> tuple[dict[str, Any], int]:
    tag = view[0]
    if 0x80 <= tag <= 0x8F:
        count, pos = tag & 0x0F, 1
    elif tag == 0xDE:
        count, pos = _U16.unpack_from(view, 1)[0], 3
    else:
        raise _NotSimpleError
    if count > _MAX_FRAME_KEYS:
        raise _NotSimpleError
    frame: dict[str, Any] = {}
    for _ in range(count):
        key, pos = _scan_str(view, pos)
        if key in frame:  # msgpack keeps the last; let it
            raise _NotSimpleError
        frame[key], pos = _scan_value(view, pos, limits)
    return frame, pos


def _scan_str(view: memoryview, pos: int) -> tuple[str, int]:
    tag = view[pos]
    if 0xA0 <= tag <= 0xBF:
        size, pos = tag & 0x1F, pos + 1
    elif tag == 0xD9:
        size, pos = view[pos + 1], pos + 2
    else:
        raise _NotSimpleError
    if size > _MAX_STR_LEN or pos + size > len(view):
        raise _NotSimpleError
    return str(view[pos : pos + size], "utf-8"), pos + size


def _scan_int(view: memoryview, pos: int) -> tuple[int, int]:
    tag = view[pos]
    if tag <= 0x7F:
        return tag, pos + 1
    if tag >= 0xE0:
        return tag - 0x100, pos + 1
    fmt = _INT_FORMATS.get(tag)
    if fmt is None:
        raise _NotSimpleError
    return fmt.unpack_from(view, pos + 1)[0], pos + 1 + fmt.size


def _scan_value(view: memoryview, pos: int, limits: FrameLimits) -> tuple[Any, int]:
    tag = view[pos]
    if tag <= 0x7F or tag >= 0xE0 or tag in _INT_FORMATS:
        return _scan_int(view, pos)
    if 0xA0 <= tag <= 0xBF or tag == 0xD9:
        return _scan_str(view, pos)
    if tag in _CONSTANTS:
        return _CONSTANTS[tag], pos + 1
    if 0x90 <= tag <= 0x9F or tag == 0xDC:
        if tag == 0xDC:
            count, pos = _U16.unpack_from(view, pos + 1)[0], pos + 3
        else:
            count, pos = tag & 0x0F, pos + 1
        if count > limits.max_rank:
            raise _NotSimpleError
        items = []
        for _ in range(count):
            item, pos = _scan_int(view, pos)
            items.append(item)
        return items, pos
    fmt = _BIN_LENGTHS.get(tag)
    if fmt is None:
        raise _NotSimpleError
    size = fmt.unpack_from(view, pos + 1)[0]
    pos += 1 + fmt.size
    if size > limits.max_frame_bytes or pos + size > len(view):
        raise _NotSimpleError
    return view[pos : pos + size], pos + size


def _codec_of(frame: dict[str, Any]) -> type[Codec]:
    codec_id = frame.get("c")
    codec = CODECS.get(codec_id) if isinstance(codec_id, str) else None
    if codec is None:
        raise FrameError(f"unknown codec {peer_repr(codec_id)}; known: {sorted(CODECS)}")
    return codec


def _target_of(
    frame: dict[str, Any], limits: FrameLimits, device: torch.device | None
) -> DecodeTarget:
    dtype = dtype_from_wire(frame.get("dt"), limits.allowed_dtypes)
    shape = frame.get("sh")
    if not isinstance(shape, list) or len(shape) > limits.max_rank:
        raise FrameError(
            f"shape must be a list of at most {limits.max_rank} dims, got {peer_repr(shape)}"
        )
    if not all(is_int(dim) and dim >= 0 for dim in shape):
        raise FrameError(f"shape dims must be non-negative integers, got {peer_repr(shape)}")
    numel = math.prod(shape)
    if numel > limits.max_elements:
        raise FrameError(f"tensor of {numel} elements exceeds the limit of {limits.max_elements}")
    return DecodeTarget(
        shape=tuple(shape), numel=numel, dtype=dtype, device=device or torch.device("cpu")
    )
