"""Fuzz targets of the tensor frames and their heads, and the ``Target`` every target is (the
catalogue is fuzz_targets.py).

Each ``Target`` turns one input (bytes, plus the seed's context) into what the node would act
on, the way the node does it, and names the typed errors it may raise; anything else it
raises is an untyped error (a crash of the caller). ``check`` states what an accepted input
must satisfy. Seeds are valid inputs; ``tree`` (optional) decodes an input into a msgpack/JSON
tree and encodes it back, so the fuzzer can damage structure, not just bytes.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from fusionllm.common.errors import FrameError
from fusionllm.compression import (
    DEFAULT_LIMITS,
    Float16Codec,
    FrameLimits,
    IdentityCodec,
    TopKCodec,
    pack_tensor,
    unpack_tensor,
)
from fusionllm.compression.codecs import TernaryCodec
from fusionllm.node.p2p.framing import (
    PREFIX_BYTES,
    FrameHeader,
    FrameKind,
    encode_head,
    parse_prefix,
)

SMALL_LIMITS = FrameLimits(max_elements=1 << 16)
MAX_BODY_BYTES = 1 << 26


@dataclass
class Target:
    name: str
    seeds: list[tuple[bytes, Any]]  # (valid input, context handed to decode with it)
    decode: Callable[[bytes, Any], Any]
    allowed: tuple[type[BaseException], ...]
    check: Callable[[Any, Any], None] = lambda _out, _context: None
    tree: tuple[Callable[[bytes], Any], Callable[[Any], bytes]] | None = None
    # A damage that generic mutation would rarely find, applied to the tree now and then.
    special: Callable[[random.Random, Any], Any] | None = None


def _msgpack_tree() -> tuple[Callable[[bytes], Any], Callable[[Any], bytes]]:
    return (
        lambda data: msgpack.unpackb(data, raw=False, strict_map_key=False),
        lambda tree: msgpack.packb(tree, use_bin_type=True),
    )


# ----------------------------------------------------------------------------- tensor frames


def _tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tensors = []
    for shape in [(), (0,), (5,), (3, 7), (2, 3, 4), (300,)]:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            tensors.append(torch.randn(shape, generator=generator).to(dtype))
    return tensors


def _codecs() -> list:
    return [IdentityCodec(), Float16Codec(), TopKCodec(0.1), TopKCodec(0.9), TernaryCodec(4)]


def _frame_seeds() -> list[tuple[bytes, Any]]:
    seeds = []
    for tensor in _tensors():
        for codec in _codecs():
            try:
                seeds.append((pack_tensor(tensor, codec), (tensor.dtype, tuple(tensor.shape))))
            except (ValueError, TypeError):
                continue  # a codec that does not take this tensor (e.g. empty)
    for tensor in (torch.arange(10), torch.tensor([True, False]), torch.zeros(4, dtype=torch.int8)):
        seeds.append((pack_tensor(tensor), (tensor.dtype, tuple(tensor.shape))))
    return seeds


def _check_tensor(limits: FrameLimits) -> Callable[[Any, Any], None]:
    def check(tensor: Any, _context: Any) -> None:
        assert isinstance(tensor, torch.Tensor), type(tensor)
        assert tensor.numel() <= limits.max_elements, tensor.numel()
        if tensor.is_floating_point() and not limits.allow_nonfinite:
            assert bool(torch.isfinite(tensor).all()), "non-finite values accepted"

    return check


def huge_shape(rng: random.Random, frame: Any) -> Any:
    """A few bytes that declare a huge tensor: the shape grows, the payload does not."""
    if isinstance(frame, dict):
        numel = rng.choice((1 << 20, 1 << 24, 1 << 26, 1 << 28))
        frame["sh"] = rng.choice(([numel], [numel >> 10, 1 << 10], [2, numel >> 1]))
    return frame


def _decode_expected(data: bytes, context: Any) -> torch.Tensor:
    dtype, shape = context
    return unpack_tensor(data, expect_dtype=dtype, expect_shape=shape)


def _check_expected(tensor: Any, context: Any) -> None:
    _check_tensor(DEFAULT_LIMITS)(tensor, context)
    assert (tensor.dtype, tuple(tensor.shape)) == context, (tensor.dtype, tensor.shape)


def tensor_targets() -> list[Target]:
    seeds = _frame_seeds()
    return [
        Target(
            name="tensor frame (limits)",
            seeds=seeds,
            decode=lambda data, _c: unpack_tensor(data, limits=SMALL_LIMITS),
            allowed=(FrameError,),
            check=_check_tensor(SMALL_LIMITS),
            tree=_msgpack_tree(),
            special=huge_shape,
        ),
        Target(
            name="tensor frame (expected)",
            seeds=seeds,
            decode=_decode_expected,
            allowed=(FrameError,),
            check=_check_expected,
            tree=_msgpack_tree(),
            special=huge_shape,
        ),
    ]


# ----------------------------------------------------------------------------- frame heads


def _head_seeds() -> list[tuple[bytes, Any]]:
    seeds = []
    for kind in FrameKind:
        for step, micro_batch, stage, body in ((0, 0, 0, 1), (7, 3, 2, 4096), (2**40, 9, 1, 1)):
            header = FrameHeader(step=step, micro_batch=micro_batch, kind=kind, stage=stage)
            seeds.append((encode_head(header, body), None))
    return seeds


def decode_head(data: bytes, _context: Any = None) -> tuple[FrameHeader, int]:
    """A frame head as the transport reads it: the prefix first, then the header it sizes."""
    header, body_len, _rest = split_frame(data)
    return header, body_len


def split_frame(data: bytes) -> tuple[FrameHeader, int, bytes]:
    """(header, announced body length, the bytes after the head)."""
    header_len, body_len = parse_prefix(data[:PREFIX_BYTES], max_body_bytes=MAX_BODY_BYTES)
    head = data[PREFIX_BYTES : PREFIX_BYTES + header_len]
    if len(head) < header_len:
        raise FrameError("stream ended inside the header")  # what read_exactly raises
    return FrameHeader.from_wire(head), body_len, data[PREFIX_BYTES + header_len :]


def _check_head(out: Any, _context: Any) -> None:
    header, body_len = out
    assert isinstance(header.kind, FrameKind)
    assert 1 <= body_len <= MAX_BODY_BYTES


def _head_tree() -> tuple[Callable[[bytes], Any], Callable[[Any], bytes]]:
    """The header map; re-encoded under a correct prefix, so the map itself is what is bad."""

    def encode(tree: Any) -> bytes:
        head = msgpack.packb(tree, use_bin_type=True)
        if len(head) > 0xFFFF:
            head = head[:0xFFFF]
        return bytes([1]) + len(head).to_bytes(2, "big") + (64).to_bytes(4, "big") + head

    return (lambda data: msgpack.unpackb(data[PREFIX_BYTES:], raw=False), encode)


def head_target() -> Target:
    return Target(
        name="frame head",
        seeds=_head_seeds(),
        decode=decode_head,
        allowed=(FrameError,),
        check=_check_head,
        tree=_head_tree(),
    )


# ----------------------------------------------------------------------------- DHT
