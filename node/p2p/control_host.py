"""The control plane: gossipsub pub/sub and a bandwidth/RTT probe, behind a thread bridge.

Like the data plane (transport.py), the py-libp2p host runs ``trio.run`` in one dedicated
daemon thread and the rest of the node (plain threads) talks to it only through this class:
``connect``, ``subscribe``/``publish``/``recv``, ``probe``, ``stats`` and ``close``. It uses the
node's identity key, so its peer id is the data plane's.

Gossip. Every received message passes, in the trio thread and before it is delivered to
``recv`` or forwarded to anyone: gossipsub's signature check (strict signing: the author is the
key that signed it; unsigned or mis-signed messages are dropped and counted), then ours: one
topic per message, ``max_message_bytes``, a per-author token bucket of
``max_messages_per_peer_per_s``, and the caller's ``validate(topic, author, data)``. A message
any of them rejects is neither delivered nor forwarded.

Probe (``/fusionllm/probe/1.0.0``, one new stream per probe)::

    client: "FLP1" | u64 nbytes          server: 1 status byte (0 ok, else refused, then EOF)
    client: 1 byte  x3                   server: echoes each byte (RTT = min of the 3)
    client: nbytes of payload            server: 1 ack byte once all of it arrived

Bandwidth = nbytes / (time from the first payload byte written to the ack read), so it
includes one RTT; with ~1 MiB payloads that is small except on slow, far links. The server
refuses a request over ``max_probe_bytes``, past ``max_probes_served_per_peer_per_min`` or
past ``max_concurrent_probes_served``; every read runs under a deadline and a misbehaving
prober only gets its own stream reset.
"""

import contextlib
import ipaddress
import math
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID as MESHSUB_V10
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11 as MESHSUB_V11
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V12 as MESHSUB_V12
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.validators import signature_validator
from libp2p.tools.anyio_service import background_trio_service

from fusionllm.common.errors import ConfigError, PeerError
from fusionllm.common.logs import get_logger
from fusionllm.node.errors import (
    ControlError,
    DeadlineError,
    ProbeRefusedError,
    TransportClosedError,
    TransportError,
)
from fusionllm.node.p2p.host import new_secure_host
from fusionllm.node.p2p.identity import load_or_create_identity, peer_id_of

logger = get_logger(__name__)

PROBE_PROTOCOL = TProtocol("/fusionllm/probe/1.0.0")

# py-libp2p drops an outbound RPC over 1 MiB and resets a peer's whole pubsub stream for an
# inbound one; a message half that size always fits one RPC with its signature and envelope.
MAX_GOSSIP_BYTES = 512 << 10
MAX_TOPIC_CHARS = 256
MAX_PROBE_BYTES = 256 << 20

_PROBE_MAGIC = b"FLP1"
_PROBE_HEADER = struct.Struct(">4sQ")
_PROBE_PINGS = 3
_PROBE_OK = 0
_PROBE_TOO_LARGE = 1
_PROBE_TOO_OFTEN = 2
_PROBE_BUSY = 3
_PROBE_REASONS = {
    _PROBE_TOO_LARGE: "too large",
    _PROBE_TOO_OFTEN: "probed too often",
    _PROBE_BUSY: "busy",
}
_PROBE_ACK = b"A"
_PROBE_CHUNK_BYTES = 256 << 10
_PROBE_READ_BYTES = 64 << 10
_PROBE_WINDOW_S = 60.0

# Per-author and per-prober state is kept for at most this many peers; idle entries go first.
_MAX_TRACKED_PEERS = 4096

# Errors py-libp2p and trio raise when a stream or connection breaks under us.
_NETWORK_ERRORS = (
    BaseLibp2pError,
    OSError,
    EOFError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
)


def _positive_seconds(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be a positive finite number of seconds, got {value!r}")


def _int_in(name: str, value: int, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ControlConfig:
    """Everything the control plane needs; all deadlines in seconds."""

    key_path: Path
    listen_host: str = "127.0.0.1"
    listen_port: int = 0  # 0: a free port
    dial_timeout_s: float = 5.0  # connect + security + muxer negotiation
    close_timeout_s: float = 5.0
    # py-libp2p's default heartbeat is 120 s: a new peer would wait minutes to join a mesh.
    gossip_heartbeat_s: float = 1.0
    gossip_degree: int = 6  # gossipsub D, D_low, D_high (go-libp2p's defaults are 6, 5, 12)
    gossip_degree_low: int = 4
    gossip_degree_high: int = 12
    max_message_bytes: int = 64 << 10  # larger gossip messages are dropped and counted
    max_messages_per_peer_per_s: float = 5.0  # per author; excess dropped and counted
    # gossipsub's own per-forwarder, per-topic cap; it also silently limits what we forward of
    # our own messages, so it sits well above the per-author cap (a relay forwards many authors).
    max_forwards_per_peer_per_s: float = 100.0
    inbox_size: int = 1024  # validated messages waiting for recv(); the oldest is dropped
    probe_bytes: int = 1 << 20  # payload of one throughput probe (cap on what we send)
    max_probe_bytes: int = 4 << 20  # largest probe we serve; bigger requests refused
    probe_timeout_s: float = 5.0
    max_probes_served_per_peer_per_min: int = 30  # a peer probing more is refused (cost cap)
    max_concurrent_probes_served: int = 4  # all peers together; more are refused as busy

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_path", Path(self.key_path))
        try:
            ipaddress.ip_address(self.listen_host)
        except ValueError as exc:
            raise ConfigError(
                f"listen_host must be an IP address, got {self.listen_host!r}"
            ) from exc
        _int_in("listen_port", self.listen_port, 0, 65535)
        for name in ("dial_timeout_s", "close_timeout_s", "probe_timeout_s"):
            _positive_seconds(name, getattr(self, name))
        _positive_seconds("gossip_heartbeat_s", self.gossip_heartbeat_s)
        if not 0.05 <= self.gossip_heartbeat_s <= 600:
            raise ConfigError(
                f"gossip_heartbeat_s must be in [0.05, 600], got {self.gossip_heartbeat_s}"
            )
        _int_in("gossip_degree_low", self.gossip_degree_low, 1, 64)
        _int_in("gossip_degree", self.gossip_degree, 1, 64)
        _int_in("gossip_degree_high", self.gossip_degree_high, 1, 64)
        if not self.gossip_degree_low <= self.gossip_degree <= self.gossip_degree_high:
            raise ConfigError(
                "need gossip_degree_low <= gossip_degree <= gossip_degree_high, got "
                f"{self.gossip_degree_low}, {self.gossip_degree}, {self.gossip_degree_high}"
            )
        _int_in("max_message_bytes", self.max_message_bytes, 1, MAX_GOSSIP_BYTES)
        for name in ("max_messages_per_peer_per_s", "max_forwards_per_peer_per_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive finite rate, got {value!r}")
        _int_in("inbox_size", self.inbox_size, 1, 1 << 20)
        _int_in("max_probe_bytes", self.max_probe_bytes, 1, MAX_PROBE_BYTES)
        _int_in("probe_bytes", self.probe_bytes, 1, self.max_probe_bytes)
        _int_in(
            "max_probes_served_per_peer_per_min", self.max_probes_served_per_peer_per_min, 0, 10**6
        )
        _int_in("max_concurrent_probes_served", self.max_concurrent_probes_served, 1, 1024)

    @property
    def listen_multiaddr(self) -> multiaddr.Multiaddr:
        family = "ip6" if ipaddress.ip_address(self.listen_host).version == 6 else "ip4"
        return multiaddr.Multiaddr(f"/{family}/{self.listen_host}/tcp/{self.listen_port}")


@dataclass(frozen=True)
class GossipMessage:
    topic: str
    author: str  # base58 peer id of the key that signed it (checked by gossipsub)
    data: bytes
    received_at: float  # time.time() when it passed validation here


@dataclass(frozen=True)
class ProbeResult:
    peer: str
    bandwidth: float  # bytes/s, payload only
    rtt: float  # s, the fastest of the ping round trips
    bytes: int
    seconds: float  # first payload byte written -> ack read


@dataclass(frozen=True)
class ControlStats:
    messages_accepted: int  # from others, passed every check (then delivered and forwarded)
    dropped_invalid: int  # validate() said no or raised, or a malformed message
    dropped_oversize: int
    dropped_rate: int
    probes_sent: int  # probes of ours that completed
    probes_served: int
    probes_refused: int  # requests we refused (size, rate, busy)
    dropped_bad_signature: int = 0  # unsigned, or the signature does not match the author
    dropped_inbox_full: int = 0  # accepted, but recv() was too slow: the oldest went
    messages_published: int = 0
    probes_failed: int = 0  # probes of ours that failed (refused, timed out, broken)
    probe_errors: int = 0  # probes we served that the peer broke (bad header, stall, reset)
    pubsub_errors: int = 0  # peer messages py-libp2p raised on (contained here, see push_msg)


_COUNTERS = tuple(ControlStats.__dataclass_fields__)


class _Inbox:
    """A bounded, thread-safe FIFO: a full inbox drops its oldest message (counted)."""

    def __init__(self, size: int) -> None:
        self._items: deque[GossipMessage] = deque()
        self._size = size
        self._cond = threading.Condition()
        self._closed = False

    def put(self, item: GossipMessage) -> bool:
        """Append; False if the oldest message had to go to make room."""
        with self._cond:
            dropped = len(self._items) >= self._size
            if dropped:
                self._items.popleft()
            self._items.append(item)
            self._cond.notify()
            return not dropped

    def get(self, timeout: float | None) -> GossipMessage:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._items:
                if self._closed:
                    raise TransportClosedError("control host closed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise DeadlineError(f"no gossip message within {timeout}s")
                self._cond.wait(remaining)
            return self._items.popleft()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class _TokenBuckets:
    """Per-peer token buckets: ``rate`` per second, bursts of up to max(1, rate)."""

    def __init__(self, rate: float) -> None:
        self._rate = rate
        self._burst = max(1.0, rate)
        self._buckets: dict[str, tuple[float, float]] = {}  # peer -> (tokens, at)

    def allow(self, peer: str, now: float) -> bool:
        tokens, at = self._buckets.get(peer, (self._burst, now))
        tokens = min(self._burst, tokens + (now - at) * self._rate)
        allowed = tokens >= 1.0
        self._buckets[peer] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._buckets) > _MAX_TRACKED_PEERS:
            self._forget_idle(now)
        return allowed

    def _forget_idle(self, now: float) -> None:
        # A refilled bucket is the same as no bucket, so forgetting it changes nothing.
        refill_s = self._burst / self._rate
        for peer, (_tokens, at) in list(self._buckets.items()):
            if now - at >= refill_s:
                del self._buckets[peer]


def _signature_ok(msg: rpc_pb2.Message) -> bool:
    try:
        return bool(signature_validator(msg))
    except Exception:  # a malformed key or id raises inside py-libp2p: that is a bad signature
        logger.debug("signature check raised", exc_info=True)
        return False


class _GuardedPubsub(Pubsub):
    """py-libp2p's Pubsub with its peer-facing entry point contained.

    ``push_msg`` runs as a task of the pubsub service for every received message, and an
    exception there stops the whole service (e.g. ``signature_validator`` raises on a malformed
    key instead of returning False). Here it costs only that message. Signature failures, which
    Pubsub drops silently, are counted; delivery goes to our inbox instead of per-topic channels.
    """

    def __init__(
        self,
        host: IHost,
        router: GossipSub,
        *,
        deliver: Callable[[rpc_pb2.Message], None],
        count: Callable[[str], None],
    ) -> None:
        super().__init__(host, router, strict_signing=True)
        self._deliver = deliver
        self._count = count

    async def push_msg(self, msg_forwarder: ID, msg: rpc_pb2.Message) -> None:
        if msg_forwarder == self.my_id:
            await super().push_msg(msg_forwarder, msg)  # our own publish: errors are ours
            return
        try:
            # Pubsub verifies too (after this), but drops failures without telling anyone.
            if not self._is_msg_seen(msg) and not _signature_ok(msg):
                self._count("dropped_bad_signature")
                logger.debug("dropped a badly signed message forwarded by %s", msg_forwarder)
                return
            await super().push_msg(msg_forwarder, msg)
        except Exception:
            self._count("pubsub_errors")
            logger.debug("pubsub failed on a message from %s", msg_forwarder, exc_info=True)

    def notify_subscriptions(self, publish_message: rpc_pb2.Message) -> None:
        self._deliver(publish_message)


class ControlHost:
    """A node's control plane; use as a context manager or call ``start``/``close``.

    ``validate(topic, author, data)`` runs in the trio thread for every message from another
    peer: keep it fast and non-blocking. An exception counts as a rejection.
    """

    def __init__(
        self,
        config: ControlConfig,
        *,
        validate: Callable[[str, str, bytes], bool] | None = None,
    ) -> None:
        self.config = config
        self._validate = validate
        self._key_pair = load_or_create_identity(config.key_path)
        self._peer_id = peer_id_of(self._key_pair)
        self._addrs: list[str] = []
        self._inbox = _Inbox(config.inbox_size)
        self._lock = threading.Lock()  # guards _counters
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._closed = False
        # Owned by the trio thread from here on.
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._host: IHost | None = None
        self._pubsub: _GuardedPubsub | None = None
        self._router: GossipSub | None = None
        self._my_id: ID | None = None
        self._author_rate = _TokenBuckets(config.max_messages_per_peer_per_s)
        self._probes_by_peer: dict[str, deque[float]] = {}
        self._probe_slots: trio.Semaphore | None = None
        self._probe_payload = bytes(min(_PROBE_CHUNK_BYTES, config.probe_bytes))

    # ----- lifecycle (any thread) -------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def listen_addrs(self) -> list[str]:
        """Full multiaddrs, ``/ip4/.../tcp/.../p2p/<peer id>``; empty until started."""
        return list(self._addrs)

    def start(self) -> Self:
        """Start the trio thread and wait until the host listens; raises if it cannot."""
        if self._thread is not None:
            raise ControlError("control host already started")
        self._thread = threading.Thread(target=self._run, name="fusionllm-control", daemon=True)
        self._thread.start()
        if not self._started.wait(self.config.dial_timeout_s + self.config.close_timeout_s):
            self.close()
            raise DeadlineError("the control host did not start listening in time")
        if self._start_error is not None or self._token is None:
            self.close()
            raise ControlError(f"the control host failed to start: {self._start_error!r}")
        logger.info("control host %s listening on %s", self._peer_id, self._addrs)
        return self

    def close(self) -> None:
        """Stop the trio thread (bounded by close_timeout_s); recv() wakes with an error."""
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
                    "control thread still running %ss after close", self.config.close_timeout_s
                )
        self._inbox.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----- the bridge (caller threads) --------------------------------------------------------

    def connect(self, maddr: str, *, timeout: float | None = None) -> str:
        """Dial a ``/ip4/.../tcp/.../p2p/<peer id>`` address; returns the peer id."""
        timeout = self.config.dial_timeout_s if timeout is None else timeout
        _positive_seconds("timeout", timeout)
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(maddr))
        except Exception as exc:  # multiaddr raises assorted types for bad text
            raise ControlError(f"not a peer address: {maddr!r}: {exc}") from exc
        self._call(self._connect, info, timeout)
        return info.peer_id.to_base58()

    def connected_peers(self) -> list[str]:
        return self._call_sync(
            lambda: sorted(peer.to_base58() for peer in self._require_host().get_connected_peers())
        )

    def subscribe(self, topic: str) -> None:
        """Receive (through ``recv``) and forward validated messages on ``topic``."""
        _check_topic(topic)
        self._call(self._subscribe, topic)

    def unsubscribe(self, topic: str) -> None:
        _check_topic(topic)
        self._call(self._unsubscribe, topic)

    def publish(self, topic: str, data: bytes) -> None:
        """Sign and send ``data`` to the topic's peers; we need not be subscribed."""
        _check_topic(topic)
        data = bytes(data)
        if len(data) > self.config.max_message_bytes:
            raise ValueError(
                f"gossip message of {len(data)} bytes exceeds max_message_bytes "
                f"({self.config.max_message_bytes})"
            )
        self._call(self._publish, topic, data)

    def recv(self, *, timeout: float | None = None) -> GossipMessage:
        """The next validated message from another peer; DeadlineError if none in ``timeout``.

        The inbox is shared by all topics and bounded (``inbox_size``): when the caller falls
        behind, the oldest messages are dropped and counted in ``dropped_inbox_full``.
        """
        return self._inbox.get(timeout)

    def topic_peers(self, topic: str) -> list[str]:
        """Connected peers that told us they subscribe to ``topic``."""
        return self._call_sync(
            lambda: sorted(
                peer.to_base58() for peer in self._require_pubsub().peer_topics.get(topic, ())
            )
        )

    def mesh_peers(self, topic: str) -> list[str]:
        """Our gossipsub mesh for ``topic`` (the peers we forward full messages to)."""
        return self._call_sync(
            lambda: sorted(peer.to_base58() for peer in self._require_router().mesh.get(topic, ()))
        )

    def probe(
        self, peer: str, *, nbytes: int | None = None, timeout: float | None = None
    ) -> ProbeResult:
        """Measure RTT and one-way throughput to ``peer`` (connected, or dialable from the
        addresses we know); ProbeRefusedError if it refuses, DeadlineError past ``timeout``."""
        nbytes = self.config.probe_bytes if nbytes is None else nbytes
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise ValueError(f"nbytes must be an int, got {nbytes!r}")
        if not 1 <= nbytes <= self.config.probe_bytes:
            raise ValueError(f"nbytes must be in [1, probe_bytes={self.config.probe_bytes}]")
        timeout = self.config.probe_timeout_s if timeout is None else timeout
        _positive_seconds("timeout", timeout)
        peer_id = _parse_peer_id(peer)
        try:
            result = self._call(self._probe, peer_id, nbytes, timeout)
        except TransportError:
            self._count("probes_failed")
            raise
        self._count("probes_sent")
        return result

    def stats(self) -> ControlStats:
        """The counters since start, a consistent snapshot."""
        with self._lock:
            return ControlStats(**self._counters)

    # ----- helpers for the bridge -------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _require_token(self) -> trio.lowlevel.TrioToken:
        if self._closed or self._token is None:
            raise TransportClosedError("control host is not running")
        return self._token

    def _require_host(self) -> IHost:
        if self._host is None:
            raise TransportClosedError("control host is not running")
        return self._host

    def _require_pubsub(self) -> _GuardedPubsub:
        if self._pubsub is None:
            raise TransportClosedError("control host is not running")
        return self._pubsub

    def _require_router(self) -> GossipSub:
        if self._router is None:
            raise TransportClosedError("control host is not running")
        return self._router

    def _call(self, async_fn: Callable[..., Any], *args: Any) -> Any:
        token = self._require_token()
        try:
            return trio.from_thread.run(async_fn, *args, trio_token=token)
        except (trio.RunFinishedError, trio.Cancelled) as exc:
            # Cancelled: the trio run shut down while our call was in flight.
            raise TransportClosedError("control host closed") from exc

    def _call_sync(self, fn: Callable[[], Any]) -> Any:
        token = self._require_token()
        try:
            return trio.from_thread.run_sync(fn, trio_token=token)
        except trio.RunFinishedError as exc:
            raise TransportClosedError("control host closed") from exc

    # ----- the trio thread: lifecycle ---------------------------------------------------------

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported to start() or logged, never lost
            if not self._started.is_set():
                self._start_error = exc
            else:
                logger.error("control thread failed", exc_info=True)
        finally:
            self._host = self._pubsub = self._router = None
            self._started.set()
            self._inbox.close()

    async def _main(self) -> None:
        config = self.config
        self._stop = trio.Event()
        self._probe_slots = trio.Semaphore(config.max_concurrent_probes_served)
        host = new_secure_host(self._key_pair, negotiate_timeout_s=config.dial_timeout_s)
        router = GossipSub(
            # Newest first: multistream-select takes the first both sides speak.
            protocols=[MESHSUB_V12, MESHSUB_V11, MESHSUB_V10],
            degree=config.gossip_degree,
            degree_low=config.gossip_degree_low,
            degree_high=config.gossip_degree_high,
            # Annotated int, but only ever passed to trio.sleep: a float works.
            heartbeat_interval=config.gossip_heartbeat_s,  # type: ignore[arg-type]
            # Adaptive gossip would reset the heartbeat to 30-60 s whenever its "network
            # health" score dips, undoing the interval above.
            adaptive_gossip_enabled=False,
            spam_protection_enabled=True,
            max_messages_per_topic_per_second=config.max_forwards_per_peer_per_s,
        )
        pubsub = _GuardedPubsub(host, router, deliver=self._deliver, count=self._count)
        with trio.CancelScope() as outer:
            async with (
                host.run(listen_addrs=[config.listen_multiaddr]),
                background_trio_service(pubsub),
                background_trio_service(router),
            ):
                await pubsub.wait_until_ready()
                host.set_stream_handler(PROBE_PROTOCOL, self._serve_probe)
                self._host, self._pubsub, self._router = host, pubsub, router
                self._my_id = host.get_id()
                self._addrs = [str(addr) for addr in host.get_addrs()]
                self._token = trio.lowlevel.current_trio_token()
                self._started.set()
                await self._stop.wait()
                # py-libp2p's own shutdown gets half the close budget, then is cut.
                outer.deadline = trio.current_time() + config.close_timeout_s / 2
                self._host = self._pubsub = self._router = None

    # ----- the trio thread: connections and gossip --------------------------------------------

    async def _connect(self, info: Any, timeout: float) -> None:
        host = self._require_host()
        try:
            with trio.fail_after(timeout):
                await host.connect(info)
        except trio.TooSlowError:
            raise DeadlineError(f"dial to {info.peer_id} timed out after {timeout}s") from None
        except _NETWORK_ERRORS as exc:
            logger.debug("dial to %s failed", info.peer_id, exc_info=True)
            raise ControlError(f"dial to {info.peer_id} failed: {exc}") from exc

    async def _subscribe(self, topic: str) -> None:
        pubsub = self._require_pubsub()
        # The validator goes in first, so no message on the topic is ever taken unchecked.
        pubsub.set_topic_validator(topic, self._check_message, False)
        with trio.fail_after(self.config.close_timeout_s):
            await pubsub.subscribe(topic)

    async def _unsubscribe(self, topic: str) -> None:
        pubsub = self._require_pubsub()
        with trio.fail_after(self.config.close_timeout_s):
            await pubsub.unsubscribe(topic)
        pubsub.remove_topic_validator(topic)

    async def _publish(self, topic: str, data: bytes) -> None:
        pubsub = self._require_pubsub()
        try:
            # Publishing only queues RPCs per peer; the deadline covers a wedged loop.
            with trio.fail_after(self.config.close_timeout_s):
                await pubsub.publish(topic, data)
        except trio.TooSlowError:
            raise DeadlineError(f"publish on {topic!r} did not finish") from None
        except Exception as exc:  # py-libp2p's signing and queueing raise assorted types
            logger.debug("publish on %r failed", topic, exc_info=True)
            raise ControlError(f"publish on {topic!r} failed: {type(exc).__name__}: {exc}") from exc
        self._count("messages_published")

    def _check_message(self, forwarder: ID, msg: rpc_pb2.Message) -> bool:
        """The pubsub topic validator: runs before a message is delivered or forwarded.

        Pubsub has verified the signature by now, so ``from_id`` is the author. Never raises:
        an exception here would end py-libp2p's pubsub service.
        """
        try:
            author = ID(msg.from_id)
            if author == self._my_id:
                return True  # our own publish (publish() checked it)
            verdict = self._verdict(author.to_base58(), msg)
        except Exception:
            logger.debug("checking a message from %s failed", forwarder, exc_info=True)
            verdict = "dropped_invalid"
        self._count(verdict)
        if verdict != "messages_accepted":
            logger.debug("message forwarded by %s: %s", forwarder, verdict)
        return verdict == "messages_accepted"

    def _verdict(self, author: str, msg: rpc_pb2.Message) -> str:
        if len(msg.topicIDs) != 1:
            return "dropped_invalid"  # we publish one topic per message; rate counts per message
        if len(msg.data) > self.config.max_message_bytes:
            return "dropped_oversize"
        # Before the caller's validator, so a flood cannot make us run it at the flood's rate.
        if not self._author_rate.allow(author, time.monotonic()):
            return "dropped_rate"
        if self._validate is not None:
            try:
                ok = self._validate(msg.topicIDs[0], author, bytes(msg.data))
            except Exception:
                logger.debug("validate() raised on a message from %s", author, exc_info=True)
                ok = False
            if ok is not True:
                return "dropped_invalid"
        return "messages_accepted"

    def _deliver(self, msg: rpc_pb2.Message) -> None:
        author = ID(msg.from_id)
        pubsub = self._pubsub
        if author == self._my_id or pubsub is None:
            return
        topics = [topic for topic in msg.topicIDs if topic in pubsub.topic_ids]
        if not topics:
            return
        item = GossipMessage(
            topic=topics[0],
            author=author.to_base58(),
            data=bytes(msg.data),
            received_at=time.time(),
        )
        if not self._inbox.put(item):
            self._count("dropped_inbox_full")

    # ----- the trio thread: probes ------------------------------------------------------------

    async def _probe(self, peer: ID, nbytes: int, timeout: float) -> ProbeResult:
        host = self._require_host()
        stream: INetStream | None = None
        try:
            with trio.fail_after(timeout):
                stream = await host.new_stream(peer, [PROBE_PROTOCOL])
                await stream.write(_PROBE_HEADER.pack(_PROBE_MAGIC, nbytes))
                (status,) = await _read_exactly(stream, 1)
                if status != _PROBE_OK:
                    reason = _PROBE_REASONS.get(status, f"status {status}")
                    raise ProbeRefusedError(f"{peer} refused a probe of {nbytes} bytes: {reason}")
                rtts = []
                for i in range(_PROBE_PINGS):
                    started = time.perf_counter()
                    await stream.write(bytes([i]))
                    echo = await _read_exactly(stream, 1)
                    rtts.append(time.perf_counter() - started)
                    if echo != bytes([i]):
                        raise ControlError(f"{peer} echoed {echo!r} to probe ping {i}")
                started = time.perf_counter()
                payload = self._probe_payload
                sent = 0
                while sent < nbytes:
                    n = min(len(payload), nbytes - sent)
                    await stream.write(payload if n == len(payload) else payload[:n])
                    sent += n
                ack = await _read_exactly(stream, 1)
                seconds = time.perf_counter() - started
                if ack != _PROBE_ACK:
                    raise ControlError(f"{peer} acked a probe with {ack!r}")
            await _close_quietly(stream)
        except trio.TooSlowError:
            await _reset_quietly(stream)
            raise DeadlineError(f"probe of {nbytes} bytes to {peer} took over {timeout}s") from None
        except ControlError:
            await _reset_quietly(stream)
            raise
        except (PeerError, *_NETWORK_ERRORS) as exc:
            await _reset_quietly(stream)
            logger.debug("probe to %s failed", peer, exc_info=True)
            raise ControlError(f"probe to {peer} failed: {type(exc).__name__}: {exc}") from exc
        return ProbeResult(
            peer=peer.to_base58(),
            bandwidth=nbytes / seconds,
            rtt=min(rtts),
            bytes=nbytes,
            seconds=seconds,
        )

    async def _serve_probe(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        try:
            # Twice the client's default deadline: a client within its own deadline is served.
            with trio.fail_after(2 * self.config.probe_timeout_s):
                await self._serve_probe_steps(peer, stream)
        except (trio.TooSlowError, PeerError, *_NETWORK_ERRORS):
            # The prober's fault (or its network's): drop this stream, keep everything else.
            self._count("probe_errors")
            logger.debug("dropping a probe stream from %s", peer, exc_info=True)
            await _reset_quietly(stream)
        except Exception:
            self._count("probe_errors")
            logger.warning("unexpected error serving a probe to %s", peer, exc_info=True)
            await _reset_quietly(stream)

    async def _serve_probe_steps(self, peer: str, stream: INetStream) -> None:
        assert self._probe_slots is not None
        magic, nbytes = _PROBE_HEADER.unpack(await _read_exactly(stream, _PROBE_HEADER.size))
        if magic != _PROBE_MAGIC or nbytes < 1:
            raise PeerError(f"bad probe header from {peer}: {magic!r}, {nbytes}")
        refusal = self._admit_probe(peer, nbytes)
        if refusal == _PROBE_OK:
            try:
                self._probe_slots.acquire_nowait()
            except trio.WouldBlock:
                refusal = _PROBE_BUSY
        if refusal != _PROBE_OK:
            self._count("probes_refused")
            logger.debug("refused a probe of %d bytes from %s: %s", nbytes, peer, refusal)
            await stream.write(bytes([refusal]))
            await _close_quietly(stream)
            return
        try:
            await stream.write(bytes([_PROBE_OK]))
            for _ in range(_PROBE_PINGS):
                await stream.write(await _read_exactly(stream, 1))
            remaining = nbytes
            while remaining:
                chunk = await _read_some(stream, min(remaining, _PROBE_READ_BYTES))
                remaining -= len(chunk)
            # Counted before the ack, so a prober that has its result sees it counted here.
            self._count("probes_served")
            await stream.write(_PROBE_ACK)
        finally:
            self._probe_slots.release()
        await _close_quietly(stream)

    def _admit_probe(self, peer: str, nbytes: int) -> int:
        if nbytes > self.config.max_probe_bytes:
            return _PROBE_TOO_LARGE
        now = time.monotonic()
        recent = self._probes_by_peer.setdefault(peer, deque())
        while recent and now - recent[0] >= _PROBE_WINDOW_S:
            recent.popleft()
        if len(recent) >= self.config.max_probes_served_per_peer_per_min:
            return _PROBE_TOO_OFTEN
        recent.append(now)
        if len(self._probes_by_peer) > _MAX_TRACKED_PEERS:
            for other, times in list(self._probes_by_peer.items()):
                if not times or now - times[-1] >= _PROBE_WINDOW_S:
                    del self._probes_by_peer[other]
        return _PROBE_OK


def _check_topic(topic: str) -> None:
    if not isinstance(topic, str) or not 1 <= len(topic) <= MAX_TOPIC_CHARS:
        raise ValueError(f"topic must be a string of 1..{MAX_TOPIC_CHARS} chars, got {topic!r}")


def _parse_peer_id(peer: str) -> ID:
    try:
        if not isinstance(peer, str) or not peer:
            raise ValueError("empty")
        return ID.from_base58(peer)
    except Exception as exc:  # base58 and multihash raise assorted types
        raise ValueError(f"not a peer id: {peer!r}") from exc


async def _read_some(stream: INetStream, n: int) -> bytes:
    """Up to ``n`` bytes (py-libp2p returns one muxer frame at most); EOF is an error."""
    try:
        data = await stream.read(n)
    except StreamEOF:
        data = b""
    except StreamReset as exc:
        raise PeerError("probe stream reset by peer") from exc
    if not data:
        raise PeerError("probe stream ended early")
    return data


async def _read_exactly(stream: INetStream, n: int) -> bytes:
    buffer = bytearray()
    while len(buffer) < n:
        buffer += await _read_some(stream, n - len(buffer))
    return bytes(buffer)


async def _close_quietly(stream: INetStream | None) -> None:
    if stream is None:
        return
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await stream.close()
        except _NETWORK_ERRORS:
            logger.debug("close of a probe stream failed", exc_info=True)


async def _reset_quietly(stream: INetStream | None) -> None:
    if stream is None:
        return
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await stream.reset()
        except _NETWORK_ERRORS:
            logger.debug("reset of a broken probe stream failed", exc_info=True)
