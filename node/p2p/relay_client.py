"""The client side of circuit relay v2 on a node's host: accept circuits, reserve, dial.

A node behind NAT cannot be dialled; it reserves a slot on a member's relay
(node/p2p/member_relay.py) and tells the swarm a relayed address,
``<relay's address>/p2p-circuit/p2p/<its peer id>``. ``RelayClient`` runs py-libp2p 0.8.1's
STOP side (circuits the relay opens to us become connections like any other) and makes
``PeerHost.connect`` dial such addresses. py-libp2p's own discovery looks for relays every
5 min and reserves on its own (docs/nat.md): here nothing is automatic, the caller says
which relay and when (node/control/relay_use.py).
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace

import multiaddr
import trio
from libp2p.connection_types import ConnectionType
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.discovery import RelayDiscovery
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from fusionllm.common.logs import get_logger
from fusionllm.node.errors import TransportError
from fusionllm.node.p2p.member_relay import MemberRelayConfig
from fusionllm.node.p2p.peer_host import NETWORK_ERRORS, HostService, PeerHost

logger = get_logger(__name__)


def relayed_conn(muxed_conn) -> bool:
    """Whether a connection goes through a relay. One py-libp2p cannot type counts as direct:
    0.8.1 types no connection of a private swarm (docs/nat.md), where everything is direct."""
    try:
        return muxed_conn.get_connection_type() is ConnectionType.RELAYED
    except Exception:  # PskConn raises AttributeError; an error here must not end a handler
        return False


class RelayClient:
    """Accepts relayed circuits on ``host`` and dials relayed addresses for it."""

    def __init__(self, host: PeerHost, *, timeout_s: float = 20.0) -> None:
        self._host = host
        self._timeout_s = timeout_s
        self._service: HostService | None = None
        self._parts = SimpleNamespace(transport=None, discovery=None)  # while serving

    def start(self) -> "RelayClient":
        self._service = self._host.start_service(self._serve, name="relay-client")
        self._host.circuit_dialer = self._dial
        return self

    def stop(self) -> None:
        self._host.circuit_dialer = None
        if self._service is not None:
            self._service.stop()

    def reserve(self, relay: str) -> bool:
        """A slot on ``relay`` (a peer we are connected to); whether the relay granted it."""
        return bool(self._host.call(self._reserve, ID.from_base58(relay)))

    @asynccontextmanager
    async def _serve(self) -> AsyncIterator[SimpleNamespace]:
        libp2p = self._host.libp2p
        limits = MemberRelayConfig().limits()
        protocol = CircuitV2Protocol(libp2p, limits=limits, allow_hop=False)
        async with background_trio_service(protocol):
            config = RelayConfig(roles=RelayRole.STOP | RelayRole.CLIENT, limits=limits)
            transport = CircuitV2Transport(libp2p, protocol, config)
            discovery = RelayDiscovery(libp2p, auto_reserve=False)
            transport.discovery = discovery
            async with background_trio_service(discovery):
                self._parts = SimpleNamespace(transport=transport, discovery=discovery)
                yield self._parts

    async def _reserve(self, relay: ID) -> bool:
        discovery = self._parts.discovery
        try:
            with trio.fail_after(self._timeout_s):
                # It reserves only on relays it discovered, and discovery caches the
                # protocols a peer had when identified: a member that started relaying later
                # (its verdict came after we connected) would never show up. The member's
                # record said it relays: that is our discovery.
                await discovery._add_relay(relay)
                return await discovery.make_reservation(relay)
        except (trio.TooSlowError, *NETWORK_ERRORS):
            logger.debug("reservation on %s failed", relay, exc_info=True)
            return False

    async def _dial(self, addr: str) -> None:
        try:
            await self._parts.transport.dial(multiaddr.Multiaddr(addr))
        except (ConnectionError, *NETWORK_ERRORS) as exc:
            raise TransportError(f"dial through a relay to {addr} failed: {exc}") from exc
