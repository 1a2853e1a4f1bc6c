"""A lane's two ends: one sealed byte stream over TCP, one direction.

The sender's threads write whole frames through ``LaneWriter.write_frame`` (cut into sealed
chunks); the receiver reads them in a thread through ``BlockingLaneReader``, a
``blocking_framing.BlockingReader``, so lane/serve.py applies the same checks and limits as
inbound.py does to a libp2p stream. Neither end ever sends the other anything after the lane
is set up: the writer reads only to notice the end.
"""

import contextlib
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

import trio

from fusionllm.common.errors import FrameError
from fusionllm.node.errors import DeadlineError, TransportError
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


# A send is never given less than this to finish (a zero timeout would mean "don't block").
_MIN_WAIT_S = 0.001


def _send_now(sock: socket.socket, data: memoryview) -> int:
    """What a non-blocking socket takes of ``data`` now (0 when its buffer is full)."""
    sent = 0
    while sent < len(data):
        try:
            sent += sock.send(data[sent:])
        except BlockingIOError:
            break
    return sent


def tune(sock: trio.socket.SocketType) -> None:
    """Frames are written whole and read at once: no Nagle delay on their last chunk."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class LaneWriter:
    """The sending end, written from any thread: ``write_frame`` seals and sends one whole frame
    under the lane's lock, on a blocking duplicate of the socket, so a caller's thread can put
    a frame on the wire itself instead of handing it to the event loop (two thread hops and
    ~7 scheduler rounds per frame). The trio socket stays for ``read``, which only notices
    the end: the receiver never writes after the lane is set up. A write that fails or times
    out leaves the lane ``broken`` (its place in the sealed stream is lost) and closed."""

    def __init__(self, sock: trio.socket.SocketType, key: bytes) -> None:
        self._sock = sock
        # A duplicate fd shares the socket and its non-blocking flag; a timeout (never None)
        # makes Python wait in poll() between sends without clearing that flag for trio.
        self._blocking = socket.socket(fileno=os.dup(sock.fileno()))
        self._sealer = Sealer(key)
        self.lock = threading.Lock()
        self.broken = False

    def write_frame(self, parts: tuple[bytes | memoryview, ...], timeout: float) -> None:
        """Seal and send ``parts`` (a frame's head and body), all within ``timeout`` seconds;
        DeadlineError if not, TransportError if the lane is (or becomes) broken."""
        deadline = time.monotonic() + timeout
        if not self.lock.acquire(timeout=max(timeout, 0.0)):
            raise DeadlineError(f"the lane stayed busy for {timeout}s")
        try:
            if self.broken:
                raise TransportError("the lane is broken")
            self._finish(memoryview(b""), self._chunks(parts), deadline)
        finally:
            self.lock.release()

    def start_locked(self, parts: tuple[bytes | memoryview, ...]) -> Callable[[float], None] | None:
        """Send as much of a frame as the socket takes without waiting (caller holds ``lock``):
        None when all of it went out, else a function that sends the rest by a deadline,
        blocking; the lock must stay held until that has run."""
        if self.broken:
            raise TransportError("the lane is broken")
        chunks = self._chunks(parts)
        try:
            self._blocking.settimeout(0.0)  # a full socket raises BlockingIOError, never waits
            for sealed in chunks:
                sent = _send_now(self._blocking, sealed)
                if sent < len(sealed):
                    rest = sealed[sent:]  # the sealer's buffer: valid until the next chunk
                    return lambda deadline: self._finish(rest, chunks, deadline)
        except BaseException as exc:
            self._fail(exc)
        return None

    def _chunks(self, parts: tuple[bytes | memoryview, ...]) -> Iterator[memoryview]:
        for part in parts:
            view = memoryview(part).cast("B")
            for start in range(0, len(view), MAX_CHUNK_BYTES):
                yield self._sealer.seal(view[start : start + MAX_CHUNK_BYTES])

    def _finish(self, rest: memoryview, chunks: Iterator[memoryview], deadline: float) -> None:
        try:
            for sealed in itertools.chain((rest,), chunks):
                if sealed:
                    self._blocking.settimeout(max(deadline - time.monotonic(), _MIN_WAIT_S))
                    self._blocking.sendall(sealed)
        except BaseException as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> NoReturn:
        self.broken = True  # a frame cut short: nothing more may follow on this lane
        self._close_blocking()
        if isinstance(exc, TimeoutError):
            raise DeadlineError("the lane's peer did not take a frame in time") from exc
        if isinstance(exc, OSError):
            raise TransportError(f"writing to the lane failed: {exc}") from exc
        raise exc

    async def read(self, max_bytes: int) -> bytes:
        """Returns when the receiver ends the lane (b"", or an error); it never writes."""
        return await self._sock.recv(max_bytes)

    def _close_blocking(self) -> None:
        with contextlib.suppress(OSError):
            self._blocking.close()

    async def close(self) -> None:
        self.broken = True
        if self.lock.acquire(blocking=False):
            self._close_blocking()
            self.lock.release()
        else:  # a thread is writing: make its send fail now, it closes its socket itself
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    async def reset(self) -> None:
        await self.close()


class _Chunks:
    """What both reader ends share: opening a chunk (its length in ``prefix``) and handing out
    its plaintext, straight into the caller's buffer where the whole chunk fits there."""

    def __init__(self, key: bytes) -> None:
        self._opener = Opener(key)
        self.prefix = bytearray(LENGTH_BYTES)
        self._sealed = bytearray(MAX_CHUNK_BYTES + TAG_BYTES)
        self._plain = bytearray(MAX_CHUNK_BYTES)
        self._start = 0
        self._end = 0
        self.broken = False  # a read stopped inside a chunk: the byte stream's place is lost

    @property
    def empty(self) -> bool:
        return self._start == self._end

    def sealed_view(self) -> memoryview:
        """Where the chunk announced by ``prefix`` goes (its sealed bytes and tag)."""
        return memoryview(self._sealed)[: chunk_length(self.prefix) + TAG_BYTES]

    def check_prefix(self, got: int) -> bool:
        """After reading ``got`` prefix bytes: False at a clean end, FrameError inside one."""
        if got == 0:
            self.broken = False
            return False
        if got < LENGTH_BYTES:
            raise FrameError(f"the lane ended inside a chunk's length ({got} bytes)")
        return True

    def check_sealed(self, got: int, sealed: memoryview) -> None:
        if got < len(sealed):
            raise FrameError(f"the lane ended after {got} of a chunk's {len(sealed)} bytes")
        self.broken = False

    def take(self, sealed: memoryview | None, max_bytes: int) -> bytes:
        if sealed is not None:
            self._end = self._opener.open(self.prefix, sealed, memoryview(self._plain))
            self._start = 0
        count = min(max_bytes, self._end - self._start)
        data = bytes(self._plain[self._start : self._start + count])
        self._start += count
        return data

    def take_into(self, sealed: memoryview | None, into: memoryview) -> int:
        if sealed is not None:
            if len(sealed) - TAG_BYTES <= len(into):
                return self._opener.open(self.prefix, sealed, into)
            self._end = self._opener.open(self.prefix, sealed, memoryview(self._plain))
            self._start = 0
        count = min(len(into), self._end - self._start)
        into[:count] = memoryview(self._plain)[self._start : self._start + count]
        self._start += count
        return count

    def begin(self) -> None:
        if self.broken:
            raise TransportError("the lane was left inside a chunk by an interrupted read")
        self.broken = True  # until this chunk is whole


class BlockingLaneReader:
    """The receiving end, in a thread of the lane's own (lane/serve.py), as a
    ``blocking_framing.BlockingReader``: ``read(n)`` gives 1..n plaintext bytes, or b"" where
    the sender closed the lane between chunks; ``read_into`` decrypts a chunk that fits
    straight into the caller's buffer. A read that needs a chunk gets it whole within the
    timeout last set, or raises TimeoutError: the deadline is per chunk, not per byte, so a
    peer trickling a byte at a time cannot hold the lane for a timeout per byte. A chunk that
    fails to open, or a lane that ends inside a chunk, is a FrameError; a timeout inside a
    chunk leaves the lane unusable (TransportError on the next read), since its place in the
    byte stream is lost."""

    def __init__(self, sock: socket.socket, key: bytes) -> None:
        self._sock = sock
        self._chunks = _Chunks(key)
        self._timeout: float | None = None

    def set_timeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def close(self) -> None:
        self._sock.close()

    def read(self, max_bytes: int) -> bytes:
        sealed = None
        if self._chunks.empty:
            sealed = self._receive_chunk()
            if sealed is None:
                return b""
        return self._chunks.take(sealed, max_bytes)

    def read_into(self, into: memoryview) -> int:
        sealed = None
        if self._chunks.empty:
            sealed = self._receive_chunk()
            if sealed is None:
                return 0
        return self._chunks.take_into(sealed, into)

    def _receive_chunk(self) -> memoryview | None:
        chunks = self._chunks
        chunks.begin()
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        prefix = memoryview(chunks.prefix)
        if not chunks.check_prefix(recv_exactly_blocking(self._sock, prefix, deadline)):
            return None
        sealed = chunks.sealed_view()
        chunks.check_sealed(recv_exactly_blocking(self._sock, sealed, deadline), sealed)
        return sealed


def recv_exactly_blocking(sock: socket.socket, into: memoryview, deadline: float | None) -> int:
    """``recv_exactly`` on a blocking socket, all of it by ``deadline`` (monotonic; None:
    no limit) or TimeoutError."""
    got = 0
    while got < len(into):
        if deadline is None:
            sock.settimeout(None)
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {len(into)} bytes by the deadline")
            sock.settimeout(left)
        count = sock.recv_into(into[got:], 0, socket.MSG_WAITALL)
        if count == 0:
            break
        got += count
    return got
