"""The control plane: gossipsub pub/sub and a bandwidth/RTT probe, as a service on a PeerHost.

The rest of the node (plain threads) talks to it only through this class: ``connect``,
``subscribe``/``publish``/``recv``, ``probe``, ``stats`` and ``close``. Given a ``PeerHost``
(the node's one host, peer_host.py) it attaches its protocols to it and starts nothing of its
own; closing it then detaches them and leaves the host running. Given none, it makes and owns
a host of its own (its peer id is still the node's: same key file).

What a received message must pass before it is delivered or forwarded is in gossip.py; the
probe protocol, its limits and its server are in probes.py.
"""

import contextlib
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import trio
from libp2p.abc import INetwork, INotifee
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID as MESHSUB_V10
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11 as MESHSUB_V11
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.tools.anyio_service import background_trio_service

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.node.errors import (
    ControlError,
    DeadlineError,
    TransportClosedError,
    TransportError,
)
from fusionllm.node.p2p.checks import int_in, parse_peer_id, positive_rate, positive_seconds
from fusionllm.node.p2p.gossip import (
    MAX_GOSSIP_BYTES,
    GossipMessage,
    GuardedPubsub,
    Inbox,
    MessageChecks,
    Validate,
    check_topic,
)
from fusionllm.node.p2p.peer_host import (
    HostConfig,
    HostService,
    PeerHost,
    host_config_of,
    reset_quietly,
)
from fusionllm.node.p2p.probes import (
    MAX_PROBE_BYTES,
    PROBE_PROTOCOL,
    ProbeResult,
    ProbeServer,
    run_probe,
)

__all__ = [
    "MAX_GOSSIP_BYTES",
    "MAX_PROBE_BYTES",
    "PROBE_PROTOCOL",
    "ControlConfig",
    "ControlHost",
    "ControlStats",
    "GossipMessage",
    "ProbeResult",
]

logger = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class ControlConfig:
    """Everything the control plane needs; all deadlines in seconds.

    The first five fields are the host's (``host_config()``), used when the control plane
    runs a host of its own; attached to a node's PeerHost, the host's own config rules.
    """

    key_path: Path
    listen_host: str = "127.0.0.1"
    listen_port: int = 0  # 0: a free port
    dial_timeout_s: float = 5.0  # connect + security + muxer negotiation
    close_timeout_s: float = 5.0
    # py-libp2p's default heartbeat is 120 s: a new peer would wait minutes to join a mesh.
    # Each heartbeat also sends IHAVE to up to 6 peers outside the mesh: at 1 s that was the
    # most RPCs an idle node handled (16 nodes: node process 2.1% of a core at 1 s, 1.8% at 3 s).
    gossip_heartbeat_s: float = 2.0
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
        self.host_config()  # the host's fields are checked in one place: HostConfig
        positive_seconds("probe_timeout_s", self.probe_timeout_s)
        positive_seconds("gossip_heartbeat_s", self.gossip_heartbeat_s)
        if not 0.05 <= self.gossip_heartbeat_s <= 600:
            raise ConfigError(
                f"gossip_heartbeat_s must be in [0.05, 600], got {self.gossip_heartbeat_s}"
            )
        int_in("gossip_degree_low", self.gossip_degree_low, 1, 64)
        int_in("gossip_degree", self.gossip_degree, 1, 64)
        int_in("gossip_degree_high", self.gossip_degree_high, 1, 64)
        if not self.gossip_degree_low <= self.gossip_degree <= self.gossip_degree_high:
            raise ConfigError(
                "need gossip_degree_low <= gossip_degree <= gossip_degree_high, got "
                f"{self.gossip_degree_low}, {self.gossip_degree}, {self.gossip_degree_high}"
            )
        int_in("max_message_bytes", self.max_message_bytes, 1, MAX_GOSSIP_BYTES)
        positive_rate("max_messages_per_peer_per_s", self.max_messages_per_peer_per_s)
        positive_rate("max_forwards_per_peer_per_s", self.max_forwards_per_peer_per_s)
        int_in("inbox_size", self.inbox_size, 1, 1 << 20)
        int_in("max_probe_bytes", self.max_probe_bytes, 1, MAX_PROBE_BYTES)
        int_in("probe_bytes", self.probe_bytes, 1, self.max_probe_bytes)
        int_in(
            "max_probes_served_per_peer_per_min", self.max_probes_served_per_peer_per_min, 0, 10**6
        )
        int_in("max_concurrent_probes_served", self.max_concurrent_probes_served, 1, 1024)

    def host_config(self) -> HostConfig:
        """The host a standalone control plane runs (raises ConfigError for bad fields)."""
        return host_config_of(self)


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


class ControlHost:
    """A node's control plane; use as a context manager or call ``start``/``close``.

    ``validate(topic, author, data)`` runs in the trio thread for every message from another
    peer: keep it fast and non-blocking. An exception counts as a rejection. ``host``: the
    node's PeerHost, already started, to attach to (its key must be ``config.key_path``);
    None: make and own one from ``config.host_config()``.
    """

    def __init__(
        self,
        config: ControlConfig,
        *,
        validate: Validate | None = None,
        host: PeerHost | None = None,
    ) -> None:
        self.config = config
        self._validate = validate
        self._owns_host = host is None
        if host is None:
            host = PeerHost(config.host_config(), thread_name="fusionllm-control")
        else:
            host.require_key(config.key_path)
        self.host = host
        self._inbox = Inbox(config.inbox_size)
        self._lock = threading.Lock()  # guards _counters (trio thread and callers)
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._service: HostService | None = None
        self._started = False
        self._closed = False
        # Set and cleared by the gossip service, in the trio thread.
        self._pubsub: GuardedPubsub | None = None
        self._router: GossipSub | None = None
        self._checks: MessageChecks | None = None

    # ----- lifecycle (any thread) -------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        return self.host.peer_id

    @property
    def listen_addrs(self) -> list[str]:
        """Full multiaddrs, ``/ip4/.../tcp/.../p2p/<peer id>``: the host's; empty until started."""
        return self.host.addrs

    def start(self) -> Self:
        """Start our own host (if we have one) and attach; raises if either fails."""
        if self._started:
            raise ControlError("control host already started")
        self._started = True
        try:
            if self._owns_host:
                self.host.start()
            self._service = self.host.start_service(self._gossip, name="control")
        except BaseException:
            self.close()
            raise
        logger.info("control plane of %s on %s", self.peer_id, self.listen_addrs)
        return self

    def close(self) -> None:
        """Detach (bounded by close_timeout_s) and close our own host, if we have one; recv()
        wakes with TransportClosedError. A shared host keeps running."""
        if self._closed:
            return
        self._closed = True
        if self._service is not None:
            self._service.stop()
        self._inbox.close()
        if self._owns_host:
            self.host.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----- the bridge (caller threads) --------------------------------------------------------

    def connect(self, maddr: str, *, timeout: float | None = None) -> str:
        """Dial a ``/ip4/.../tcp/.../p2p/<peer id>`` address; returns the peer id."""
        self._require_running()
        timeout = self.config.dial_timeout_s if timeout is None else timeout
        try:
            return self.host.connect(maddr, timeout)
        except (DeadlineError, TransportClosedError):
            raise
        except TransportError as exc:  # the control plane's callers expect ControlError
            raise ControlError(str(exc)) from exc

    def connected_peers(self) -> list[str]:
        self._require_running()
        return self.host.connected_peers()

    def subscribe(self, topic: str) -> None:
        """Receive (through ``recv``) and forward validated messages on ``topic``."""
        check_topic(topic)
        self.host.call(self._subscribe, topic)

    def unsubscribe(self, topic: str) -> None:
        check_topic(topic)
        self.host.call(self._unsubscribe, topic)

    def publish(self, topic: str, data: bytes) -> None:
        """Sign and send ``data`` to the topic's peers; we need not be subscribed."""
        check_topic(topic)
        data = bytes(data)
        if len(data) > self.config.max_message_bytes:
            raise ValueError(
                f"gossip message of {len(data)} bytes exceeds max_message_bytes "
                f"({self.config.max_message_bytes})"
            )
        self.host.call(self._publish, topic, data)

    def recv(self, *, timeout: float | None = None) -> GossipMessage:
        """The next validated message from another peer; DeadlineError if none in ``timeout``.

        The inbox is shared by all topics and bounded (``inbox_size``): when the caller falls
        behind, the oldest messages are dropped and counted in ``dropped_inbox_full``.
        """
        return self._inbox.get(timeout)

    def topic_peers(self, topic: str) -> list[str]:
        """Connected peers that told us they subscribe to ``topic``."""
        return self.host.call_sync(
            lambda: sorted(
                peer.to_base58() for peer in self._require_pubsub().peer_topics.get(topic, ())
            )
        )

    def mesh_peers(self, topic: str) -> list[str]:
        """Our gossipsub mesh for ``topic`` (the peers we forward full messages to)."""
        return self.host.call_sync(
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
        positive_seconds("timeout", timeout)
        peer_id = parse_peer_id(peer)
        try:
            result = self.host.call(self._probe, peer_id, nbytes, timeout)
        except TransportError:
            self._count("probes_failed")
            raise
        self._count("probes_sent")
        return result

    def stats(self) -> ControlStats:
        """The counters since start, a consistent snapshot."""
        with self._lock:
            return ControlStats(**self._counters)

    # ----- helpers ----------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _require_running(self) -> None:
        if self._closed or self._service is None or not self._service.running:
            raise TransportClosedError("control host is not running")

    def _require_pubsub(self) -> GuardedPubsub:
        if self._pubsub is None:
            raise TransportClosedError("control host is not running")
        return self._pubsub

    def _require_router(self) -> GossipSub:
        if self._router is None:
            raise TransportClosedError("control host is not running")
        return self._router

    # ----- the trio thread: the service -------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _gossip(self) -> AsyncIterator[None]:
        """Probe server, gossipsub and their stream handlers on the host, until stopped."""
        config, host = self.config, self.host
        network = host.libp2p.get_network()
        registered: list[TProtocol] = []
        notifees: list[INotifee] = []
        pubsub: GuardedPubsub | None = None
        try:
            server = ProbeServer(
                max_bytes=config.max_probe_bytes,
                max_per_peer_per_min=config.max_probes_served_per_peer_per_min,
                max_concurrent=config.max_concurrent_probes_served,
                timeout_s=config.probe_timeout_s,
                count=self._count,
            )
            # First: a host that already carries a control plane refuses here, before Pubsub
            # (below) overwrites that one's gossip handlers.
            host.set_stream_handler(PROBE_PROTOCOL, server.serve)
            registered.append(PROBE_PROTOCOL)
            router = _new_router(config)
            before = list(network.notifees)
            pubsub = GuardedPubsub(host.libp2p, router, deliver=self._deliver, count=self._count)
            notifees = [n for n in network.notifees if n not in before]
            for protocol in router.get_protocols():
                # Pubsub registered these on py-libp2p itself; again through the host, so
                # that detaching also ends the streams they serve.
                host.set_stream_handler(protocol, pubsub.stream_handler)
                registered.append(protocol)
            async with background_trio_service(pubsub), background_trio_service(router):
                await pubsub.wait_until_ready()
                self._checks = MessageChecks(
                    my_id=host.libp2p.get_id(),
                    max_bytes=config.max_message_bytes,
                    rate=config.max_messages_per_peer_per_s,
                    validate=self._validate,
                    count=self._count,
                )
                self._pubsub, self._router = pubsub, router
                try:
                    await _greet_connected(network, notifees, config.close_timeout_s)
                    yield
                finally:
                    self._pubsub = self._router = None
        finally:
            for protocol in reversed(registered):
                host.remove_stream_handler(protocol)  # also resets the inbound gossip streams
            for notifee in notifees:
                network.remove_notifee(notifee)
            # And the outbound ones: peers' readers end now (their pubsub drops us from its
            # mesh at its next write to us).
            for stream in list(pubsub.peers.values()) if pubsub is not None else ():
                await reset_quietly(stream)
            self._inbox.close()

    async def _subscribe(self, topic: str) -> None:
        pubsub = self._require_pubsub()
        # The validator goes in first, so no message on the topic is ever taken unchecked.
        pubsub.set_topic_validator(topic, self._checks, False)
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

    async def _probe(self, peer: ID, nbytes: int, timeout: float) -> ProbeResult:
        self._require_pubsub()  # attached: the probe protocol is ours on this host
        return await run_probe(self.host.libp2p, peer, nbytes, timeout)

    def _deliver(self, msg: rpc_pb2.Message) -> None:
        author = ID(msg.from_id)
        pubsub = self._pubsub
        if pubsub is None or author == pubsub.my_id:
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


def _new_router(config: ControlConfig) -> GossipSub:
    return GossipSub(
        # Newest first: multistream-select takes the first both sides speak. Not v1.2: its
        # IDONTWANT is meant for large messages, but py-libp2p sends one per message to every
        # mesh peer, which doubled the RPCs each small bandwidth report costs a node.
        protocols=[MESHSUB_V11, MESHSUB_V10],
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


async def _greet_connected(network: INetwork, notifees: list[INotifee], timeout: float) -> None:
    """Tell a new Pubsub of the peers connected before it: it only hears of new connections,
    so a control plane attached to a host with peers would otherwise never mesh with them."""
    with trio.move_on_after(timeout):
        for peer, conns in list(network.get_connections_map().items()):
            if not conns:
                continue
            for notifee in notifees:
                await notifee.connected(network, conns[0])
            logger.debug("told gossip of %s, connected before it started", peer)
