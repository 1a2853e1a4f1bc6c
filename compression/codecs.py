"""Codecs: how one tensor's values become msgpack fields, and back, validating every field.

- IdentityCodec: the raw bytes, any wire dtype.
- Float16Codec:  floats cast to float16 or bfloat16, restored to their dtype on decode.
- TopKCodec:     exactly k = ceil(ratio * numel) largest magnitudes, values in fp16/bf16,
                 positions as int32 indices or a bitmap, whichever is smaller.
- TernaryCodec:  every element as -a, 0 or +a, one scale a (fp16/bf16) per group of
                 consecutive elements, five symbols per byte (1.6 bits per element).

A codec's ``encode`` returns the fields it adds to the frame; its class-level ``decode`` gets
the frame map (common fields already checked by frame.py) and must validate before it allocates.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from fusionllm.common.errors import FrameError, peer_repr
from fusionllm.compression.dtypes import (
    FLOAT16_MAX,
    FLOAT_DTYPES,
    HALF_DTYPES,
    dtype_from_wire,
    wire_name,
)
from fusionllm.compression.half_scale import check_exponent, scaled_half
from fusionllm.compression.limits import FrameLimits
from fusionllm.compression.payload import (
    check_finite,
    from_half,
    payload_view,
    tensor_bytes,
    tensor_from_bytes,
)
from fusionllm.compression.topk import (
    bitmap_popcount,
    bitmap_to_mask,
    indices_to_bitmap,
    select_topk,
)
from fusionllm.compression.wire_sizes import (
    _TRITS_PER_BYTE,
    bitmap_bytes,
    ternary_bytes,
    ternary_groups,
    topk_count,
)

COMMON_KEYS = frozenset({"v", "c", "dt", "sh"})
_HALF_NAMES = frozenset(wire_name(d) for d in HALF_DTYPES)
_NUMPY_FLOATS = frozenset({torch.float32, torch.float64, torch.float16})
_INDEX_INT32 = "i32"
_INDEX_BITMAP = "bm"


@dataclass(frozen=True)
class DecodeTarget:
    """What the common frame fields promise: the decoded tensor's shape, dtype and device."""

    shape: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    device: torch.device
    # A host tensor in page-locked memory (a CUDA node's frames): its one host-to-device copy
    # then runs without a staging copy (compute.Staging). False on CPU-only machines.
    pin_memory: bool = False


class Codec(ABC):
    codec_id: ClassVar[str]
    field_keys: ClassVar[frozenset[str]]

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> dict[str, Any]:
        """The codec's frame fields for a contiguous, detached tensor (any device)."""

    @abstractmethod
    def encode_with_residual(self, tensor: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        """The fields, and ``tensor`` minus what the receiver will decode (for error feedback)."""

    @classmethod
    @abstractmethod
    def decode(
        cls, frame: dict[str, Any], target: DecodeTarget, limits: FrameLimits
    ) -> torch.Tensor:
        """The tensor a validated frame describes; FrameError on anything inconsistent."""

    @classmethod
    def check_keys(cls, frame: dict[str, Any]) -> None:
        expected = COMMON_KEYS | cls.field_keys
        if frame.keys() != expected:
            raise FrameError(
                f"{cls.codec_id} frame has keys {sorted(frame)}, expected {sorted(expected)}"
            )


@dataclass(frozen=True)
class IdentityCodec(Codec):
    codec_id: ClassVar[str] = "id"
    field_keys: ClassVar[frozenset[str]] = frozenset({"p"})

    def encode(self, tensor: torch.Tensor) -> dict[str, Any]:
        return {"p": tensor_bytes(tensor)}

    def encode_with_residual(self, tensor: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        return self.encode(tensor), torch.zeros_like(tensor)

    @classmethod
    def decode(
        cls, frame: dict[str, Any], target: DecodeTarget, limits: FrameLimits
    ) -> torch.Tensor:
        flat = tensor_from_bytes(
            frame["p"], target.dtype, target.numel, "payload", pin_memory=target.pin_memory
        )
        if target.dtype == torch.bool and target.numel and int(flat.view(torch.uint8).max()) > 1:
            raise FrameError("bool payload holds bytes other than 0 and 1")
        check_finite(flat, limits)
        return flat.view(target.shape).to(target.device)


@dataclass(frozen=True)
class Float16Codec(Codec):
    """Halves the bytes of a float tensor: float16 with a power-of-two scale per tensor
    (half_scale.py: float16's precision, the tensor's range), or bfloat16 (float32's range).

    A float16 frame whose values do not fit even scaled (non-finite, or beyond float32's
    range from a float64 input) goes as bfloat16 instead; ``e`` is 0 for bfloat16.
    """

    dtype: torch.dtype = torch.float16
    codec_id: ClassVar[str] = "f16"
    field_keys: ClassVar[frozenset[str]] = frozenset({"wd", "e", "p"})

    def __post_init__(self) -> None:
        if self.dtype not in HALF_DTYPES:
            raise ValueError(f"Float16Codec dtype must be float16 or bfloat16, got {self.dtype}")

    def encode(self, tensor: torch.Tensor) -> dict[str, Any]:
        return self._encode(tensor)[0]

    def encode_with_residual(self, tensor: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        fields, wire, exponent = self._encode(tensor)
        return fields, tensor - from_half(wire, exponent, tensor.dtype)

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor, int]:
        require_float(tensor, self)
        scaled = scaled_half(tensor) if self.dtype == torch.float16 else None
        if scaled is not None:
            wire, exponent = scaled
        else:
            wire, exponent = tensor.to(torch.bfloat16), 0
            if wire.numel() and not bool(torch.isfinite(wire).all()):
                raise ValueError("tensor is not finite as bfloat16 (non-finite input)")
        return {"wd": wire_name(wire.dtype), "e": exponent, "p": tensor_bytes(wire)}, wire, exponent

    @classmethod
    def decode(
        cls, frame: dict[str, Any], target: DecodeTarget, limits: FrameLimits
    ) -> torch.Tensor:
        require_float_target(target, cls.codec_id)
        wire_dtype = dtype_from_wire(frame["wd"], _HALF_NAMES)
        exponent = check_exponent(frame["e"])
        wire = payload_view(frame["p"], wire_dtype, target.numel, "payload")
        flat = from_half(wire, exponent, target.dtype, pin_memory=target.pin_memory)
        check_finite(flat, limits)  # inf in the payload, or a scale that overflows the dtype
        return flat.view(target.shape).to(target.device)


@dataclass(frozen=True)
class TopKCodec(Codec):
    """Keeps exactly ceil(ratio * numel) entries of largest magnitude; the rest decode as 0."""

    ratio: float
    value_dtype: torch.dtype = torch.float16
    codec_id: ClassVar[str] = "topk"
    field_keys: ClassVar[frozenset[str]] = frozenset({"wd", "k", "ix", "p", "ixp"})

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"TopKCodec ratio must be in (0, 1], got {self.ratio}")
        if self.value_dtype not in HALF_DTYPES:
            raise ValueError(f"value_dtype must be float16 or bfloat16, got {self.value_dtype}")

    def encode(self, tensor: torch.Tensor) -> dict[str, Any]:
        return self._encode(tensor)[0]

    def encode_with_residual(self, tensor: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        fields, indices, sent_values = self._encode(tensor)
        residual = tensor.clone()
        flat_residual = residual.view(-1)  # (N,)
        flat_residual[indices] -= sent_values.to(tensor.dtype)
        return fields, residual

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
        require_float(tensor, self)
        flat = tensor.reshape(-1)  # (N,)
        numel = flat.numel()
        k = topk_count(numel, self.ratio)
        indices = select_topk(flat, k)  # (k,) int64, ascending
        values = flat[indices]  # (k,)
        if k and not bool(torch.isfinite(values).all()):
            raise ValueError("TopKCodec input holds non-finite values among its largest entries")
        value_dtype = self._value_dtype_for(tensor.dtype, values)
        if 4 * k <= bitmap_bytes(numel) and numel < 2**31:
            index_format, index_payload = _INDEX_INT32, indices.to(torch.int32)
        else:
            index_format, index_payload = _INDEX_BITMAP, indices_to_bitmap(indices, numel)
        sent_values = values.to(value_dtype)  # (k,)
        fields = {
            "wd": wire_name(value_dtype),
            "k": k,
            "ix": index_format,
            "p": tensor_bytes(sent_values),
            "ixp": tensor_bytes(index_payload),
        }
        return fields, indices, sent_values

    def _value_dtype_for(self, input_dtype: torch.dtype, values: torch.Tensor) -> torch.dtype:
        return _half_dtype_for(self.value_dtype, input_dtype, values)

    @classmethod
    def decode(
        cls, frame: dict[str, Any], target: DecodeTarget, limits: FrameLimits
    ) -> torch.Tensor:
        require_float_target(target, cls.codec_id)
        value_dtype = dtype_from_wire(frame["wd"], _HALF_NAMES)
        k = frame["k"]
        if not is_int(k) or not 0 <= k <= target.numel:
            raise FrameError(f"top-k count {peer_repr(k)} outside [0, {target.numel}]")
        values = tensor_from_bytes(frame["p"], value_dtype, k, "top-k values")
        check_finite(values, limits)
        index_format = frame["ix"]
        out = torch.zeros(
            target.numel, dtype=target.dtype, device=target.device, pin_memory=target.pin_memory
        )  # (N,)
        values = values.to(device=target.device, dtype=target.dtype)
        if index_format == _INDEX_INT32:
            indices = tensor_from_bytes(frame["ixp"], torch.int32, k, "top-k indices")
            _check_strictly_increasing_in_range(indices, target.numel)
            out.index_copy_(0, indices.to(device=target.device, dtype=torch.int64), values)
        elif index_format == _INDEX_BITMAP:
            mask = _mask_from_bitmap(frame["ixp"], target.numel, k)
            # The popcount check made k == len(values) the number of set bits.
            if out.device.type == "cpu" and out.dtype in _NUMPY_FLOATS:
                # np.place fills in mask order at copy speed; masked_scatter_ took twice as long.
                np.place(out.numpy(), mask.numpy(), values.numpy())
            else:
                out.masked_scatter_(mask.to(target.device), values)
        else:
            raise FrameError(f"unknown top-k index format {peer_repr(index_format)}")
        return out.view(target.shape)


def _half_dtype_for(
    preferred: torch.dtype, input_dtype: torch.dtype, values: torch.Tensor
) -> torch.dtype:
    # float16 would turn large values into inf, which receivers refuse.
    if preferred == torch.float16 and (
        input_dtype == torch.bfloat16
        or (values.numel() and float(values.abs().max()) > FLOAT16_MAX)
    ):
        return torch.bfloat16
    return preferred


def _check_strictly_increasing_in_range(indices: torch.Tensor, numel: int) -> None:
    if indices.numel() == 0:
        return
    if int(indices[0]) < 0 or int(indices[-1]) >= numel:
        raise FrameError(f"top-k index outside [0, {numel})")
    if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise FrameError("top-k indices are not strictly increasing")


def _mask_from_bitmap(payload: object, numel: int, k: int) -> torch.Tensor:
    """The bool mask (numel,) of a peer's bitmap, which must mark exactly k entries."""
    bitmap = tensor_from_bytes(payload, torch.uint8, bitmap_bytes(numel), "top-k bitmap")
    spare_bits = (-numel) % 8
    if spare_bits and int(bitmap[-1]) >> (8 - spare_bits):
        raise FrameError("top-k bitmap has bits set past the end of the tensor")
    marked = bitmap_popcount(bitmap)
    if marked != k:
        raise FrameError(f"top-k bitmap marks {marked} entries, frame says {k}")
    return bitmap_to_mask(bitmap, numel)


_TRIT_WEIGHTS = torch.tensor([3**i for i in range(_TRITS_PER_BYTE)], dtype=torch.int32)
# Byte -> its five base-3 digits, least significant first: (243, 5) uint8.
_TRIT_TABLE = (torch.arange(3**_TRITS_PER_BYTE).unsqueeze(1) // _TRIT_WEIGHTS % 3).to(torch.uint8)
# Lloyd-Max rounds for each group's scale. The first guess, 1.5 x the mean magnitude, is the
# optimum for Gaussian data (a = 1.224 sigma, mean |x| = 0.798 sigma); the rounds fit it to the
# group's real distribution (heavier tails raise it). Three rounds get the error within 1% of
# converged on the activations we measured.
_TERNARY_ROUNDS = 3
_TERNARY_FIRST_GUESS = 1.5


@dataclass(frozen=True)
class TernaryCodec(Codec):
    """Every element as -a, 0 or +a; a per group of ``group`` consecutive elements.

    Top-k spends its bytes on a few exact values and drops the rest, which for an activation
    (no error feedback: every micro-batch is new data) loses nearly all of it: a 5% top-k of a
    GPT-2 residual stream leaves ~88% of its norm behind, a ternary code of the same bytes ~38%.
    Per group, ``a`` and the threshold ``a / 2`` are the Lloyd-Max pair for that group's
    magnitudes, so the code minimises the squared error among symmetric three-level codes.

    Wire: ``s`` = ceil(numel / group) scales (fp16, bf16 for bf16 input or scales past fp16's
    range), ``t`` = ceil(numel / 5) bytes, each five symbols (0: -a, 1: 0, 2: +a) in base 3,
    least significant first; the digits past ``numel`` in the last byte are 0.
    """

    group: int
    value_dtype: torch.dtype = torch.float16
    codec_id: ClassVar[str] = "tern"
    field_keys: ClassVar[frozenset[str]] = frozenset({"wd", "g", "s", "t"})

    def __post_init__(self) -> None:
        if not is_int(self.group) or self.group < 1:
            raise ValueError(f"TernaryCodec group must be an integer >= 1, got {self.group!r}")
        if self.value_dtype not in HALF_DTYPES:
            raise ValueError(f"value_dtype must be float16 or bfloat16, got {self.value_dtype}")

    def encode(self, tensor: torch.Tensor) -> dict[str, Any]:
        return self._encode(tensor)[0]

    def encode_with_residual(self, tensor: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        fields, decoded = self._encode(tensor)
        return fields, tensor - decoded.view(tensor.shape).to(tensor.dtype)

    def _encode(self, tensor: torch.Tensor) -> tuple[dict[str, Any], torch.Tensor]:
        """The fields, and the flat tensor (N,) the receiver will decode (float32 or float64)."""
        require_float(tensor, self)
        flat = tensor.reshape(-1)  # (N,)
        if flat.dtype != torch.float64:
            flat = flat.float()
        numel = flat.numel()
        if numel and not bool(torch.isfinite(flat).all()):
            raise ValueError("TernaryCodec input holds non-finite values")
        # A group past the tensor's end means one group; the frame names the canonical size.
        group = min(self.group, max(numel, 1))
        groups = ternary_groups(numel, group)
        # Zero padding leaves every group's sums intact; counts exclude it.
        magnitudes = flat.abs()
        padded = torch.zeros(groups * group, dtype=flat.dtype, device=flat.device)
        padded[:numel] = magnitudes
        grouped = padded.view(groups, group)  # (G, g)
        counts = torch.full((groups,), float(group), dtype=flat.dtype, device=flat.device)
        if groups:
            counts[-1] = numel - (groups - 1) * group
        scale = _TERNARY_FIRST_GUESS * grouped.sum(1) / counts  # (G,)
        for _ in range(_TERNARY_ROUNDS):
            kept = grouped >= (scale / 2).unsqueeze(1)  # (G, g)
            scale = (grouped * kept).sum(1) / kept.sum(1).clamp(min=1)
        scale_dtype = _half_dtype_for(self.value_dtype, tensor.dtype, scale)
        wire_scale = scale.to(scale_dtype)  # (G,)
        exact_scale = wire_scale.to(flat.dtype)
        # Threshold on the scale the receiver gets, so the symbols match what it decodes.
        kept = grouped >= (exact_scale / 2).unsqueeze(1)  # (G, g)
        symbols = (torch.sign(flat) * kept.view(-1)[:numel]).to(torch.int8)  # (N,) in {-1, 0, 1}
        decoded = symbols.to(flat.dtype) * exact_scale.repeat_interleave(group)[:numel]
        fields = {
            "wd": wire_name(scale_dtype),
            "g": group,
            "s": tensor_bytes(wire_scale),
            "t": tensor_bytes(_pack_trits(symbols)),
        }
        return fields, decoded

    @classmethod
    def decode(
        cls, frame: dict[str, Any], target: DecodeTarget, limits: FrameLimits
    ) -> torch.Tensor:
        require_float_target(target, cls.codec_id)
        scale_dtype = dtype_from_wire(frame["wd"], _HALF_NAMES)
        group, numel = frame["g"], target.numel
        if not is_int(group) or not 1 <= group <= max(numel, 1):
            raise FrameError(f"ternary group {peer_repr(group)} outside [1, {max(numel, 1)}]")
        groups = ternary_groups(numel, group)
        scales = tensor_from_bytes(frame["s"], scale_dtype, groups, "ternary scales")
        check_finite(scales, limits)
        if groups and not float(scales.min()) >= 0:
            raise FrameError("ternary scales must be >= 0")
        packed = tensor_from_bytes(frame["t"], torch.uint8, ternary_bytes(numel), "ternary symbols")
        symbols = _unpack_trits(packed, numel)  # (N,) int8 in {-1, 0, 1}
        padded = torch.zeros(groups * group, dtype=scales.dtype)
        padded[:numel] = symbols
        out = padded.view(groups, group).mul_(scales.unsqueeze(1)).view(-1)[:numel]  # (N,)
        return out.view(target.shape).to(device=target.device, dtype=target.dtype)


def _pack_trits(symbols: torch.Tensor) -> torch.Tensor:
    """(N,) int8 in {-1, 0, 1} -> (ceil(N / 5),) uint8, base 3, least significant first."""
    numel = symbols.numel()
    digits = torch.zeros(ternary_bytes(numel) * _TRITS_PER_BYTE, dtype=torch.uint8)
    digits[:numel] = symbols.cpu().view(torch.uint8) + 1  # -1 is 255, wraps to 0
    digits = digits.view(-1, _TRITS_PER_BYTE)  # (M, 5)
    # uint8 throughout: the largest sum is 242 (int32 products took 4x the time and memory).
    packed = digits[:, 4].clone()
    for position in range(_TRITS_PER_BYTE - 2, -1, -1):
        packed.mul_(3).add_(digits[:, position])
    return packed


def _unpack_trits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """A peer's packed symbols -> (numel,) int8 in {-1, 0, 1}; FrameError if not canonical."""
    if packed.numel() == 0:
        return torch.empty(0, dtype=torch.int8)
    if int(packed.max()) >= 3**_TRITS_PER_BYTE:
        raise FrameError("ternary byte above 242 (five base-3 digits)")
    tail = numel % _TRITS_PER_BYTE
    if tail and int(packed[-1]) >= 3**tail:
        raise FrameError("ternary symbols set past the end of the tensor")
    digits = _TRIT_TABLE[packed.long()].view(-1)[:numel]  # (N,) uint8 in {0, 1, 2}
    return digits.to(torch.int8) - 1


CODECS: dict[str, type[Codec]] = {
    codec.codec_id: codec for codec in (IdentityCodec, Float16Codec, TopKCodec, TernaryCodec)
}


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require_float(tensor: torch.Tensor, codec: Codec) -> None:
    if tensor.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{type(codec).__name__} needs a float tensor, got {tensor.dtype}")


def require_float_target(target: DecodeTarget, codec_id: str) -> None:
    if target.dtype not in FLOAT_DTYPES:
        raise FrameError(f"codec {codec_id!r} cannot decode to {target.dtype}")
