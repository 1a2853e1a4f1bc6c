"""An in-process data plane: transports that hand frames between threads, and faults to inject.

``MemoryNetwork`` hands out one ``MemoryTransport`` per peer id. A ``MemoryTransport`` has the
surface of ``fusionllm.node.p2p.transport.Transport`` that the pipeline uses -- ``peer_id``,
``send_async`` (a ``concurrent.futures.Future``), ``send``, ``recv`` (``Received``; DeadlineError
on timeout, TransportClosedError once closed), ``stats`` (``PeerStats`` per peer) and ``close``
-- and refuses what the real one refuses, in the same order: the frame's prefix and header as
``framing`` writes and parses them (a body over the receiver's limit is refused before it is
looked at), the body with ``unpack_tensor`` under the receiver's ``FrameLimits`` (NaN and
infinities included), then the tensor against the receiver's ``expect(header)`` spec. A refused
frame never reaches ``recv``: it is counted against its sender (``stats()[sender].errors``) and
the sender sees its stream ended (``streams_ended_by_peer``), as over py-libp2p.

Delivery is synchronous: a frame is in the receiver's inbox (or refused) before ``send_async``
returns its already resolved future, so runs are deterministic up to thread scheduling. A
receiver that is gone fails the future with TransportError, like a reset stream.

``shape_link`` gives a link a delay and a rate (memory_links): a frame's future resolves as
the link has sent it, the frame arrives a delay later, so timeouts meet a slow link.

Where it is kinder than py-libp2p (what a test here cannot show): frames between two peers
arrive in the order sent (the real transport promises delivery, not order, for concurrent
sends); ``send_async`` never blocks (no ``max_in_flight`` backpressure, no bounded inbox); a
refused frame costs only itself (over a real stream, frames written after it before the sender
notices the reset are lost too); peer ids are any non-empty strings, not libp2p ids.

Faults, for tests:

- ``kill(peer)``: its transport closes (its ``recv`` and ``send_async`` raise
  TransportClosedError); frames sent to it fail with TransportError.
- ``stall(peer)`` / ``resume(peer)``: frames the peer sends are held, their futures pending,
  until ``resume`` delivers them in order or their send timeout passes (DeadlineError).
- ``drop``, ``corrupt``, ``kill_on`` and ``stall_on``: a ``Fault`` applied to the next
  ``times`` frames that match a ``FrameMatch``; ``Fault.fired`` is an event to wait on
  (``fired_at`` its time), ``Fault.hits`` a count. ``tap`` records frames, changing nothing.
"""

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Self

from fusionllm.common.errors import ConfigError, PeerError
from fusionllm.common.logs import get_logger
from fusionllm.compression import DEFAULT_LIMITS, FrameLimits, decode_frame, parse_frame
from fusionllm.node.errors import DeadlineError, TransportClosedError, TransportError
from fusionllm.node.p2p.framing import (
    MAX_BODY_BYTES,
    PREFIX_BYTES,
    FrameHeader,
    FrameKind,
    encode_head,
    parse_prefix,
)
from fusionllm.node.p2p.transport import PeerStats, Received, SpecFor
from fusionllm.node.p2p.transport_types import (  # the real transport's own pieces
    CLOSED,
    Deliver,
    _Counters,
    take_from_inbox,
)
from tests.support.memory_links import LinkShape, SlowLinks

logger = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class MemoryTransportConfig:
    """The parts of ``TransportConfig`` that decide what a transport sends and accepts."""

    write_timeout_s: float = 60.0  # send_async's default timeout
    max_frame_bytes: int = 256 << 20  # the pack_tensor bytes of one frame
    limits: FrameLimits = DEFAULT_LIMITS
    pin_decoded: bool = False  # as TransportConfig's: decode into pinned memory (CUDA)

    def __post_init__(self) -> None:
        if not self.write_timeout_s > 0:
            raise ConfigError(f"write_timeout_s must be > 0, got {self.write_timeout_s}")
        if not 64 <= self.max_frame_bytes <= MAX_BODY_BYTES:
            raise ConfigError(
                f"max_frame_bytes must be in [64, {MAX_BODY_BYTES}], got {self.max_frame_bytes}"
            )

    @property
    def max_body_bytes(self) -> int:
        return min(self.max_frame_bytes, self.limits.max_frame_bytes)


@dataclass(frozen=True)
class Frame:
    """One frame on its way: who sends it to whom, its header, its ``pack_tensor`` bytes."""

    src: str
    dst: str
    header: FrameHeader
    body: bytes


@dataclass(frozen=True, kw_only=True)
class FrameMatch:
    """Frames a fault applies to; a field left None matches anything."""

    src: str | None = None
    dst: str | None = None
    kind: FrameKind | None = None
    step: int | None = None
    tag: int | None = None  # the header's micro_batch: a micro-batch, or a control tag

    def __call__(self, frame: Frame) -> bool:
        header = frame.header
        return (
            (self.src is None or frame.src == self.src)
            and (self.dst is None or frame.dst == self.dst)
            and (self.kind is None or header.kind is self.kind)
            and (self.step is None or header.step == self.step)
            and (self.tag is None or header.micro_batch == self.tag)
        )


# What a fault does to a frame: the frame to send on (maybe changed), or None to lose it.
Action = Callable[[Frame], Frame | None]


class Fault:
    """A rule on the network: ``action`` on the next ``times`` frames that ``match``."""

    def __init__(self, match: FrameMatch, action: Action, *, times: int) -> None:
        if times < 1:
            raise ValueError(f"times must be >= 1, got {times}")
        self.match = match
        self.action = action
        self.times = times
        self.hits = 0
        self.frames: list[Frame] = []  # the frames it was applied to, as they were sent
        self.fired = threading.Event()  # set at the first hit
        self.fired_at: float | None = None  # time.monotonic() of the first hit

    @property
    def spent(self) -> bool:
        return self.hits >= self.times


@dataclass
class _Held:
    """A frame of a stalled sender, not delivered yet."""

    frame: Frame
    future: Future
    timer: threading.Timer


class MemoryTransport:
    """One peer's end of a ``MemoryNetwork``; made by ``MemoryNetwork.transport``."""

    def __init__(
        self,
        network: "MemoryNetwork",
        peer_id: str,
        *,
        expect: SpecFor | None,
        config: MemoryTransportConfig,
    ) -> None:
        self.network = network
        self.peer_id = peer_id
        self.config = config
        self.addrs = [f"/memory/{peer_id}"]
        self._expect = expect
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()  # guards _counters and _closed
        self._counters: dict[str, _Counters] = {}
        self._closed = False
        self._deliver: Deliver | None = None

    # ----- the Transport surface ------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    def send_async(
        self, peer: str, header: FrameHeader, body: bytes, *, timeout: float | None = None
    ) -> "Future[None]":
        """Deliver one frame (``body`` = ``pack_tensor`` bytes) to ``peer``; see the module doc."""
        timeout = self.config.write_timeout_s if timeout is None else timeout
        if len(body) > self.config.max_frame_bytes:
            raise ValueError(f"frame of {len(body)} bytes exceeds max_frame_bytes")
        encode_head(header, len(body))  # the real transport's checks of what it is given
        if not isinstance(peer, str) or not peer:
            raise ValueError(f"not a peer id: {peer!r}")
        if self.closed:
            raise TransportClosedError("transport is not running")
        future: Future[None] = Future()
        self.network._send(Frame(self.peer_id, peer, header, bytes(body)), future, timeout)
        return future

    def send(
        self, peer: str, header: FrameHeader, body: bytes, *, timeout: float | None = None
    ) -> None:
        """Send one frame and wait until it is delivered (see ``send_async``)."""
        timeout = self.config.write_timeout_s if timeout is None else timeout
        self.send_async(peer, header, body, timeout=timeout).result()  # resolves by `timeout`

    def recv(self, *, timeout: float | None = None) -> Received:
        """The next received frame from any peer; DeadlineError if none within ``timeout``."""
        return take_from_inbox(self._inbox, timeout)

    def deliver_to(self, deliver: Deliver | None) -> None:
        """Hand frames to ``deliver`` (in the sender's thread here) instead of the inbox."""
        self._deliver = deliver

    def stats(self) -> dict[str, PeerStats]:
        """Per-peer counters, a consistent snapshot."""
        with self._lock:
            return {peer: PeerStats.of(c) for peer, c in self._counters.items()}

    def close(self) -> None:
        """Stop: ``recv`` wakes with TransportClosedError, frames to us fail from now on."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(CLOSED)
        self.network._closed(self.peer_id)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----- the network's side ---------------------------------------------------------------------

    def _count(self, peer: str) -> _Counters:
        # Called with self._lock held.
        counters = self._counters.get(peer)
        if counters is None:
            counters = self._counters[peer] = _Counters()
        return counters

    def _sent(self, peer: str, wire_bytes: int, *, refused: bool) -> None:
        with self._lock:
            counters = self._count(peer)
            counters.frames_out += 1
            counters.bytes_out += wire_bytes
            counters.streams_ended_by_peer += refused

    def _receive(self, frame: Frame) -> bool:
        """Check and file one frame as the real reader does; False if refused or closed."""
        try:
            head = encode_head(frame.header, len(frame.body))
            header_len, body_len = parse_prefix(
                head[:PREFIX_BYTES], max_body_bytes=self.config.max_body_bytes
            )
            header = FrameHeader.from_wire(head[PREFIX_BYTES : PREFIX_BYTES + header_len])
            parsed = parse_frame(frame.body, limits=self.config.limits)
            tensor = decode_frame(parsed, pin_memory=self.config.pin_decoded)
            spec = self._expect(header) if self._expect is not None else None
            if spec is not None:
                spec.check(tensor)
        except PeerError as exc:
            with self._lock:
                self._count(frame.src).errors[type(exc).__name__] += 1
            logger.debug("refused a frame from %s", frame.src, exc_info=True)
            return False
        with self._lock:
            if self._closed:
                return False
            counters = self._count(frame.src)
            counters.frames_in += 1
            counters.bytes_in += body_len
        received = Received(frame.src, header, tensor)
        deliver = self._deliver
        if deliver is None or not deliver(received):
            self._inbox.put(received)
        return True


class MemoryNetwork:
    """Peers in one process; use as a context manager, or ``close`` it (fails held frames)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._transports: dict[str, MemoryTransport] = {}
        self._stalled: set[str] = set()
        self._held: dict[str, list[_Held]] = {}
        self._faults: list[Fault] = []
        self._links = SlowLinks()

    def shape_link(
        self, src: str, dst: str, *, delay_s: float = 0.0, rate: float | None = None,
        both_ways: bool = True,
    ) -> None:  # fmt: skip
        """Frames ``src`` -> ``dst`` (and back) take ``delay_s``, leave at ``rate`` B/s."""
        shape = LinkShape(delay_s=delay_s, rate=rate)
        self._links.shape(src, dst, shape, both_ways=both_ways)

    def transport(
        self,
        peer_id: str,
        *,
        expect: SpecFor | None = None,
        config: MemoryTransportConfig | None = None,
    ) -> MemoryTransport:
        """A new peer on this network (started: it can send and receive at once)."""
        config = MemoryTransportConfig() if config is None else config
        with self._lock:
            if peer_id in self._transports:
                raise ValueError(f"peer {peer_id!r} is already on this network")
            transport = MemoryTransport(self, peer_id, expect=expect, config=config)
            self._transports[peer_id] = transport
        return transport

    def close(self) -> None:
        """Close every transport; frames still held fail with TransportClosedError."""
        with self._lock:
            transports = list(self._transports.values())
            self._stalled.clear()
        self._links.close()
        for transport in transports:
            transport.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----- faults ---------------------------------------------------------------------------------

    def kill(self, peer: str) -> None:
        """The peer dies: its transport closes, frames to it fail, frames it held are lost."""
        self._transports[peer].close()

    def stall(self, peer: str) -> None:
        """Hold every frame ``peer`` sends from now on (until ``resume`` or their timeout)."""
        with self._lock:
            self._stalled.add(peer)

    def resume(self, peer: str) -> None:
        """Deliver what ``peer`` sent while stalled (in order, unless timed out) and go on."""
        with self._lock:
            self._stalled.discard(peer)
            held = self._held.pop(peer, [])
        for item in held:
            item.timer.cancel()
            if not item.future.done():
                self._route(item.frame, item.future, math.inf)

    def add_fault(self, match: FrameMatch, action: Action, *, times: int = 1) -> Fault:
        """Apply ``action`` to the next ``times`` frames that ``match``; faults apply in order."""
        fault = Fault(match, action, times=times)
        with self._lock:
            self._faults.append(fault)
        return fault

    def tap(self, match: FrameMatch) -> Fault:
        """Record every matching frame (``Fault.frames``) and let it pass unchanged."""
        return self.add_fault(match, lambda frame: frame, times=1 << 62)

    def drop(self, match: FrameMatch, *, times: int = 1) -> Fault:
        """Lose matching frames on the way: the sender's send succeeds, nobody receives them."""
        return self.add_fault(match, lambda frame: None, times=times)

    def corrupt(
        self, match: FrameMatch, mutate: Callable[[bytes], bytes], *, times: int = 1
    ) -> Fault:
        """Replace matching frames' bodies by ``mutate(body)``; the receiver checks what comes."""
        return self.add_fault(
            match, lambda frame: replace(frame, body=bytes(mutate(frame.body))), times=times
        )

    def kill_on(self, match: FrameMatch, peer: str) -> Fault:
        """Kill ``peer`` as the first matching frame is sent (then that frame, too, fails)."""

        def die(frame: Frame) -> Frame:
            self.kill(peer)
            return frame

        return self.add_fault(match, die)

    def stall_on(self, match: FrameMatch, peer: str) -> Fault:
        """Stall ``peer`` as the first matching frame is sent (held too, if ``peer`` sends it)."""

        def hang(frame: Frame) -> Frame:
            self.stall(peer)
            return frame

        return self.add_fault(match, hang)

    # ----- delivery -------------------------------------------------------------------------------

    def _send(self, frame: Frame, future: Future, timeout: float) -> None:
        with self._lock:
            fault = next((f for f in self._faults if not f.spent and f.match(frame)), None)
            if fault is not None:
                fault.hits += 1
                fault.frames.append(frame)
                if fault.fired_at is None:
                    fault.fired_at = time.monotonic()
        if fault is not None:
            fault.fired.set()
            changed = fault.action(frame)
            if changed is None:
                logger.debug("dropped %s", frame.header)
                self._transports[frame.src]._sent(frame.dst, _wire_bytes(frame), refused=False)
                future.set_result(None)
                return
            frame = changed
        with self._lock:
            if frame.src in self._stalled:
                timer = threading.Timer(timeout, self._expire, args=(frame.src, future, timeout))
                timer.daemon = True
                self._held.setdefault(frame.src, []).append(_Held(frame, future, timer))
                timer.start()
                return
        self._route(frame, future, timeout)

    def _route(self, frame: Frame, future: Future, timeout: float) -> None:
        deliver = lambda: self._deliver(frame, future)  # noqa: E731
        if not self._links.send(frame.src, frame.dst, _wire_bytes(frame), future, timeout, deliver):
            deliver()  # an unshaped link: at once, in this thread

    def _deliver(self, frame: Frame, future: Future) -> None:
        with self._lock:
            sender = self._transports[frame.src]
            receiver = self._transports.get(frame.dst)
        if sender.closed:
            _fail(future, TransportClosedError("transport closed during send"))
        elif receiver is None:
            _fail(future, TransportError(f"send to {frame.dst} failed: no such peer"))
        elif receiver.closed:
            _fail(future, TransportError(f"send to {frame.dst} failed: the peer is gone"))
        else:
            accepted = receiver._receive(frame)
            if not accepted and receiver.closed:
                _fail(future, TransportError(f"send to {frame.dst} failed: the peer is gone"))
                return
            sender._sent(frame.dst, _wire_bytes(frame), refused=not accepted)
            with contextlib.suppress(Exception):  # a timed-out future stays as it was
                future.set_result(None)

    def _expire(self, src: str, future: Future, timeout: float) -> None:
        with self._lock:
            held = self._held.get(src, [])
            self._held[src] = [item for item in held if item.future is not future]
        _fail(future, DeadlineError(f"a frame from {src} was held past its {timeout}s timeout"))

    def _closed(self, peer: str) -> None:
        with self._lock:
            held = self._held.pop(peer, [])
        for item in held:
            item.timer.cancel()
            _fail(item.future, TransportClosedError("transport closed during send"))


def _wire_bytes(frame: Frame) -> int:
    return len(encode_head(frame.header, len(frame.body))) + len(frame.body)


def _fail(future: Future, error: BaseException) -> None:
    if not future.done():
        with contextlib.suppress(Exception):  # resolved meanwhile by another thread
            future.set_exception(error)
