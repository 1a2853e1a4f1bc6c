"""How a lane is set up: the receiver's offer, and the one-time tickets behind it.

    sender                                    receiver
      | libp2p stream LANE_PROTOCOL (Noise) ->  |  admitted? a ticket free? then:
      | <- offer: version | port | token | key  |  ticket: token -> (sender's peer id, key)
      | TCP connect to (the connection's IP, port)
      | token ->                                |  redeemed once, within the ticket's life
      | <- ACCEPTED                             |  the lane reads as that peer, with that key

The offer travels inside the Noise session, so the token and key reach only the peer Noise
authenticated; the token names the lane's peer, the key seals its chunks (seal.py). Someone
who saw the token on the wire finds it spent, and without the key could not send a chunk.
"""

import secrets
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from libp2p.custom_types import TProtocol

from fusionllm.common.errors import FrameError
from fusionllm.node.p2p.lane.seal import LANE_KEY_BYTES

LANE_PROTOCOL = TProtocol("/fusionllm/lane/1.0.0")
LANE_VERSION = 1
TOKEN_BYTES = 16
ACCEPTED = b"\x01"
_OFFER = struct.Struct(f">BH{TOKEN_BYTES}s{LANE_KEY_BYTES}s")
OFFER_BYTES = _OFFER.size


@dataclass(frozen=True)
class Offer:
    port: int
    token: bytes
    key: bytes

    def to_wire(self) -> bytes:
        return _OFFER.pack(LANE_VERSION, self.port, self.token, self.key)

    @classmethod
    def from_wire(cls, data: bytes | bytearray | memoryview) -> "Offer":
        if len(data) != OFFER_BYTES:
            raise FrameError(f"a lane offer is {OFFER_BYTES} bytes, got {len(data)}")
        version, port, token, key = _OFFER.unpack(data)
        if version != LANE_VERSION:
            raise FrameError(f"lane version {version}; this node speaks {LANE_VERSION}")
        if not 1 <= port <= 65535:
            raise FrameError(f"a lane offer names port {port}")
        return cls(port=port, token=token, key=key)


@dataclass(frozen=True)
class _Ticket:
    peer: str
    key: bytes
    expires_at: float


class Tickets:
    """One-time admissions to lanes, bounded per peer and in total, each for ``ttl_s``.

    A peer may hold ``per_peer`` unredeemed tickets and all peers ``total``: asking for more
    gets none, so asking costs a stranger's target a bounded table, not a growing one.
    """

    def __init__(
        self,
        *,
        per_peer: int,
        total: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._per_peer = per_peer
        self._total = total
        self._ttl_s = ttl_s
        self._clock = clock
        self._tickets: dict[bytes, _Ticket] = {}

    def __len__(self) -> int:
        return len(self._tickets)

    def issue(self, peer: str) -> tuple[bytes, bytes] | None:
        """(token, key) for a lane from ``peer``, or None while it or everyone holds too many."""
        now = self._clock()
        self._drop_expired(now)
        held = sum(1 for ticket in self._tickets.values() if ticket.peer == peer)
        if held >= self._per_peer or len(self._tickets) >= self._total:
            return None
        token = secrets.token_bytes(TOKEN_BYTES)
        key = secrets.token_bytes(LANE_KEY_BYTES)
        self._tickets[token] = _Ticket(peer, key, now + self._ttl_s)
        return token, key

    def redeem(self, token: bytes) -> tuple[str, bytes] | None:
        """(peer, key) of a live ticket, spent by this call; None for any other token."""
        ticket = self._tickets.pop(bytes(token), None)
        if ticket is None or ticket.expires_at < self._clock():
            return None
        return ticket.peer, ticket.key

    def _drop_expired(self, now: float) -> None:
        expired = [token for token, ticket in self._tickets.items() if ticket.expires_at < now]
        for token in expired:
            del self._tickets[token]
