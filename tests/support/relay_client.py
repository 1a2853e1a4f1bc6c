"""The client side of py-libp2p's circuit relay v2 on a PeerHost, for tests: accept circuits
(STOP), reserve a slot on a relay, dial a peer through one."""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace

import multiaddr
import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.discovery import RelayDiscovery
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from fusionllm.node.p2p.member_relay import MemberRelayConfig


@asynccontextmanager
async def relay_client(libp2p) -> AsyncIterator[SimpleNamespace]:
    limits = MemberRelayConfig().limits()
    protocol = CircuitV2Protocol(libp2p, limits=limits, allow_hop=False)
    async with background_trio_service(protocol):
        config = RelayConfig(roles=RelayRole.STOP | RelayRole.CLIENT, limits=limits)
        transport = CircuitV2Transport(libp2p, protocol, config)
        discovery = RelayDiscovery(libp2p, auto_reserve=False)
        transport.discovery = discovery
        async with background_trio_service(discovery):
            yield SimpleNamespace(transport=transport, discovery=discovery)


async def reserve(client: SimpleNamespace, relay: ID) -> bool:
    """A slot on ``relay`` (connected already); whether the relay granted it."""
    await client.discovery.discover_relays()
    with trio.fail_after(20):
        return bool(await client.discovery.make_reservation(relay))


async def dial_through(client: SimpleNamespace, relay_addr: str, peer: ID) -> None:
    with trio.fail_after(20):
        await client.transport.dial(multiaddr.Multiaddr(f"{relay_addr}/p2p-circuit/p2p/{peer}"))
