"""The serving protocol's messages on a py-libp2p stream: one session per stream.

Each message is a 4-byte big-endian length and a msgpack map. Client to server:
``{"op": "info"}``, ``{"op": "open", "span": [a, b], "max_len": n, "fp16": bool}``, then
``{"op": "step", "pos": p, "t": FRAME}`` where FRAME is a tensor frame of
``compression.frame`` (ids (1, T) on the first span, else the stream (1, T, C)). The server
answers each with ``{"ok": True, ...}`` or ``{"ok": False, "error": KIND, "msg": text}``.
Closing the stream ends the session and frees its cache. Every length, key and type is
checked before use: a peer's message is never trusted for size.
"""

import struct
from typing import Any

import msgpack

from fusionllm.common.errors import PeerError
from fusionllm.node.p2p.framing import read_exactly

PROTOCOL = "/fusionllm/serve/1.0.0"
MAX_MESSAGE_BYTES = 64 << 20  # a prefill of (1, 2048, 8192) fp32 is 64 MiB; nothing larger
_PREFIX = struct.Struct(">I")
_MAX_KEYS = 16


class ServeWireError(PeerError):
    """A serving message that is malformed, too large or not what the protocol allows here."""


def encode(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_MESSAGE_BYTES:
        raise ServeWireError(f"message of {len(body)} bytes over {MAX_MESSAGE_BYTES}")
    return _PREFIX.pack(len(body)) + body


async def send(stream, message: dict[str, Any]) -> None:
    await stream.write(encode(message))


async def receive(stream, *, stall_timeout_s: float, limit: int = MAX_MESSAGE_BYTES) -> dict:
    """The next message (a map with str keys); ServeWireError or DeadlineError otherwise."""
    prefix = await read_exactly(stream, _PREFIX.size, stall_timeout_s=stall_timeout_s)
    (size,) = _PREFIX.unpack(bytes(prefix))
    if not 1 <= size <= limit:
        raise ServeWireError(f"message of {size} bytes is not in [1, {limit}]")
    body = await read_exactly(stream, size, stall_timeout_s=stall_timeout_s, what="message")
    return decode(bytes(body))


def decode(body: bytes) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(
            body, raw=False, strict_map_key=True, max_map_len=_MAX_KEYS, max_array_len=16
        )
    except Exception as exc:  # msgpack raises assorted types for bad input
        raise ServeWireError(f"not a msgpack message: {exc}") from exc
    if not isinstance(message, dict) or not all(isinstance(k, str) for k in message):
        raise ServeWireError("a message must be a map with str keys")
    return message


def field(message: dict, name: str, kind: type, *, low: int | None = None, high=None) -> Any:
    """``message[name]`` of type ``kind`` (ints within [low, high]); ServeWireError if not."""
    value = message.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ServeWireError(f"{name!r} must be {kind.__name__}, got {type(value).__name__}")
    if kind is int and ((low is not None and value < low) or (high is not None and value > high)):
        raise ServeWireError(f"{name!r} = {value} is not in [{low}, {high}]")
    return value


def error(kind: str, text: str) -> dict[str, Any]:
    return {"ok": False, "error": kind, "msg": text[:300]}
