"""Lanes for one transport: its listener, and which peers to try a lane to (trio thread only)."""

import trio
from libp2p.abc import IHost

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.node.p2p.lane.dial import LaneRefusedError, open_lane
from fusionllm.node.p2p.lane.listener import LaneListener, Refuse, ServeLane
from fusionllm.node.p2p.lane.offer import LANE_PROTOCOL, Tickets
from fusionllm.node.p2p.lane.punch import (
    PUNCH_PROTOCOL,
    PublicIp,
    PunchError,
    PunchFrom,
    PunchServer,
)
from fusionllm.node.p2p.lane.stream import LaneWriter
from fusionllm.node.p2p.peer_host import NETWORK_ERRORS, PeerHost
from fusionllm.node.p2p.transport_types import AdmitPeer, TransportConfig

logger = get_logger(__name__)

# However often a peer's lane failed, a new try comes at least this often.
_MAX_RETRY_S = 3600.0
# After a refused offer (one round trip, no port to wait on): a member whose peer adopts the
# plan a moment later (off loopback, view changes land up to an epoch apart) gets its lane
# seconds later instead of sending over a stream for a whole retry_s.
REFUSED_RETRY_S = 2.0


class RetryAfter:
    """When to try a lane to a peer again: ``retry_s`` after a failure, doubling with each
    failure in a row (up to an hour). A filtered port costs a send the whole lane timeout
    at each try, so a peer behind NAT should not cost one every ``retry_s``."""

    def __init__(self, retry_s: float) -> None:
        self._retry_s = retry_s
        self._failures: dict[str, tuple[int, float]] = {}  # peer -> (in a row, next try at)

    def allowed(self, peer: str, now: float) -> bool:
        entry = self._failures.get(peer)
        return entry is None or now >= entry[1]

    def failed(self, peer: str, now: float, *, refused: bool = False) -> float:
        """Count a failure (``refused``: the peer refused an offer, which backs off from
        ``REFUSED_RETRY_S``); returns the seconds until the next try."""
        count = self._failures.get(peer, (0, 0.0))[0] + 1
        base = min(REFUSED_RETRY_S, self._retry_s) if refused else self._retry_s
        delay = min(base * 2 ** min(count - 1, 32), max(_MAX_RETRY_S, self._retry_s))
        self._failures[peer] = (count, now + delay)
        return delay

    def forget(self, peer: str) -> None:
        """A lane opened, or the peer left: the next failure starts the count again."""
        self._failures.pop(peer, None)


class Lanes:
    """Serves lanes to this node while ``serving`` runs, and opens lanes to peers."""

    def __init__(
        self, config: TransportConfig, host: PeerHost, *, public_ip: PublicIp | None = None
    ) -> None:
        self.config = config
        self._host = host
        self._listener: LaneListener | None = None
        self._retry = RetryAfter(config.lane_retry_s)  # on the trio clock
        # Peers reached through a relay only get a punched lane while members tell us where
        # they see us (None: never punch).
        self._punch = None if public_ip is None else PunchFrom(
            public_ip=public_ip, bind_host=host.config.listen_host
        )  # fmt: skip
        self._punch_told: set[str] = set()  # peers whose failed punch the log told of

    @property
    def port(self) -> int:
        """Where this node accepts lanes; 0 while it accepts none."""
        return self._listener.port if self._listener is not None else 0

    async def start(
        self,
        nursery: trio.Nursery,
        *,
        serve: ServeLane,
        admit: AdmitPeer,
        refuse: Refuse,
    ) -> None:
        """Offer lanes (LANE_PROTOCOL) and accept them on ``config.lane_port``."""
        config = self.config
        tickets = Tickets(
            per_peer=config.max_streams_per_peer,
            total=config.max_inbound_streams,
            ttl_s=config.lane_timeout_s,
        )
        listener = LaneListener(
            serve=serve,
            admit=admit,
            refuse=refuse,
            tickets=tickets,
            timeout_s=config.lane_timeout_s,
            announce_port=config.lane_announce_port,
        )
        port = await listener.bind(self._host.config.listen_host, config.lane_port)
        self._host.set_stream_handler(LANE_PROTOCOL, listener.offer)
        self._listener = listener
        if self._punch is not None:
            punches = PunchServer(
                admit=admit,
                punch=self._punch,
                redeem=lambda conn: nursery.start_soon(listener.redeem, conn),
                timeout_s=config.lane_timeout_s,
            )
            self._host.set_stream_handler(PUNCH_PROTOCOL, punches.serve)
        nursery.start_soon(listener.serve_port, nursery)
        logger.debug("accepting lanes on port %d", port)

    def stop(self) -> None:
        """Offer and accept no more lanes (those open end with the transport's nursery)."""
        if self._listener is None:
            return
        self._host.remove_stream_handler(LANE_PROTOCOL)
        if self._punch is not None:
            self._host.remove_stream_handler(PUNCH_PROTOCOL)
        self._listener.close()
        self._listener = None

    async def dial(self, libp2p: IHost, peer: str) -> LaneWriter | None:
        """A lane to ``peer``, or None (lanes off, or one failed lately: use a stream)."""
        if not self.config.lanes or not self._retry.allowed(peer, trio.current_time()):
            return None
        try:
            lane = await open_lane(libp2p, peer, self.config.lane_timeout_s, punch=self._punch)
        except (FusionError, *NETWORK_ERRORS) as exc:
            refused = isinstance(exc, LaneRefusedError)
            delay = self._retry.failed(peer, trio.current_time(), refused=refused)
            if isinstance(exc, PunchError) and peer not in self._punch_told:
                self._punch_told.add(peer)  # once: behind a symmetric NAT it fails every time
                logger.warning(
                    "no direct path to %s could be punched (%s): its frames go through the relay",
                    peer,
                    exc,
                )
            logger.info(
                "no lane to %s (%s); its frames go over a libp2p stream for %.0fs",
                peer,
                exc,
                delay,
            )
            return None
        self._retry.forget(peer)
        if lane.punched:
            logger.info("punched a direct lane to %s through both NATs", peer)
        return lane

    def forget(self, peer: str) -> None:
        """The peer disconnected: a lane is worth trying again when it comes back."""
        self._retry.forget(peer)
