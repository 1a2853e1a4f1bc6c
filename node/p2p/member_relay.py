"""A member's relay: py-libp2p 0.8.1's circuit relay v2 hop, for the swarm's members only.

A publicly reachable member relays for members behind NAT (docs/nat.md); strangers get their
HOP stream reset before py-libp2p reads a byte of it, so they can neither reserve a slot nor
open a circuit. The limits are sized for training traffic, not for signalling:
py-libp2p's relay cut a circuit at its data limit (benchmarks/nat_relay.py, 4 MiB), and one
relay carried 5-8 MB/s here, about 30 GB an hour.
"""

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
from libp2p.abc import INetStream
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.tools.anyio_service import background_trio_service

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.node.p2p.peer_host import NETWORK_ERRORS, HostService, PeerHost, reset_quietly

logger = get_logger(__name__)
_CHUNK = 1 << 16  # what one read of a circuit's side takes at most (py-libp2p's own is 65535)


@dataclass(frozen=True, kw_only=True)
class MemberRelayConfig:
    circuit_bytes: int = 1 << 40  # a day of activations at the relay's measured rate, and more
    circuit_s: int = 24 * 3600
    reservation_s: int = 3600  # refreshed by the member that holds it
    max_circuits: int = 16
    max_reservations: int = 16

    def __post_init__(self) -> None:
        ranges = {
            "circuit_bytes": (1 << 20, 1 << 50),
            "circuit_s": (60, 7 * 86400),
            "reservation_s": (60, 86400),
            "max_circuits": (1, 1024),
            "max_reservations": (1, 1024),
        }
        for name, (low, high) in ranges.items():
            value = getattr(self, name)
            if not (isinstance(value, int) and low <= value <= high):
                raise ConfigError(f"{name} must be an int in [{low}, {high}], got {value!r}")

    def limits(self) -> RelayLimits:
        return RelayLimits(
            duration=self.circuit_s,
            data=self.circuit_bytes,
            max_circuit_conns=self.max_circuits,
            max_reservations=self.max_reservations,
            reservation_ttl=self.reservation_s,
        )


class _Circuits(CircuitV2Protocol):
    """py-libp2p 0.8.1's hop, each circuit's pump ending its own two streams only.

    Its pump files a circuit's streams under its ends' peer ids (``_active_relays``) and, when
    a direction ends, closes what that table holds for the peer: a newer circuit to the same
    member (another home dialling it) had replaced the entry, so the older circuit's end
    closed the newer one's streams. Its dialler's connection then broke; a new stream redialled
    through a fresh circuit, but a frame under way was lost (docs/nat.md: relayed 1 MiB frames
    stalled). Its pump also took yamux's EOF and reset for unexpected errors, read again after
    sleeps, and logged "Error relaying data" for every circuit that ended."""

    async def _relay_data(
        self,
        src_stream: INetStream,
        dst_stream: INetStream,
        peer_id: object,
        deadline: float | None = None,
        circuit_data_limit: list[int] | None = None,
    ) -> None:
        """One direction of a circuit; ``circuit_data_limit`` is shared by both (bytes left)."""
        try:
            while deadline is None or time.monotonic() < deadline:
                data = await src_stream.read(_CHUNK)
                if not data:
                    break
                if circuit_data_limit is not None:
                    if len(data) > circuit_data_limit[0]:
                        logger.info("circuit for %s reached its data limit", peer_id)
                        break
                    circuit_data_limit[0] -= len(data)
                with trio.fail_after(self.write_timeout):
                    await dst_stream.write(data)
        except (*NETWORK_ERRORS, trio.TooSlowError) as exc:
            logger.debug("circuit for %s ended: %r", peer_id, exc)
        finally:
            # The other direction reads a reset stream and ends too: a circuit is one
            # connection, of no use half gone.
            for stream in (src_stream, dst_stream):
                await reset_quietly(stream)
            for key, pair in list(self._active_relays.items()):
                if src_stream in pair or dst_stream in pair:
                    del self._active_relays[key]


class MemberRelay:
    """Relays for ``is_member`` peers on ``host``; ``counts`` has "refused" (strangers)."""

    def __init__(
        self, host: PeerHost, config: MemberRelayConfig, *, is_member: Callable[[str], bool]
    ) -> None:
        self._host = host
        self._config = config
        self._is_member = is_member
        self._protocol: _Circuits | None = None
        self._service: HostService | None = None
        self.counts = {"refused": 0}

    def start(self) -> "MemberRelay":
        self._service = self._host.start_service(self._serve, name="member-relay")
        return self

    def stop(self) -> None:
        if self._service is not None:
            self._service.stop()

    @asynccontextmanager
    async def _serve(self) -> AsyncIterator[None]:
        libp2p = self._host.libp2p
        self._protocol = _Circuits(libp2p, limits=self._config.limits(), allow_hop=True)
        async with background_trio_service(self._protocol):
            await self._protocol.event_started.wait()
            # the protocol registered its own HOP handler: ours goes in front of it
            libp2p.set_stream_handler(HOP_PROTOCOL, self._hop)
            yield

    async def _hop(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        if not self._is_member(peer):
            self.counts["refused"] += 1
            logger.debug("relay refused to %s: not a member", peer)
            await reset_quietly(stream)
            return
        assert self._protocol is not None
        await self._protocol._handle_hop_stream(stream)
