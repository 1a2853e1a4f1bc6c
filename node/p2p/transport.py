"""The data plane: tensors to and from peers over lanes or py-libp2p streams, on a PeerHost.

py-libp2p is trio-native and the compute side is plain threads and torch, so the host runs in
its own thread (peer_host.py) and the rest of the node talks to the data plane only through
this class: ``send``/``send_async`` (a ``concurrent.futures.Future``), ``recv`` (a thread-safe
inbox), ``connect``, ``stats`` and ``close``. Heavy torch work in the caller's thread and
encryption/muxing in the trio thread then only share the GIL, never an event loop. Given the
node's ``PeerHost`` it attaches ``TENSOR_PROTOCOL`` to it and starts nothing of its own
(closing it detaches and leaves the host running); given none, it makes and owns a host.

A frame goes over a lane (lane/: a TCP connection of its own, sealed under a key agreed in
the Noise session; the caller's thread writes it, the receiver reads it in a thread of the
lane's) when the peer offers one and its port can be reached, else over a libp2p tensor
stream through the trio thread. Either way the receiver applies the same admission, limits
and checks (inbound.py). Per peer: one outbound lane or stream (frames written whole, one at
a time), at most ``max_streams_per_peer`` inbound. Backpressure both ways: a caller blocks at
``max_in_flight`` unfinished frames, a reader stops once
``max_in_flight`` of a peer's frames wait in the inbox. A malformed or stalled frame ends
only its stream, counted against the peer. The state of a peer that disconnects is dropped
(its counters stay readable among the last ``_GONE_PEERS_KEPT`` gone peers').
"""

import contextlib
import queue
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Self

import torch
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH as _NOISE_MAX_PLAINTEXT
from libp2p.stream_muxer.yamux.yamux import HEADER_SIZE as _YAMUX_HEADER_BYTES
from libp2p.stream_muxer.yamux.yamux import MAX_MESSAGE_SIZE as _YAMUX_MAX_FRAME_BYTES

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.compression import Codec, pack_tensor
from fusionllm.node.errors import DeadlineError, TransportClosedError, TransportError
from fusionllm.node.p2p.checks import parse_peer_id
from fusionllm.node.p2p.departures import Departures
from fusionllm.node.p2p.framing import FrameHeader, encode_head
from fusionllm.node.p2p.host import TENSOR_PROTOCOL
from fusionllm.node.p2p.inbound import Inbound
from fusionllm.node.p2p.lane.senders import LaneSenders
from fusionllm.node.p2p.lane.service import Lanes
from fusionllm.node.p2p.lane.stream import LaneWriter
from fusionllm.node.p2p.limits import InFlight, Refusals
from fusionllm.node.p2p.peer_host import NETWORK_ERRORS, HostService, PeerHost, reset_quietly
from fusionllm.node.p2p.transport_types import (
    CLOSED,
    AdmitPeer,
    Deliver,
    PeerCounters,
    PeerStats,
    Received,
    SpecFor,
    TensorSpec,
    TransportConfig,
    take_from_inbox,
)

# The value types live in transport_types.py; importing them from here keeps working.
__all__ = [
    "AdmitPeer",
    "Deliver",
    "PeerStats",
    "Received",
    "SpecFor",
    "TensorSpec",
    "Transport",
    "TransportConfig",
]

logger = get_logger(__name__)

# Bytes per stream.write: the most one yamux DATA frame carries inside one Noise message (yamux
# alone cuts 64 KiB frames, one byte over Noise's plaintext limit: twice the messages).
_WRITE_CHUNK_BYTES = min(_YAMUX_MAX_FRAME_BYTES, _NOISE_MAX_PLAINTEXT) - _YAMUX_HEADER_BYTES

# Counters of peers that disconnected stay readable (stats) until this many more have gone.
_GONE_PEERS_KEPT = 64


@dataclass
class _Outbound:
    lock: trio.Lock = field(default_factory=trio.Lock)
    stream: INetStream | LaneWriter | None = None


class Transport:
    """A node's tensor transport; use as a context manager or call ``start``/``close``.

    ``host``: the node's PeerHost, already started, to attach to (its key must be
    ``config.key_path``); None: make and own one from ``config.host_config()``.
    ``expect``: what a frame must hold, by header (checked before its tensor is allocated).
    ``admit``: whether a peer may open tensor streams to us at all (None: anyone may); it
    runs in the host's thread at every stream open, so it must be quick and thread-safe.
    """

    def __init__(
        self,
        config: TransportConfig,
        *,
        expect: SpecFor | None = None,
        admit: AdmitPeer | None = None,
        host: PeerHost | None = None,
    ) -> None:
        self.config = config
        self._expect = expect
        self._admit = admit
        self._owns_host = host is None
        if host is None:
            host = PeerHost(config.host_config(), thread_name="fusionllm-transport")
        else:
            host.require_key(config.key_path)
        self.host = host
        self.peer_id = host.peer_id
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._counters = PeerCounters(keep_gone=_GONE_PEERS_KEPT)
        self._refusals = Refusals()
        self._in_flight = InFlight(config.max_in_flight)
        self._service: HostService | None = None
        self._started = False
        self._closed = False
        # Owned by the trio thread (the service) from here on.
        self._nursery: trio.Nursery | None = None
        self._outbound: dict[str, _Outbound] = {}
        self._inbound: Inbound | None = None
        self._lanes = Lanes(config, host)
        self._deliver: Deliver | None = None
        self.lane_senders = LaneSenders(self._counters)  # also where lanes' wire figures are

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
        written = self.lane_senders.try_write(peer, (head, body), timeout)
        if written is not None:
            return written
        started = time.monotonic()
        if not self._in_flight.acquire(peer, timeout):
            raise DeadlineError(
                f"{self.config.max_in_flight} frames to {peer} still in flight after {timeout}s"
            )
        future: Future[None] = Future()
        future.add_done_callback(lambda _: self._in_flight.release(peer))
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
        received, release = take_from_inbox(self._inbox, timeout)
        release()  # thread-safe slots (limits.Slots): no hop into the host's thread
        return received

    def deliver_to(self, deliver: Deliver | None) -> None:
        """From now on hand each received frame to ``deliver`` in the host's thread, as soon as
        it is decoded (None: back to ``recv`` only). A frame it takes skips the inbox: no
        receive thread to wake, no slot to give back. Frames already in the inbox stay for
        ``recv``, and so does the closed marker: a caller still learns there of the end."""
        self._deliver = deliver

    def stats(self) -> dict[str, PeerStats]:
        """Per-peer counters, a consistent snapshot (connected peers and the last gone ones)."""
        return self._counters.snapshot()

    def refusals(self) -> dict[str, int]:
        """Streams and frames refused before they cost anything, by reason (inbound.py)."""
        return self._refusals.snapshot()

    def tracked_peers(self) -> dict[str, int]:
        """How many peers each kind of per-peer state holds (for tests of the pruning)."""
        return self.host.call_sync(self._tracked_peers)

    @property
    def lane_port(self) -> int:
        """Where this node accepts lanes; 0 while it accepts none."""
        return self._lanes.port

    def outbound_lanes(self) -> list[str]:
        """The peers our frames go to over a lane now (not a libp2p stream)."""
        return self.host.call_sync(
            lambda: sorted(
                peer for peer, out in self._outbound.items() if isinstance(out.stream, LaneWriter)
            )
        )

    def _tracked_peers(self) -> dict[str, int]:
        inbound = self._inbound.tracked_peers() if self._inbound is not None else 0
        return {
            "counters": self._counters.live_peers(),
            "outbound": len(self._outbound),
            "in_flight": self._in_flight.peers(),
            "inbound": inbound,
        }

    # ----- helpers for the bridge -------------------------------------------------------------

    def _require_running(self) -> None:
        if self._closed or self._service is None or not self._service.running:
            raise TransportClosedError("transport is not running")

    # ----- the trio thread ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _serving(self) -> AsyncIterator[None]:
        """TENSOR_PROTOCOL on the host and a nursery for sends, until stopped."""
        self._inbound = Inbound(
            self.config,
            inbox=self._inbox,
            counters=self._counters,
            refusals=self._refusals,
            expect=self._expect,
            admit=self._admit,
            deliver=self._route,
        )
        # Outside the nursery and the try: a refusal (another transport has the protocol)
        # reaches start() as itself, and that transport's handler stays.
        self.host.set_stream_handler(TENSOR_PROTOCOL, self._inbound.handle_stream)
        network = self.host.libp2p.get_network()
        departures = Departures(self._forget)
        network.register_notifee(departures)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                try:
                    if self.config.lanes:
                        await self._lanes.start(
                            nursery,
                            serve=self._inbound.handle_lane,
                            admit=self._inbound.admits,
                            refuse=self._inbound.refuse,
                        )
                    yield
                finally:
                    self._nursery = None
                    self._inbound.stop()  # before the lanes' sockets are shut
                    nursery.cancel_scope.cancel()  # sends in flight fail as closed
        finally:
            self._lanes.stop()
            network.remove_notifee(departures)
            # Also ends (resets) the inbound streams still being read.
            self.host.remove_stream_handler(TENSOR_PROTOCOL)
            # Our outbound streams would otherwise stay open on a host that lives on.
            self.lane_senders.clear()
            for out in self._outbound.values():
                stream, out.stream = out.stream, None
                await reset_quietly(stream)
            self._inbox.put(CLOSED)

    def _route(self, received: Received) -> bool:
        deliver = self._deliver
        return deliver is not None and deliver(received)

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
                await self._write_frame(peer, head, body, timeout)
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

    async def _write_frame(self, peer: str, head: bytes, body: bytes, timeout: float) -> None:
        out = self._outbound.setdefault(peer, _Outbound())
        async with out.lock:
            if isinstance(out.stream, LaneWriter) and out.stream.broken:
                self._drop_lane(peer, out)  # a caller's inline write failed on it
            reused = out.stream is not None
            if out.stream is None:
                await self._open_outbound(peer, out)
            if isinstance(out.stream, LaneWriter):
                await self._write_lane(peer, out, (head, body), timeout)
                return
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
        lane = await self._lanes.dial(self.host.libp2p, peer)
        if lane is not None:
            out.stream = lane
            self.lane_senders.add(peer, lane)  # from now on callers write to it themselves
            self._nursery.start_soon(self._watch_outbound, peer, out, lane)
            return
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

    async def _watch_outbound(
        self, peer: str, out: _Outbound, stream: INetStream | LaneWriter
    ) -> None:
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
        if isinstance(stream, LaneWriter):
            self.lane_senders.drop(peer, stream)
        await reset_quietly(stream)
        if out.stream is None and not out.lock.locked() and self._outbound.get(peer) is out:
            del self._outbound[peer]  # the next send opens a new stream anyway

    def _forget(self, peer: str) -> None:
        """The peer has no connection left: drop what we keep for it (trio thread)."""
        out = self._outbound.get(peer)
        if out is not None and out.stream is None and not out.lock.locked():
            del self._outbound[peer]
        if self._inbound is not None:
            self._inbound.forget(peer)
        self._lanes.forget(peer)
        self._counters.retire(peer)

    async def _write_lane(
        self, peer: str, out: _Outbound, parts: tuple[bytes, bytes], timeout: float
    ) -> None:
        """A frame the caller could not write itself (the lane was busy, or new): written by a
        worker thread, so the event loop never blocks on the socket."""
        lane = out.stream
        assert isinstance(lane, LaneWriter)
        try:
            await trio.to_thread.run_sync(lane.write_frame, parts, timeout, abandon_on_cancel=True)
        except BaseException:
            if lane.broken:
                self._drop_lane(peer, out)
            raise

    def _drop_lane(self, peer: str, out: _Outbound) -> None:
        """Forget a broken lane (its watcher closes it): the next frame opens a new one."""
        if isinstance(out.stream, LaneWriter):
            self.lane_senders.drop(peer, out.stream)
        out.stream = None

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
