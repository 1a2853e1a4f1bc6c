"""Length-prefixed msgpack messages on a byte stream: the pipe between a node and its DHT worker."""

import struct
from typing import Any, BinaryIO

import msgpack

from fusionllm.common.errors import FusionError

MAX_MESSAGE_BYTES = 64 << 20
_PREFIX = struct.Struct(">I")


class PipeClosedError(FusionError):
    """The other end of the pipe is gone."""


def write_message(stream: BinaryIO, message: Any) -> None:
    data = msgpack.packb(message, use_bin_type=True)
    stream.write(_PREFIX.pack(len(data)) + data)
    stream.flush()


def read_message(stream: BinaryIO) -> Any:
    prefix = _read_exactly(stream, _PREFIX.size)
    (size,) = _PREFIX.unpack(prefix)
    if size > MAX_MESSAGE_BYTES:
        raise PipeClosedError(f"message of {size} bytes on the pipe; the other end is broken")
    return msgpack.unpackb(_read_exactly(stream, size), raw=False, strict_map_key=False)


def _read_exactly(stream: BinaryIO, size: int) -> bytes:
    chunks, got = [], 0
    while got < size:
        chunk = stream.read(size - got)
        if not chunk:
            raise PipeClosedError("pipe closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
