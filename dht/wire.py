"""Length-prefixed msgpack messages on a byte stream: the pipe between a node and its DHT worker.

    u32 body length | u64 tag | msgpack body

The tag is the request id a reply answers (0: not part of a request, e.g. the handshake). It
sits outside the body so that a reply the reader refuses (over its size limit, or not msgpack)
still names the one request it fails: the reader skips the body without allocating it, and
the pipe stays in step for every other request.
"""

import struct
from typing import Any, BinaryIO

import msgpack

from fusionllm.common.errors import FusionError

MAX_MESSAGE_BYTES = 64 << 20
# A length past this is not a big message but a broken pipe (a stray write, lost framing):
# skipping it would only read garbage as the next header.
MAX_SKIP_BYTES = 1 << 30
MAX_TAG = (1 << 64) - 1
_PREFIX = struct.Struct(">IQ")
_SKIP_CHUNK = 1 << 20


class PipeClosedError(FusionError):
    """The other end of the pipe is gone, or the pipe lost its framing."""


class MessageError(FusionError):
    """One message was refused (too large, or not msgpack); the pipe is still in step."""

    def __init__(self, message: str, *, tag: int) -> None:
        super().__init__(message)
        self.tag = tag


def write_message(
    stream: BinaryIO, message: Any, *, tag: int = 0, max_bytes: int = MAX_MESSAGE_BYTES
) -> None:
    """Write one message; MessageError (nothing written) if its body exceeds ``max_bytes``."""
    data = msgpack.packb(message, use_bin_type=True)
    if len(data) > max_bytes:
        raise MessageError(f"message of {len(data)} bytes is over {max_bytes}", tag=tag)
    stream.write(_PREFIX.pack(len(data), tag) + data)
    stream.flush()


def read_message(stream: BinaryIO, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """The next message's body (see ``read_tagged``)."""
    return read_tagged(stream, max_bytes=max_bytes)[1]


def read_tagged(stream: BinaryIO, *, max_bytes: int = MAX_MESSAGE_BYTES) -> tuple[int, Any]:
    """The next (tag, body).

    MessageError: this one message is over ``max_bytes`` (skipped unread) or not msgpack; the
    next read gets the next message. PipeClosedError: the pipe ended or lost its framing.
    """
    size, tag = _PREFIX.unpack(_read_exactly(stream, _PREFIX.size))
    if size > max_bytes:
        if size > MAX_SKIP_BYTES:
            raise PipeClosedError(f"message of {size} bytes on the pipe; the other end is broken")
        _skip(stream, size)
        raise MessageError(f"message of {size} bytes is over {max_bytes}", tag=tag)
    body = _read_exactly(stream, size)
    try:
        return tag, msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise MessageError(f"message is not msgpack: {exc}", tag=tag) from exc


def _skip(stream: BinaryIO, size: int) -> None:
    while size:
        chunk = stream.read(min(size, _SKIP_CHUNK))
        if not chunk:
            raise PipeClosedError("pipe closed")
        size -= len(chunk)


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    chunks, got = [], 0
    while got < size:
        chunk = stream.read(size - got)
        if not chunk:
            raise PipeClosedError("pipe closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
