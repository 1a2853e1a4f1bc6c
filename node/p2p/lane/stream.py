"""A lane's two ends on a trio TCP socket: one sealed byte stream, one direction.

The sender writes frames through ``LaneWriter.write`` (cut into sealed chunks); the receiver
reads them through ``LaneReader.read``, which is a ``framing.Reader``, so inbound.py serves a
lane with exactly the checks and limits it applies to a libp2p stream. Neither end ever
sends the other anything after the lane is set up: the writer reads only to notice the end.
"""

import socket

import trio

from fusionllm.common.errors import FrameError
from fusionllm.node.errors import TransportError
from fusionllm.node.p2p.lane.seal import (
    LENGTH_BYTES,
    MAX_CHUNK_BYTES,
    TAG_BYTES,
    Opener,
    Sealer,
    chunk_length,
)


async def send_all(sock: trio.socket.SocketType, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        sent = await sock.send(view)
        view = view[sent:]


async def recv_exactly(sock: trio.socket.SocketType, into: memoryview) -> int:
    """Fill ``into``; returns how many bytes came before the peer closed (all of them if not)."""
    got = 0
    while got < len(into):
        count = await sock.recv_into(into[got:])
        if count == 0:
            break
        got += count
    return got


def tune(sock: trio.socket.SocketType) -> None:
    """Frames are written whole and read at once: no Nagle delay on their last chunk."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class LaneWriter:
    """The sending end; ``write`` must not run in two tasks at once (the caller holds a lock)."""

    def __init__(self, sock: trio.socket.SocketType, key: bytes) -> None:
        self._sock = sock
        self._sealer = Sealer(key)

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), MAX_CHUNK_BYTES):
            await send_all(self._sock, self._sealer.seal(view[start : start + MAX_CHUNK_BYTES]))

    async def read(self, max_bytes: int) -> bytes:
        """Returns when the receiver ends the lane (b"", or an error); it never writes."""
        return await self._sock.recv(max_bytes)

    async def close(self) -> None:
        self._sock.close()

    async def reset(self) -> None:
        self._sock.close()


class LaneReader:
    """The receiving end, as a ``framing.Reader``: ``read(n)`` gives 1..n plaintext bytes, or
    b"" where the sender closed the lane between chunks. A chunk that fails to open, or a
    lane that ends inside a chunk, is a FrameError; a read cancelled inside a chunk leaves
    the lane unusable (TransportError on the next read), since its place in the byte stream
    is lost."""

    def __init__(self, sock: trio.socket.SocketType, key: bytes) -> None:
        self._sock = sock
        self._opener = Opener(key)
        self._prefix = bytearray(LENGTH_BYTES)
        self._sealed = bytearray(MAX_CHUNK_BYTES + TAG_BYTES)
        self._plain = bytearray(MAX_CHUNK_BYTES)
        self._start = 0
        self._end = 0
        self._broken = False

    async def read(self, max_bytes: int) -> bytes:
        if self._start == self._end:
            sealed = await self._receive_chunk()
            if sealed is None:
                return b""
            self._end = self._opener.open(self._prefix, sealed, memoryview(self._plain))
            self._start = 0
        count = min(max_bytes, self._end - self._start)
        data = bytes(self._plain[self._start : self._start + count])
        self._start += count
        return data

    async def read_into(self, into: memoryview) -> int:
        """Like ``read(len(into))``, into ``into``: a chunk that fits is decrypted straight
        there (no copy of the plaintext); returns 0 where ``read`` returns b""."""
        if self._start == self._end:
            sealed = await self._receive_chunk()
            if sealed is None:
                return 0
            if len(sealed) - TAG_BYTES <= len(into):
                return self._opener.open(self._prefix, sealed, into)
            self._end = self._opener.open(self._prefix, sealed, memoryview(self._plain))
            self._start = 0
        count = min(len(into), self._end - self._start)
        into[:count] = memoryview(self._plain)[self._start : self._start + count]
        self._start += count
        return count

    async def _receive_chunk(self) -> memoryview | None:
        """The next chunk's sealed bytes (its length in ``_prefix``), or None at a clean end."""
        if self._broken:
            raise TransportError("the lane was left inside a chunk by an interrupted read")
        self._broken = True  # until this chunk is whole
        got = await recv_exactly(self._sock, memoryview(self._prefix))
        if got == 0:
            self._broken = False
            return None
        if got < LENGTH_BYTES:
            raise FrameError(f"the lane ended inside a chunk's length ({got} bytes)")
        sealed = memoryview(self._sealed)[: chunk_length(self._prefix) + TAG_BYTES]
        got = await recv_exactly(self._sock, sealed)
        if got < len(sealed):
            raise FrameError(f"the lane ended after {got} of a chunk's {len(sealed)} bytes")
        self._broken = False
        return sealed

    async def close(self) -> None:
        self._sock.close()

    async def reset(self) -> None:
        self._sock.close()
