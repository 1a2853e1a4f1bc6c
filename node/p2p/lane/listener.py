"""The receiving side of lanes: offers on LANE_PROTOCOL, and the TCP port that redeems them.

Anyone can connect to the port, so a connection holds nothing until it shows a live token:
at most ``_MAX_UNREDEEMED`` connections wait for theirs, each for ``timeout_s``, and a wrong
one is closed at once. A redeemed lane goes to ``serve`` as its ticket's peer, where it is
admitted, limited and read like any tensor stream (inbound.py).
"""

import socket
from collections.abc import Awaitable, Callable

import trio
from libp2p.abc import INetStream

from fusionllm.common.logs import get_logger
from fusionllm.node.errors import TransportError
from fusionllm.node.p2p.checks import address_family
from fusionllm.node.p2p.lane.offer import ACCEPTED, TOKEN_BYTES, Offer, Tickets
from fusionllm.node.p2p.lane.stream import recv_exactly, send_all, tune
from fusionllm.node.p2p.peer_host import NETWORK_ERRORS, close_quietly, reset_quietly

logger = get_logger(__name__)

# Connections to the lane port that have not shown a token yet, all peers together.
_MAX_UNREDEEMED = 32

# Refusal reasons (keys of ``Transport.refusals()``), beside inbound.py's.
LANE_NOT_ADMITTED = "lane_not_admitted"
LANE_NO_TICKET = "lane_tickets_exhausted"
LANE_BAD_TOKEN = "lane_bad_token"
LANE_CROWDED = "lane_too_many_unredeemed"

# Serves a redeemed lane: (the ticket's peer, the connection, the lane's key).
ServeLane = Callable[[str, trio.socket.SocketType, bytes], Awaitable[None]]
Refuse = Callable[[str, str], None]


class LaneListener:
    """Lives in the host's trio thread: ``offer`` is the LANE_PROTOCOL handler, ``serve_port``
    the accept loop (after ``bind``)."""

    def __init__(
        self,
        *,
        serve: ServeLane,
        admit: Callable[[str], bool],
        refuse: Refuse,
        tickets: Tickets,
        timeout_s: float,
        announce_port: int = 0,
    ) -> None:
        self._serve = serve
        self._announce_port = announce_port  # a forward's port, named in offers (0: ours)
        self._admit = admit
        self._refuse = refuse
        self._tickets = tickets
        self._timeout_s = timeout_s
        self._sock: trio.socket.SocketType | None = None
        self._unredeemed = 0
        self.port = 0

    async def bind(self, host: str, port: int) -> int:
        """Listen on ``host``:``port`` (0: a free port); returns the port."""
        sock = trio.socket.socket(address_family("listen_host", host), socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            await sock.bind((host, port))
            sock.listen(64)
        except OSError as exc:
            sock.close()
            raise TransportError(f"cannot listen for lanes on {host}:{port}: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.port = sock.getsockname()[1]
        return self.port

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()

    async def offer(self, stream: INetStream) -> None:
        """LANE_PROTOCOL: a ticket for the Noise-authenticated peer, or a reset stream."""
        peer = stream.muxed_conn.peer_id.to_base58()
        ticket = None
        if self._admitted(peer):
            ticket = self._tickets.issue(peer)
            if ticket is None:
                self._refuse(LANE_NO_TICKET, peer)
        if ticket is None:
            await reset_quietly(stream)  # the sender falls back to a tensor stream
            return
        token, key = ticket
        offer = Offer(port=self._announce_port or self.port, token=token, key=key)
        try:
            with trio.fail_after(self._timeout_s):
                await stream.write(offer.to_wire())
        except (trio.TooSlowError, *NETWORK_ERRORS):
            logger.debug("a lane offer to %s failed", peer, exc_info=True)
            await reset_quietly(stream)
            return
        await close_quietly(stream)

    def _admitted(self, peer: str) -> bool:
        admitted = self._admit(peer)
        if not admitted:
            self._refuse(LANE_NOT_ADMITTED, peer)
        return admitted

    async def serve_port(self, nursery: trio.Nursery) -> None:
        """Accept connections until cancelled; each gets ``timeout_s`` to show its token."""
        assert self._sock is not None
        while True:
            conn, _ = await self._sock.accept()
            if self._held(conn):
                nursery.start_soon(self._redeem, conn)

    async def redeem(self, conn: trio.socket.SocketType) -> None:
        """A connection made another way (a hole punch, punch.py), held to the same token
        check as one accepted on the port, and within the same bound."""
        if self._held(conn):
            await self._redeem(conn)

    def _held(self, conn: trio.socket.SocketType) -> bool:
        """Count ``conn`` among those waiting to show a token; refused and closed when too
        many already wait."""
        if self._unredeemed >= _MAX_UNREDEEMED:
            self._refuse(LANE_CROWDED, "an unnamed connection")
            conn.close()
            return False
        self._unredeemed += 1
        return True

    async def _redeem(self, conn: trio.socket.SocketType) -> None:
        try:
            redeemed = await self._take_token(conn)
        finally:
            self._unredeemed -= 1
        if redeemed is None:
            conn.close()
            return
        peer, key = redeemed
        await self._serve(peer, conn, key)

    async def _take_token(self, conn: trio.socket.SocketType) -> tuple[str, bytes] | None:
        """The ticket's (peer, key) once the connection showed a live token and was told so."""
        token = bytearray(TOKEN_BYTES)
        got = 0
        with trio.move_on_after(self._timeout_s):
            try:
                got = await recv_exactly(conn, memoryview(token))
            except NETWORK_ERRORS:
                logger.debug("a lane connection failed before its token", exc_info=True)
        redeemed = self._tickets.redeem(token) if got == TOKEN_BYTES else None
        if redeemed is None:
            self._refuse(LANE_BAD_TOKEN, "an unnamed connection")
            return None
        tune(conn)
        try:
            with trio.fail_after(self._timeout_s):
                await send_all(conn, ACCEPTED)
        except (trio.TooSlowError, *NETWORK_ERRORS):
            logger.debug("a lane from %s failed before it opened", redeemed[0], exc_info=True)
            return None
        return redeemed
