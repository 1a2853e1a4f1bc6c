"""The data plane: tensors to and from peers over py-libp2p streams, behind a thread bridge.

py-libp2p is trio-native and the compute side is plain threads and torch, so the host runs in
one dedicated thread (``trio.run``) and the rest of the node talks to it only through this
class: ``send``/``send_async`` (a ``concurrent.futures.Future``), ``recv`` (a thread-safe
inbox), ``connect``, ``stats`` and ``close``. Heavy torch work in the caller's thread and
encryption/muxing in the trio thread then only share the GIL, never an event loop.

Per peer there is one outbound stream (frames are written whole, one at a time) and at most
``max_streams_per_peer`` inbound ones. Backpressure both ways: a caller blocks in ``send``
once ``max_in_flight`` frames to a peer are unfinished, and a reader stops reading a peer's
stream once ``max_in_flight`` of its frames wait in the inbox (the window then fills and the
sender blocks). A malformed or stalled frame resets only its stream and is counted against
the peer; the node keeps serving everyone else.
"""

import contextlib
import ipaddress
import math
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import multiaddr
import torch
import trio
from libp2p.abc import IHost, INetStream
from libp2p.exceptions import BaseLibp2pError
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH as _NOISE_MAX_PLAINTEXT
from libp2p.stream_muxer.yamux.yamux import HEADER_SIZE as _YAMUX_HEADER_BYTES
from libp2p.stream_muxer.yamux.yamux import MAX_MESSAGE_SIZE as _YAMUX_MAX_FRAME_BYTES

from fusionllm.common.errors import ConfigError, FrameError, FusionError, PeerError
from fusionllm.common.logs import get_logger
from fusionllm.compression import DEFAULT_LIMITS, Codec, FrameLimits, pack_tensor, unpack_tensor
from fusionllm.node.errors import DeadlineError, TransportClosedError, TransportError
from fusionllm.node.p2p.framing import (
    MAX_BODY_BYTES,
    FrameHeader,
    encode_head,
    read_exactly,
    read_head,
)
from fusionllm.node.p2p.host import TENSOR_PROTOCOL, new_secure_host
from fusionllm.node.p2p.identity import load_or_create_identity, peer_id_of

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

# Errors py-libp2p and trio raise when a stream or connection breaks under us.
_NETWORK_ERRORS = (BaseLibp2pError, OSError, trio.BrokenResourceError, trio.ClosedResourceError)


def _positive(name: str, value: float, *, allow_inf: bool = False) -> None:
    if not (value > 0 and (allow_inf or math.isfinite(value))):
        raise ConfigError(f"{name} must be a positive finite number of seconds, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """Everything the data plane needs; all deadlines in seconds."""

    key_path: Path
    listen_host: str = "127.0.0.1"
    listen_port: int = 0  # 0: a free port
    dial_timeout_s: float = 10.0  # connect + security + muxer + protocol negotiation
    read_timeout_s: float = 10.0  # longest silence allowed *inside* a frame
    write_timeout_s: float = 60.0  # one whole frame, including opening the stream
    idle_timeout_s: float = 600.0  # an inbound stream with no frame for this long is closed
    close_timeout_s: float = 5.0
    max_frame_bytes: int = 256 << 20  # the pack_tensor bytes of one frame
    max_in_flight: int = 4  # frames per peer and direction not yet written / not yet taken
    max_streams_per_peer: int = 8
    inbox_size: int = 64  # received frames waiting for recv(), all peers together
    decode_in_thread_bytes: int = 1 << 20  # larger bodies are decoded off the trio thread
    limits: FrameLimits = DEFAULT_LIMITS

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_path", Path(self.key_path))
        try:
            ipaddress.ip_address(self.listen_host)
        except ValueError as exc:
            raise ConfigError(
                f"listen_host must be an IP address, got {self.listen_host!r}"
            ) from exc
        if not 0 <= self.listen_port <= 65535:
            raise ConfigError(f"listen_port must be in [0, 65535], got {self.listen_port}")
        for name in ("dial_timeout_s", "read_timeout_s", "write_timeout_s", "close_timeout_s"):
            _positive(name, getattr(self, name))
        _positive("idle_timeout_s", self.idle_timeout_s, allow_inf=True)
        if not 64 <= self.max_frame_bytes <= MAX_BODY_BYTES:
            raise ConfigError(
                f"max_frame_bytes must be in [64, {MAX_BODY_BYTES}], got {self.max_frame_bytes}"
            )
        for name in ("max_in_flight", "max_streams_per_peer", "inbox_size"):
            if not 1 <= getattr(self, name) <= 1 << 16:
                raise ConfigError(f"{name} must be in [1, 65536], got {getattr(self, name)}")
        if self.decode_in_thread_bytes < 0:
            raise ConfigError(
                f"decode_in_thread_bytes must be >= 0, got {self.decode_in_thread_bytes}"
            )

    @property
    def max_body_bytes(self) -> int:
        return min(self.max_frame_bytes, self.limits.max_frame_bytes)

    @property
    def listen_multiaddr(self) -> multiaddr.Multiaddr:
        family = "ip6" if ipaddress.ip_address(self.listen_host).version == 6 else "ip4"
        return multiaddr.Multiaddr(f"/{family}/{self.listen_host}/tcp/{self.listen_port}")


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver expects for a frame; anything else is the peer's fault."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def check(self, tensor: torch.Tensor) -> None:
        if tensor.dtype != self.dtype or tuple(tensor.shape) != self.shape:
            raise FrameError(
                f"expected {self.dtype} {list(self.shape)}, got {tensor.dtype} {list(tensor.shape)}"
            )


# For each received header: the spec its tensor must match, or None to accept any.
SpecFor = Callable[[FrameHeader], TensorSpec | None]


@dataclass(frozen=True)
class Received:
    peer: str
    header: FrameHeader
    tensor: torch.Tensor


@dataclass(frozen=True)
class PeerStats:
    frames_in: int
    frames_out: int
    bytes_in: int
    bytes_out: int
    errors: dict[str, int]  # error type name -> count, for frames/streams this peer broke
    streams_ended_by_peer: int  # our outbound streams it reset or closed (refusals among them)


@dataclass
class _Counters:
    frames_in: int = 0
    frames_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    errors: Counter = field(default_factory=Counter)
    streams_ended_by_peer: int = 0
    inbound_streams: int = 0


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


_CLOSED = object()  # put in the inbox when the transport stops, to wake a blocked recv()


class Transport:
    """A node's tensor transport; use as a context manager or call ``start``/``close``."""

    def __init__(self, config: TransportConfig, *, expect: SpecFor | None = None) -> None:
        self.config = config
        self._expect = expect
        self._key_pair = load_or_create_identity(config.key_path)
        self.peer_id = peer_id_of(self._key_pair)
        self.addrs: list[str] = []
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()  # guards _counters and _send_slots across threads
        self._counters: dict[str, _Counters] = {}
        self._send_slots: dict[str, threading.BoundedSemaphore] = {}
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._closed = False
        # Owned by the trio thread from here on.
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._nursery: trio.Nursery | None = None
        self._host: IHost | None = None
        self._outbound: dict[str, _Outbound] = {}
        self._recv_slots: dict[str, trio.Semaphore] = {}
        self._inbox_slots: trio.Semaphore | None = None

    # ----- lifecycle (any thread) -------------------------------------------------------------

    def start(self) -> Self:
        """Start the trio thread and wait until the host listens; raises if it cannot."""
        if self._thread is not None:
            raise TransportError("transport already started")
        if self.config.listen_port:
            _check_port_free(self.config.listen_host, self.config.listen_port)
        self._thread = threading.Thread(target=self._run, name="fusionllm-transport", daemon=True)
        self._thread.start()
        if not self._started.wait(self.config.dial_timeout_s + self.config.close_timeout_s):
            self.close()
            raise DeadlineError("the transport did not start listening in time")
        if self._start_error is not None or self._token is None:
            self.close()
            raise TransportError(f"the transport failed to start: {self._start_error!r}")
        logger.info("transport %s listening on %s", self.peer_id, self.addrs)
        return self

    def close(self) -> None:
        """Stop the trio thread (bounded by close_timeout_s); pending calls fail, recv wakes."""
        if self._closed:
            return
        self._closed = True
        if self._token is not None and self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._stop.set)
        if self._thread is not None:
            self._thread.join(self.config.close_timeout_s)
            if self._thread.is_alive():
                # A daemon thread: it cannot keep the process alive, so say so and move on.
                logger.warning(
                    "transport thread still running %ss after close", self.config.close_timeout_s
                )
        self._inbox.put(_CLOSED)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----- the bridge (compute threads) -------------------------------------------------------

    def connect(self, addr: str, *, timeout: float | None = None) -> str:
        """Dial a ``/ip4/.../tcp/.../p2p/<peer id>`` address; returns the peer id."""
        timeout = self.config.dial_timeout_s if timeout is None else timeout
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except Exception as exc:  # multiaddr raises assorted types for bad text
            raise TransportError(f"not a peer address: {addr!r}: {exc}") from exc
        self._call(self._connect, info, timeout)
        return info.peer_id.to_base58()

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
        _check_peer_id(peer)
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
            token = self._require_token()
            token.run_sync_soon(self._spawn_send, future, peer, head, body, remaining)
        except trio.RunFinishedError as exc:
            future.cancel()
            raise TransportClosedError("transport closed") from exc
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
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise DeadlineError(f"no frame received within {timeout}s") from None
        if item is _CLOSED:
            self._inbox.put(_CLOSED)  # wake the next waiter too
            raise TransportClosedError("transport closed")
        received, release = item
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(release)
        return received

    def stats(self) -> dict[str, PeerStats]:
        """Per-peer counters, a consistent snapshot."""
        with self._lock:
            return {
                peer: PeerStats(
                    frames_in=c.frames_in,
                    frames_out=c.frames_out,
                    bytes_in=c.bytes_in,
                    bytes_out=c.bytes_out,
                    errors=dict(c.errors),
                    streams_ended_by_peer=c.streams_ended_by_peer,
                )
                for peer, c in self._counters.items()
            }

    # ----- helpers for the bridge -------------------------------------------------------------

    def _require_token(self) -> trio.lowlevel.TrioToken:
        if self._closed or self._token is None:
            raise TransportClosedError("transport is not running")
        return self._token

    def _call(self, async_fn: Callable[..., Any], *args: Any) -> Any:
        token = self._require_token()
        try:
            return trio.from_thread.run(async_fn, *args, trio_token=token)
        except trio.RunFinishedError as exc:
            raise TransportClosedError("transport closed") from exc

    def _send_slot(self, peer: str) -> threading.BoundedSemaphore:
        with self._lock:
            slot = self._send_slots.get(peer)
            if slot is None:
                slot = self._send_slots[peer] = threading.BoundedSemaphore(
                    self.config.max_in_flight
                )
            return slot

    def _count(self, peer: str) -> _Counters:
        # Called with self._lock held.
        counters = self._counters.get(peer)
        if counters is None:
            counters = self._counters[peer] = _Counters()
        return counters

    def _count_error(self, peer: str, exc: BaseException) -> None:
        with self._lock:
            self._count(peer).errors[type(exc).__name__] += 1

    # ----- the trio thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported to start() or logged, never lost
            if not self._started.is_set():
                self._start_error = exc
            else:
                logger.error("transport thread failed", exc_info=True)
        finally:
            self._started.set()
            self._inbox.put(_CLOSED)

    async def _main(self) -> None:
        self._stop = trio.Event()
        self._inbox_slots = trio.Semaphore(self.config.inbox_size)
        host = new_secure_host(self._key_pair, negotiate_timeout_s=self.config.dial_timeout_s)
        with trio.CancelScope() as outer:
            async with host.run(listen_addrs=[self.config.listen_multiaddr]):
                async with trio.open_nursery() as nursery:
                    self._host = host
                    self._nursery = nursery
                    host.set_stream_handler(TENSOR_PROTOCOL, self._handle_stream)
                    self.addrs = [str(addr) for addr in host.get_addrs()]
                    self._token = trio.lowlevel.current_trio_token()
                    self._started.set()
                    await self._stop.wait()
                    nursery.cancel_scope.cancel()
                self._nursery = None
                # py-libp2p's own shutdown gets what is left of the close budget, then is cut.
                outer.deadline = trio.current_time() + self.config.close_timeout_s / 2

    async def _connect(self, info: Any, timeout: float) -> None:
        assert self._host is not None
        try:
            with trio.fail_after(timeout):
                await self._host.connect(info)
        except trio.TooSlowError:
            raise DeadlineError(f"dial to {info.peer_id} timed out after {timeout}s") from None
        except _NETWORK_ERRORS as exc:
            logger.debug("dial to %s failed", info.peer_id, exc_info=True)
            raise TransportError(f"dial to {info.peer_id} failed: {exc}") from exc

    def _spawn_send(
        self, future: Future, peer: str, head: bytes, body: bytes, timeout: float
    ) -> None:
        # Runs as a run_sync_soon callback: it must not raise, or the whole trio run dies.
        try:
            if self._nursery is None or self._stop is None or self._stop.is_set():
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
        except _NETWORK_ERRORS as exc:
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
            with self._lock:
                counters = self._count(peer)
                counters.frames_out += 1
                counters.bytes_out += len(head) + len(body)
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
            except _NETWORK_ERRORS:
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
        assert self._host is not None
        assert self._nursery is not None
        dial_s = self.config.dial_timeout_s
        # Dialing (when not connected yet) and protocol negotiation get the dial deadline, not
        # the longer write deadline: a silent peer would otherwise hold the send for minutes.
        stream: INetStream | None = None
        with trio.move_on_after(dial_s):
            stream = await self._host.new_stream(ID.from_base58(peer), [TENSOR_PROTOCOL])
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
        except (*_NETWORK_ERRORS, EOFError):
            # py-libp2p reports a peer's RST as EOF once it dropped the stream, so a reset
            # (frame refused) and a close (idle, shutdown) look alike here: both end the stream.
            logger.debug("%s ended our stream", peer, exc_info=True)
        with self._lock:
            self._count(peer).streams_ended_by_peer += 1
        if out.stream is stream:
            out.stream = None
        await _reset_quietly(stream)

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
            await _reset_quietly(stream)
            raise

    async def _handle_stream(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        with self._lock:
            counters = self._count(peer)
            too_many = counters.inbound_streams >= self.config.max_streams_per_peer
            if not too_many:
                counters.inbound_streams += 1
        if too_many:
            self._count_error(peer, TransportError())
            logger.debug(
                "peer %s opened more than %d streams", peer, self.config.max_streams_per_peer
            )
            await _reset_quietly(stream)
            return
        try:
            await self._read_frames(peer, stream)
        except (PeerError, *_NETWORK_ERRORS) as exc:
            # The peer's fault (or its network's): drop this stream, keep everything else.
            self._count_error(peer, exc)
            logger.debug("closing a stream from %s", peer, exc_info=True)
            await _reset_quietly(stream)
        except Exception as exc:
            # A failure we did not foresee still costs only this stream, never the node.
            self._count_error(peer, exc)
            logger.warning("unexpected error on a stream from %s", peer, exc_info=True)
            await _reset_quietly(stream)
        else:
            with contextlib.suppress(*_NETWORK_ERRORS):
                await stream.close()
        finally:
            with self._lock:
                self._count(peer).inbound_streams -= 1

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
            with self._lock:
                counters = self._count(peer)
                counters.frames_in += 1
                counters.bytes_in += body_len
            self._inbox.put((Received(peer, header, tensor), release))

    async def _decode(self, body: bytearray | memoryview) -> torch.Tensor:
        limits = self.config.limits
        if len(body) < self.config.decode_in_thread_bytes:
            return unpack_tensor(body, limits=limits)
        # Big frames: copy/validate in a worker thread so the loop keeps serving other streams.
        return await trio.to_thread.run_sync(
            lambda: unpack_tensor(body, limits=limits), abandon_on_cancel=True
        )


def _check_port_free(host: str, port: int) -> None:
    """Refuse a fixed port another process listens on.

    py-libp2p listens with SO_REUSEPORT, so a second node on the same port starts without
    error and the kernel then splits incoming connections between the two nodes. A plain
    bind (no SO_REUSEPORT) fails while any socket holds the port.
    """
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR lets the probe bind over TIME_WAIT leftovers of our own last run (a
        # restart), while on Linux it still fails against a live listener.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise TransportError(f"cannot listen on {host}:{port}: {exc}") from exc


def _check_peer_id(peer: str) -> None:
    try:
        if not isinstance(peer, str) or not peer:
            raise ValueError("empty")
        ID.from_base58(peer)
    except Exception as exc:  # base58 and multihash raise assorted types
        raise ValueError(f"not a peer id: {peer!r}") from exc


def _releaser(*semaphores: trio.Semaphore) -> Callable[[], None]:
    done = False

    def release() -> None:
        nonlocal done
        if not done:
            done = True
            for semaphore in semaphores:
                semaphore.release()

    return release


async def _reset_quietly(stream: INetStream) -> None:
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await stream.reset()
        except _NETWORK_ERRORS:
            logger.debug("reset of a broken stream failed", exc_info=True)
