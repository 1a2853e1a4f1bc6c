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
    CHUNK_OVERHEAD,
    LENGTH_BYTES,
    MAX_CHUNK_BYTES,
    MAX_SEALED_CHUNK,
    TAG_BYTES,
    Opener,
    Sealer,
    chunk_length,
)
from fusionllm.node.p2p.lane.tcp_info import TcpInfo, TcpInfoError, read_tcp_info
from fusionllm.node.p2p.lane.wire_meter import WireMeter


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
# Sealed chunks go out this many at a time, in one send: on loopback each send is a delivery
# and a wake-up of the reader, and a 128 KiB activation (its head, two full chunks and the
# body's last bytes) then costs one, not four.
_BATCH_CHUNKS = 4


def _send_now(sock: socket.socket, data: memoryview) -> int:
    """What a non-blocking socket takes of ``data`` now (0 when its buffer is full)."""
    sent = 0
    while sent < len(data):
        try:
            sent += sock.send(data[sent:])
        except BlockingIOError:
            break
    return sent


def _pieces(parts: tuple[bytes | memoryview, ...]) -> Iterator[memoryview]:
    """The frame's parts cut into pieces of at most a chunk (views, no copies)."""
    for part in parts:
        view = memoryview(part).cast("B")
        for start in range(0, len(view), MAX_CHUNK_BYTES):
            yield view[start : start + MAX_CHUNK_BYTES]


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
        self._batch = bytearray(_BATCH_CHUNKS * MAX_SEALED_CHUNK)
        self.lock = threading.Lock()
        self.broken = False
        self.punched = False  # its socket came from a hole punch (punch.py), not a dial
        self.meter = WireMeter()  # the link's rate as the kernel timed our frames
        # What the kernel said after the last frame (and when): None if it could not be read.
        self.last_reading: tuple[TcpInfo, float] | None = None
        # When a frame of the caller's (not a bulk probe's filler) last began (monotonic):
        # a lane that carries none for long is closed (outbound.py, LANE_IDLE_S).
        self.frame_at = time.monotonic()

    def write_frame(self, parts: tuple[bytes | memoryview, ...], timeout: float) -> None:
        """Seal and send ``parts`` (a frame's head and body), all within ``timeout`` seconds;
        DeadlineError if not, TransportError if the lane is (or becomes) broken."""
        deadline = time.monotonic() + timeout
        if not self.lock.acquire(timeout=max(timeout, 0.0)):
            raise DeadlineError(f"the lane stayed busy for {timeout}s")
        self.frame_at = time.monotonic()
        try:
            self.write_locked(parts, deadline)
        finally:
            self.lock.release()

    def start_locked(self, parts: tuple[bytes | memoryview, ...]) -> Callable[[float], None] | None:
        """Send as much of a frame as the socket takes without waiting (caller holds ``lock``):
        None when all of it went out, else a function that sends the rest by a deadline,
        blocking; the lock must stay held until that has run."""
        if self.broken:
            raise TransportError("the lane is broken")
        self.frame_at = time.monotonic()
        batches = self._batches(parts)
        try:
            self._blocking.settimeout(0.0)  # a full socket raises BlockingIOError, never waits
            for sealed in batches:
                sent = _send_now(self._blocking, sealed)
                if sent < len(sealed):
                    rest = sealed[sent:]  # the batch buffer: valid until the next batch
                    return lambda deadline: self._finish(rest, batches, deadline)
        except BaseException as exc:
            self._fail(exc)
        self._measure()
        return None

    def write_locked(self, parts: tuple[bytes | memoryview, ...], deadline: float) -> int:
        """Seal and send a whole frame by ``deadline`` (monotonic), the caller holding ``lock``
        (a bulk probe writes several in a row); the sealed bytes it put on the wire."""
        if self.broken:
            raise TransportError("the lane is broken")
        sealed = 0

        def counted() -> Iterator[memoryview]:
            nonlocal sealed
            for batch in self._batches(parts):
                sealed += len(batch)
                yield batch

        self._finish(memoryview(b""), counted(), deadline)
        return sealed

    def kernel_info(self) -> TcpInfo:
        """The kernel's view of the lane now; TcpInfoError where it cannot be read."""
        if self.broken:
            raise TcpInfoError("the lane is broken")
        return read_tcp_info(self._blocking)

    def _batches(self, parts: tuple[bytes | memoryview, ...]) -> Iterator[memoryview]:
        """The frame's sealed chunks, up to ``_BATCH_CHUNKS`` at a time in one buffer (each
        batch valid until the next is asked for)."""
        view = memoryview(self._batch)
        used = 0
        for piece in _pieces(parts):
            if used + CHUNK_OVERHEAD + len(piece) > len(view):
                yield view[:used]
                used = 0
            used += self._sealer.seal_into(piece, view[used:])
        if used:
            yield view[:used]

    def _finish(self, rest: memoryview, batches: Iterator[memoryview], deadline: float) -> None:
        try:
            for sealed in itertools.chain((rest,), batches):
                if sealed:
                    self._blocking.settimeout(max(deadline - time.monotonic(), _MIN_WAIT_S))
                    self._blocking.sendall(sealed)
        except BaseException as exc:
            self._fail(exc)
        self._measure()

    def _measure(self) -> None:
        """Hand the kernel's view of the lane to its meter (one system call, after a frame)."""
        # Not Linux, or the socket just closed: the link keeps its probes' figure.
        self.last_reading = None
        with contextlib.suppress(TcpInfoError):
            self.last_reading = (read_tcp_info(self._blocking), time.time())
            self.meter.observe(*self.last_reading)

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
    """The reader's chunks: opening one (its length in ``prefix``) and handing out its
    plaintext, straight into the caller's buffer where the whole chunk fits there."""

    def __init__(self, key: bytes) -> None:
        self._opener = Opener(key)
        self.prefix = bytearray(LENGTH_BYTES)
        self._plain = bytearray(MAX_CHUNK_BYTES)
        self._start = 0
        self._end = 0
        self.broken = False  # a read stopped inside a chunk: the byte stream's place is lost

    @property
    def empty(self) -> bool:
        return self._start == self._end

    def check_prefix(self, got: int) -> bool:
        """After ``got`` bytes came for a chunk's length: False at a clean end, FrameError
        inside one."""
        if got == 0:
            self.broken = False
            return False
        if got < LENGTH_BYTES:
            raise FrameError(f"the lane ended inside a chunk's length ({got} bytes)")
        return True

    def check_sealed(self, got: int, length: int) -> None:
        """After ``got`` bytes came for a chunk of ``length`` sealed bytes."""
        if got < length:
            raise FrameError(f"the lane ended after {got} of a chunk's {length} bytes")
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
        self._inbox = _Inbox(sock, _INBOX_CHUNKS * MAX_SEALED_CHUNK)
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
        """The next chunk's sealed bytes and tag (its length in ``_chunks.prefix``), valid until
        the next call; None at a clean end."""
        chunks, inbox = self._chunks, self._inbox
        chunks.begin()
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        if not chunks.check_prefix(inbox.fill(LENGTH_BYTES, deadline)):
            return None
        chunks.prefix[:] = inbox.take(LENGTH_BYTES)
        length = chunk_length(chunks.prefix) + TAG_BYTES
        chunks.check_sealed(inbox.fill(length, deadline), length)
        return inbox.take(length)


# The reader's buffer holds this many whole chunks: a batch the writer sent at once is read at
# once, instead of in two reads a chunk (its length, then its bytes).
_INBOX_CHUNKS = 4


class _Inbox:
    """Bytes the lane's socket gave and the reader has not used yet: each read takes what the
    socket holds, as much as fits, and waits in the kernel only for what a chunk still lacks.
    A peer's announced length never sizes anything: the buffer is fixed, and a chunk (at most
    ``MAX_SEALED_CHUNK``) always fits in it."""

    def __init__(self, sock: socket.socket, size: int) -> None:
        self._sock = sock
        self._buffer = bytearray(size)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0

    def fill(self, count: int, deadline: float | None) -> int:
        """Have at least ``count`` bytes ready by ``deadline`` (monotonic; None: no limit), or
        TimeoutError; fewer only where the peer closed. Returns how many are ready."""
        if self._end - self._start >= count:
            return self._end - self._start
        if self._start + count > len(self._buffer):  # no room behind them: move them forward
            ready = self._end - self._start
            self._view[:ready] = self._view[self._start : self._end]
            self._start, self._end = 0, ready
        flags = 0  # the first read takes whatever is there; later ones wait for the rest
        while self._end - self._start < count:
            _set_timeout(self._sock, deadline, self._end - self._start, count)
            stop = len(self._buffer) if not flags else self._start + count
            got = self._sock.recv_into(self._view[self._end : stop], 0, flags)
            if got == 0:
                break
            self._end += got
            flags = socket.MSG_WAITALL
        return self._end - self._start

    def take(self, count: int) -> memoryview:
        """The next ``count`` ready bytes (a view valid until the next ``fill``)."""
        view = self._view[self._start : self._start + count]
        self._start += count
        return view


def _set_timeout(sock: socket.socket, deadline: float | None, got: int, wanted: int) -> None:
    if deadline is None:
        sock.settimeout(None)
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"{got} of {wanted} bytes by the deadline")
    sock.settimeout(left)
