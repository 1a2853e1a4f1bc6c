"""The data plane: tensors to and from peers over lanes or py-libp2p streams, on a PeerHost.

py-libp2p is trio-native and the compute side is plain threads and torch, so the host runs in
its own thread (peer_host.py) and the rest of the node talks to the data plane only through
this class: ``send``/``send_async`` (a ``concurrent.futures.Future``), ``recv`` (a thread-safe
inbox), ``connect``, ``open_lane``, ``stats`` and ``close``. Heavy torch work in the caller's
thread and encryption/muxing in the trio thread then only share the GIL, never an event loop.
Given the node's ``PeerHost`` it attaches ``TENSOR_PROTOCOL`` to it and starts nothing of its
own (closing it detaches and leaves the host running); given none, it makes and owns a host.

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
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, Self

import torch
import trio

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
from fusionllm.node.p2p.limits import InFlight, Refusals
from fusionllm.node.p2p.outbound import WRITE_CHUNK_BYTES, Outbound
from fusionllm.node.p2p.peer_host import NETWORK_ERRORS, HostService, PeerHost
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

# Kept importable from here (benchmarks/transport.py, tests) where the writes moved out.
_WRITE_CHUNK_BYTES = WRITE_CHUNK_BYTES

# Counters of peers that disconnected stay readable (stats) until this many more have gone.
_GONE_PEERS_KEPT = 64


class Transport:
    """A node's tensor transport; use as a context manager or call ``start``/``close``.

    ``host``: the node's PeerHost, already started, to attach to (its key must be
    ``config.key_path``); None: make and own one from ``config.host_config()``.
    ``expect``: what a frame must hold, by header (checked before its tensor is allocated).
    ``admit``: whether a peer may open tensor streams to us at all (None: anyone may); it
    runs in the host's thread at every stream open, so it must be quick and thread-safe.
    ``public_ip``: where members see this node (its reachability verdict), asked from the
    host's thread when a peer is reached through a relay only: with it lanes are punched
    (lane/punch.py); None (the callable, or what it returns): such peers get streams.
    """

    def __init__(
        self,
        config: TransportConfig,
        *,
        expect: SpecFor | None = None,
        admit: AdmitPeer | None = None,
        host: PeerHost | None = None,
        public_ip: Callable[[], str | None] | None = None,
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
        self._inbound: Inbound | None = None
        self._lanes = Lanes(config, host, public_ip=public_ip)
        self._deliver: Deliver | None = None
        self.lane_senders = LaneSenders(self._counters)  # also where lanes' wire figures are
        self._outbound = Outbound(host, self._lanes, self.lane_senders, self._counters,
                                  dial_timeout_s=config.dial_timeout_s)  # fmt: skip

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
        return self.host.call_sync(self._outbound.lane_peers)

    def open_lane(self, peer: str, timeout: float) -> bool:
        """Whether a lane to ``peer`` is open, dialling one if none is (never a libp2p stream),
        waiting at most ``timeout`` s: then it carries frames like any lane (outbound.py).
        False where lanes are off, a stream carries the peer's frames, no lane could be opened
        (relayed, refused, unreachable: lane/service.py backs off), or the wait ran out (the
        open goes on in the trio thread, bounded by ``lane_timeout_s``). Any thread."""
        parse_peer_id(peer)
        if self.lane_senders.has(peer):
            return True
        if not self.config.lanes:
            return False
        self._require_running()
        opened: Future[bool] = Future()
        self.host.run_sync_soon(self._spawn_open_lane, opened, peer)
        try:
            return opened.result(timeout)
        except TimeoutError:  # the future's own wait: it holds a bool or TransportClosedError
            return False

    def punched_lanes(self) -> list[str]:
        """The peers of ``outbound_lanes`` whose lane was punched through NATs (lane/punch.py)."""
        return self.host.call_sync(self._outbound.punched_peers)

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
                self._outbound.nursery = nursery
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
                    self._outbound.nursery = None
                    self._inbound.stop()  # before the lanes' sockets are shut
                    nursery.cancel_scope.cancel()  # sends in flight fail as closed
        finally:
            self._lanes.stop()
            network.remove_notifee(departures)
            # Also ends (resets) the inbound streams still being read.
            self.host.remove_stream_handler(TENSOR_PROTOCOL)
            # Our outbound streams would otherwise stay open on a host that lives on.
            await self._outbound.reset_all()
            self._inbox.put(CLOSED)

    def _route(self, received: Received) -> bool:
        deliver = self._deliver
        return deliver is not None and deliver(received)

    def _spawn_send(
        self, future: Future, peer: str, head: bytes, body: bytes, timeout: float
    ) -> None:
        # Runs as a run_sync_soon callback: it must not raise, or the whole trio run dies.
        try:
            nursery = self._outbound.nursery  # the sends' nursery: set while we serve
            if nursery is None:
                raise RuntimeError("transport stopping")
            nursery.start_soon(self._send_task, future, peer, head, body, timeout)
        except RuntimeError:
            if future.set_running_or_notify_cancel():
                future.set_exception(TransportClosedError("transport closed"))

    def _spawn_open_lane(self, opened: "Future[bool]", peer: str) -> None:
        # A run_sync_soon callback, like _spawn_send: it must not raise.
        try:
            nursery = self._outbound.nursery
            if nursery is None:
                raise RuntimeError("transport stopping")
            nursery.start_soon(self._open_lane_task, opened, peer)
        except RuntimeError:  # stopping, or its nursery closed to new tasks
            opened.set_exception(TransportClosedError("transport closed"))

    async def _open_lane_task(self, opened: "Future[bool]", peer: str) -> None:
        try:
            result = await self._outbound.open_lane(peer)
        except Exception:
            # Lanes.dial takes the failures it knows; anything else is a bug: no lane, the
            # link gets the stream probe, the node keeps its transport.
            logger.warning("opening a lane to %s failed unexpectedly", peer, exc_info=True)
            result = False
        except BaseException:  # trio.Cancelled: the transport is closing
            opened.set_exception(TransportClosedError("transport closed while opening a lane"))
            raise
        opened.set_result(result)

    async def _send_task(
        self, future: Future, peer: str, head: bytes, body: bytes, timeout: float
    ) -> None:
        if not future.set_running_or_notify_cancel():
            return
        error: BaseException | None = None
        try:
            with trio.fail_after(timeout):
                await self._outbound.write_frame(peer, head, body, timeout)
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

    def _forget(self, peer: str) -> None:
        """The peer has no connection left: drop what we keep for it (trio thread)."""
        self._outbound.forget(peer)
        if self._inbound is not None:
            self._inbound.forget(peer)
        self._lanes.forget(peer)
        self._counters.retire(peer)
