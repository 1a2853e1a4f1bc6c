"""The data plane: tensors to and from peers over py-libp2p streams, as a service on a PeerHost.

py-libp2p is trio-native and the compute side is plain threads and torch, so the host runs in
its own thread (peer_host.py) and the rest of the node talks to the data plane only through
this class: ``send``/``send_async`` (a ``concurrent.futures.Future``), ``recv`` (a thread-safe
inbox), ``connect``, ``stats`` and ``close``. Heavy torch work in the caller's thread and
encryption/muxing in the trio thread then only share the GIL, never an event loop. Given the
node's ``PeerHost`` it attaches ``TENSOR_PROTOCOL`` to it and starts nothing of its own
(closing it detaches and leaves the host running); given none, it makes and owns a host.

Per peer there is one outbound stream (frames are written whole, one at a time) and at most
``max_streams_per_peer`` inbound ones. Backpressure both ways: a caller blocks in ``send``
once ``max_in_flight`` frames to a peer are unfinished, and a reader stops reading a peer's
stream once ``max_in_flight`` of its frames wait in the inbox (the window then fills and the
sender blocks). A malformed or stalled frame resets only its stream and is counted against
the peer; the node keeps serving everyone else.
"""

import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Self

import torch
import trio
from libp2p.abc import INetStream
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.id import ID
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH as _NOISE_MAX_PLAINTEXT
from libp2p.stream_muxer.yamux.yamux import HEADER_SIZE as _YAMUX_HEADER_BYTES
from libp2p.stream_muxer.yamux.yamux import MAX_MESSAGE_SIZE as _YAMUX_MAX_FRAME_BYTES

from fusionllm.common.errors import FusionError, PeerError
from fusionllm.common.logs import get_logger
from fusionllm.compression import Codec, pack_tensor, unpack_tensor
from fusionllm.node.errors import DeadlineError, TransportClosedError, TransportError
from fusionllm.node.p2p.checks import parse_peer_id
from fusionllm.node.p2p.framing import FrameHeader, encode_head, read_exactly, read_head
from fusionllm.node.p2p.host import TENSOR_PROTOCOL
from fusionllm.node.p2p.peer_host import NETWORK_ERRORS, HostService, PeerHost, reset_quietly
from fusionllm.node.p2p.transport_types import (
    CLOSED,
    PeerCounters,
    PeerStats,
    Received,
    SpecFor,
    TensorSpec,
    TransportConfig,
    take_from_inbox,
)

# The value types live in transport_types.py; importing them from here keeps working.
__all__ = ["PeerStats", "Received", "SpecFor", "TensorSpec", "Transport", "TransportConfig"]

logger = get_logger(__name__)

# A stream keeps its largest body buffer up to this size for the next frame.
_MAX_SCRATCH_BYTES = 128 << 20

# Bytes per stream.write: the most one yamux DATA frame carries that still fits one Noise
# message. yamux alone cuts writes into 64 KiB frames (12-byte header + 65524), one more than
# Noise's 65519-byte plaintext limit, so every frame became a full Noise message plus a
# 17-byte one: twice the encrypt/decrypt calls, syscalls and reads. Written in pieces of this
# size, each yamux frame is exactly one Noise message.
_WRITE_CHUNK_BYTES = min(_YAMUX_MAX_FRAME_BYTES, _NOISE_MAX_PLAINTEXT) - _YAMUX_HEADER_BYTES

# Pause between short reads of a large body, to batch yamux window updates (framing.read_exactly).
# 2 ms: ~400 KB per read at the ~200 MB/s py-libp2p manages here, ~5x fewer updates; 1 ms and
# 0.5 ms saved less CPU on both ends.
_BODY_READ_BATCH_S = 0.002


@dataclass
class _Outbound:
    lock: trio.Lock = field(default_factory=trio.Lock)
    stream: INetStream | None = None


class _StreamReader:
    """A py-libp2p stream as a framing.Reader: EOF is b"", a reset is a TransportError."""

    def __init__(self, stream: INetStream) -> None:
        self._stream = stream

    async def read(self, n: int) -> bytes:
        try:
            return await self._stream.read(n)
        except StreamEOF:
            return b""
        except StreamReset as exc:
            raise TransportError("stream reset by peer") from exc


class Transport:
    """A node's tensor transport; use as a context manager or call ``start``/``close``.

    ``host``: the node's PeerHost, already started, to attach to (its key must be
    ``config.key_path``); None: make and own one from ``config.host_config()``.
    """

    def __init__(
        self,
        config: TransportConfig,
        *,
        expect: SpecFor | None = None,
        host: PeerHost | None = None,
    ) -> None:
        self.config = config
        self._expect = expect
        self._owns_host = host is None
        if host is None:
            host = PeerHost(config.host_config(), thread_name="fusionllm-transport")
        else:
            host.require_key(config.key_path)
        self.host = host
        self.peer_id = host.peer_id
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._counters = PeerCounters()
        self._slots_lock = threading.Lock()  # guards _send_slots across threads
        self._send_slots: dict[str, threading.BoundedSemaphore] = {}
        self._service: HostService | None = None
        self._started = False
        self._closed = False
        # Owned by the trio thread (the service) from here on.
        self._nursery: trio.Nursery | None = None
        self._outbound: dict[str, _Outbound] = {}
        self._recv_slots: dict[str, trio.Semaphore] = {}
        self._inbox_slots: trio.Semaphore | None = None

    @property
    def addrs(self) -> list[str]:
        """Full multiaddrs, ``/ip4/.../tcp/.../p2p/<peer id>``: the host's; empty until started."""
        return self.host.addrs

    # ----- lifecycle (any thread) -------------------------------------------------------------

    def start(self) -> Self:
        """Start our own host (if we have one) and attach; raises if either fails."""
        if self._started:
            raise TransportError("transport already started")
        self._started = True
        try:
            if self._owns_host:
                self.host.start()
            self._service = self.host.start_service(self._serving, name="transport")
        except BaseException:
            self.close()
            raise
        logger.info("transport %s listening on %s", self.peer_id, self.addrs)
        return self

    def close(self) -> None:
        """Detach (bounded by close_timeout_s; pending sends fail, recv wakes) and close our
        own host, if we have one. A shared host keeps running."""
        if self._closed:
            return
        self._closed = True
        if self._service is not None:
            self._service.stop()
        if self._owns_host:
            self.host.close()
        self._inbox.put(CLOSED)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----- the bridge (compute threads) -------------------------------------------------------

    def connect(self, addr: str, *, timeout: float | None = None) -> str:
        """Dial a ``/ip4/.../tcp/.../p2p/<peer id>`` address; returns the peer id."""
        self._require_running()
        timeout = self.config.dial_timeout_s if timeout is None else timeout
        return self.host.connect(addr, timeout)

    def send_async(
        self, peer: str, header: FrameHeader, body: bytes, *, timeout: float | None = None
    ) -> "Future[None]":
        """Queue one frame (``body`` = ``pack_tensor`` bytes) to ``peer``.

        Blocks while ``max_in_flight`` frames to this peer are unfinished (backpressure) and
        raises DeadlineError if no slot frees up within ``timeout``. The future resolves when
        the frame is written, or fails with a TransportError/DeadlineError.
        """
        timeout = self.config.write_timeout_s if timeout is None else timeout
        if len(body) > self.config.max_frame_bytes:
            raise ValueError(f"frame of {len(body)} bytes exceeds max_frame_bytes")
        head = encode_head(header, len(body))
        parse_peer_id(peer)
        self._require_running()
        slot = self._send_slot(peer)
        started = time.monotonic()
        if not slot.acquire(timeout=timeout):
            raise DeadlineError(
                f"{self.config.max_in_flight} frames to {peer} still in flight after {timeout}s"
            )
        future: Future[None] = Future()
        future.add_done_callback(lambda _: slot.release())
        remaining = max(timeout - (time.monotonic() - started), 0.0)
        try:
            self.host.run_sync_soon(self._spawn_send, future, peer, head, body, remaining)
        except BaseException:
            future.cancel()
            raise
        return future

    def send(
        self, peer: str, header: FrameHeader, body: bytes, *, timeout: float | None = None
    ) -> None:
        """Send one frame and wait until it is written (see ``send_async``)."""
        timeout = self.config.write_timeout_s if timeout is None else timeout
        future = self.send_async(peer, header, body, timeout=timeout)
        # The trio side enforces the deadline; the margin only covers a wedged trio thread.
        try:
            future.result(timeout + self.config.close_timeout_s)
        except TimeoutError as exc:
            if isinstance(exc, FusionError):
                raise
            raise DeadlineError(f"send to {peer} got no answer from the transport thread") from exc

    def send_tensor(
        self,
        peer: str,
        header: FrameHeader,
        tensor: torch.Tensor,
        *,
        codec: Codec | None = None,
        timeout: float | None = None,
    ) -> None:
        """Pack ``tensor`` in the caller's thread (that is compute, not network) and send it."""
        self.send(peer, header, pack_tensor(tensor, codec), timeout=timeout)

    def recv(self, *, timeout: float | None = None) -> Received:
        """The next received frame from any peer; DeadlineError if none within ``timeout``."""
        item = take_from_inbox(self._inbox, timeout)
        received, release = item
        with contextlib.suppress(TransportClosedError):  # a closed host needs no release
            self.host.run_sync_soon(release)
        return received

    def stats(self) -> dict[str, PeerStats]:
        """Per-peer counters, a consistent snapshot."""
        return self._counters.snapshot()

    # ----- helpers for the bridge -------------------------------------------------------------

    def _require_running(self) -> None:
        if self._closed or self._service is None or not self._service.running:
            raise TransportClosedError("transport is not running")

    def _send_slot(self, peer: str) -> threading.BoundedSemaphore:
        with self._slots_lock:
            slot = self._send_slots.get(peer)
            if slot is None:
                slot = self._send_slots[peer] = threading.BoundedSemaphore(
                    self.config.max_in_flight
                )
            return slot

    # ----- the trio thread ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _serving(self) -> AsyncIterator[None]:
        """TENSOR_PROTOCOL on the host and a nursery for sends, until stopped."""
        self._inbox_slots = trio.Semaphore(self.config.inbox_size)
        # Outside the nursery and the try: a refusal (another transport has the protocol)
        # reaches start() as itself, and that transport's handler stays.
        self.host.set_stream_handler(TENSOR_PROTOCOL, self._handle_stream)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                try:
                    yield
                finally:
                    self._nursery = None
                    nursery.cancel_scope.cancel()  # sends in flight fail as closed
        finally:
            # Also ends (resets) the inbound streams still being read.
            self.host.remove_stream_handler(TENSOR_PROTOCOL)
            # Our outbound streams would otherwise stay open on a host that lives on.
            for out in self._outbound.values():
                stream, out.stream = out.stream, None
                await reset_quietly(stream)
            self._inbox.put(CLOSED)

    def _spawn_send(
        self, future: Future, peer: str, head: bytes, body: bytes, timeout: float
    ) -> None:
        # Runs as a run_sync_soon callback: it must not raise, or the whole trio run dies.
        try:
            if self._nursery is None:
                raise RuntimeError("transport stopping")
            self._nursery.start_soon(self._send_task, future, peer, head, body, timeout)
        except RuntimeError:
            if future.set_running_or_notify_cancel():
                future.set_exception(TransportClosedError("transport closed"))

    async def _send_task(
        self, future: Future, peer: str, head: bytes, body: bytes, timeout: float
    ) -> None:
        if not future.set_running_or_notify_cancel():
            return
        error: BaseException | None = None
        try:
            with trio.fail_after(timeout):
                await self._write_frame(peer, head, body)
        except trio.TooSlowError:
            error = DeadlineError(f"sending {len(body)} bytes to {peer} took over {timeout}s")
        except FusionError as exc:
            error = exc
        except NETWORK_ERRORS as exc:
            logger.debug("send to %s failed", peer, exc_info=True)
            error = TransportError(f"send to {peer} failed: {exc}")
            error.__cause__ = exc
        except Exception as exc:
            # Not a failure we know from py-libp2p: fail this send loudly, keep the node.
            logger.warning("send to %s failed unexpectedly", peer, exc_info=True)
            error = TransportError(f"send to {peer} failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
        except BaseException:  # trio.Cancelled: the transport is closing
            future.set_exception(TransportClosedError("transport closed during send"))
            raise
        if error is None:
            self._counters.sent(peer, len(head) + len(body))
            future.set_result(None)
        else:
            future.set_exception(error)

    async def _write_frame(self, peer: str, head: bytes, body: bytes) -> None:
        out = self._outbound.setdefault(peer, _Outbound())
        async with out.lock:
            reused = out.stream is not None
            if out.stream is None:
                await self._open_outbound(peer, out)
            try:
                await self._write_or_drop(out, head)
            except NETWORK_ERRORS:
                if not reused:
                    raise
                # The peer ended the stream we kept (e.g. it refused our last frame) before our
                # watcher noticed; none of this frame went out, so one fresh stream is safe.
                logger.debug("stream to %s was dead; opening a new one", peer, exc_info=True)
                await self._open_outbound(peer, out)
                await self._write_or_drop(out, head)
            view = memoryview(body)
            for start in range(0, len(view), _WRITE_CHUNK_BYTES):
                await self._write_or_drop(out, view[start : start + _WRITE_CHUNK_BYTES])

    async def _open_outbound(self, peer: str, out: _Outbound) -> None:
        assert self._nursery is not None
        dial_s = self.config.dial_timeout_s
        # Dialing (when not connected yet) and protocol negotiation get the dial deadline, not
        # the longer write deadline: a silent peer would otherwise hold the send for minutes.
        stream: INetStream | None = None
        with trio.move_on_after(dial_s):
            stream = await self.host.libp2p.new_stream(ID.from_base58(peer), [TENSOR_PROTOCOL])
        if stream is None:
            raise DeadlineError(f"opening a stream to {peer} took over {dial_s}s")
        out.stream = stream
        self._nursery.start_soon(self._watch_outbound, peer, out, stream)

    async def _watch_outbound(self, peer: str, out: _Outbound, stream: INetStream) -> None:
        """Notice at once when the peer ends a stream we write to; receivers never write back.

        Without this a sender learns of a refused frame only at its next write, and frames
        written in between are lost; with it the next send opens a fresh stream.
        """
        try:
            await stream.read(1)
        except (*NETWORK_ERRORS, EOFError):
            # py-libp2p reports a peer's RST as EOF once it dropped the stream, so a reset
            # (frame refused) and a close (idle, shutdown) look alike here: both end the stream.
            logger.debug("%s ended our stream", peer, exc_info=True)
        self._counters.stream_ended(peer)
        if out.stream is stream:
            out.stream = None
        await reset_quietly(stream)

    @staticmethod
    async def _write_or_drop(out: _Outbound, data: bytes | memoryview) -> None:
        stream = out.stream
        assert stream is not None
        try:
            await stream.write(data)
        except BaseException:
            # A frame cut short leaves the stream mid-frame: nothing more may follow on it.
            if out.stream is stream:
                out.stream = None
            await reset_quietly(stream)
            raise

    async def _handle_stream(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        if not self._counters.open_inbound(peer, self.config.max_streams_per_peer):
            self._counters.error(peer, TransportError())
            logger.debug(
                "peer %s opened more than %d streams", peer, self.config.max_streams_per_peer
            )
            await reset_quietly(stream)
            return
        try:
            await self._read_frames(peer, stream)
        except (PeerError, *NETWORK_ERRORS) as exc:
            # The peer's fault (or its network's): drop this stream, keep everything else.
            self._counters.error(peer, exc)
            logger.debug("closing a stream from %s", peer, exc_info=True)
            await reset_quietly(stream)
        except Exception as exc:
            # A failure we did not foresee still costs only this stream, never the node.
            self._counters.error(peer, exc)
            logger.warning("unexpected error on a stream from %s", peer, exc_info=True)
            await reset_quietly(stream)
        else:
            with contextlib.suppress(*NETWORK_ERRORS):
                await stream.close()
        finally:
            self._counters.close_inbound(peer)

    async def _read_frames(self, peer: str, stream: INetStream) -> None:
        assert self._inbox_slots is not None
        config = self.config
        reader = _StreamReader(stream)
        peer_slots = self._recv_slots.setdefault(peer, trio.Semaphore(config.max_in_flight))
        scratch = bytearray()  # reused for every body on this stream (warm pages)
        while True:
            head = await read_head(
                reader,
                max_body_bytes=config.max_body_bytes,
                stall_timeout_s=config.read_timeout_s,
                idle_timeout_s=config.idle_timeout_s,
            )
            if head is None:
                return
            header, body_len = head
            # Backpressure: do not read (or allocate) the body until the compute side has
            # room for it; meanwhile the peer's window fills and its writes wait.
            await peer_slots.acquire()
            await self._inbox_slots.acquire()
            release = _releaser(peer_slots, self._inbox_slots)
            try:
                if len(scratch) < body_len <= _MAX_SCRATCH_BYTES:
                    scratch = bytearray(body_len)
                body = await read_exactly(
                    reader,
                    body_len,
                    stall_timeout_s=config.read_timeout_s,
                    what="body",
                    into=scratch,
                    batch_s=_BODY_READ_BATCH_S,
                )
                # unpack_tensor copies each payload once into the new tensor and keeps no view
                # of the body, so the scratch buffer is free for the next frame once it returns.
                tensor = await self._decode(body)
                spec = self._expect(header) if self._expect is not None else None
                if spec is not None:
                    spec.check(tensor)
            except BaseException:
                release()
                raise
            self._counters.received(peer, body_len)
            self._inbox.put((Received(peer, header, tensor), release))

    async def _decode(self, body: bytearray | memoryview) -> torch.Tensor:
        limits = self.config.limits
        if len(body) < self.config.decode_in_thread_bytes:
            return unpack_tensor(body, limits=limits)
        # Big frames: copy/validate in a worker thread so the loop keeps serving other streams.
        return await trio.to_thread.run_sync(
            lambda: unpack_tensor(body, limits=limits), abandon_on_cancel=True
        )


def _releaser(*semaphores: trio.Semaphore) -> Callable[[], None]:
    done = False

    def release() -> None:
        nonlocal done
        if not done:
            done = True
            for semaphore in semaphores:
                semaphore.release()

    return release
