"""Lanes between two nodes that only reach each other through a relay: a TCP hole punch.

    sender (lane's writer)                     receiver (the lane's reader)
      | offer over the relayed connection ->    |  (offer.py: token, key; as for a dial)
      | PUNCH_PROTOCOL: our candidate ->        |  admitted? its public IP known? then it
      | <- its candidate                        |  binds its punch port and answers
      | both at once: connect() from the punch port to the other's candidate, while a
      | socket listening on that same port (SO_REUSEPORT) takes the other's SYN if it
      | comes first; the first connection to or from the candidate wins
      | token ->                                |  redeemed as on the lane port
      | <- ACCEPTED                             |  (listener.py: the same ticket check)

A candidate is the IP members saw a node come from (its reachability verdict,
node/p2p/dialback.py) and the local port of its punch socket: a cone router that keeps a
socket's port (the testbed's, most home routers) maps it there for every destination. A
symmetric router gives each destination a port of its own: nothing meets, the punch times
out, and the frames stay on the relayed connection. The punched socket proves nothing by
itself: the token, given only inside the Noise session, names the peer, and the key sealing
every chunk came the same way, exactly as on a dialled lane.

A peer chooses where our connect goes (its candidate), as no dialled lane lets it: only an
admitted member may ask, one punch at a time per peer and ``MAX_PUNCHES`` in all, and a
socket sends nothing before the token check.
"""

import ipaddress
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol

from fusionllm.common.errors import FrameError
from fusionllm.common.logs import get_logger
from fusionllm.node.errors import TransportError
from fusionllm.node.p2p.framing import read_exactly
from fusionllm.node.p2p.peer_host import NETWORK_ERRORS, close_quietly, reset_quietly
from fusionllm.node.p2p.stream_reader import StreamReader

logger = get_logger(__name__)

PUNCH_PROTOCOL = TProtocol("/fusionllm/punch/1.0.0")
_CANDIDATE = struct.Struct(">4sH")  # IPv4, port: NATs that punching gets through are IPv4
CANDIDATE_BYTES = _CANDIDATE.size
MAX_PUNCHES = 8  # punches under way, all peers together (each holds two sockets)
_RETRY_PAUSE_S = 0.05  # after a refused connect (the other side's socket is not there yet)

PublicIp = Callable[[], str | None]
# Hands a punched socket to the lane port's token check (LaneListener.redeem), in a task of
# its own: the lane lives on after the punch.
Redeem = Callable[[trio.socket.SocketType], None]


@dataclass(frozen=True)
class PunchFrom:
    """What this node punches with: where members see it (None: unknown), and the local
    address its punch sockets bind to."""

    public_ip: PublicIp
    bind_host: str


class PunchError(TransportError):
    """No direct path was punched (a symmetric NAT, a refusing or silent peer)."""


@dataclass(frozen=True)
class Candidate:
    """Where a node's punch socket is seen from outside: its public IPv4 and port."""

    ip: str
    port: int

    def __post_init__(self) -> None:
        try:
            ip = ipaddress.IPv4Address(self.ip)
        except ValueError as exc:
            raise FrameError(f"a punch candidate names {self.ip!r}, not an IPv4 address") from exc
        if ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
            raise FrameError(f"a punch candidate names {ip}, where nothing can be reached")
        if not 1 <= self.port <= 65535:
            raise FrameError(f"a punch candidate names port {self.port}")

    def to_wire(self) -> bytes:
        return _CANDIDATE.pack(ipaddress.IPv4Address(self.ip).packed, self.port)

    @classmethod
    def from_wire(cls, data: bytes | bytearray | memoryview) -> "Candidate":
        if len(data) != CANDIDATE_BYTES:
            raise FrameError(f"a punch candidate is {CANDIDATE_BYTES} bytes, got {len(data)}")
        packed, port = _CANDIDATE.unpack(data)
        return cls(ip=str(ipaddress.IPv4Address(packed)), port=port)


class PunchSockets:
    """A listening socket and the port it holds; ``meet`` connects from that same port."""

    def __init__(self, bind_host: str) -> None:
        self._host = bind_host
        self._listening = _reusable(bind_host, 0)
        try:
            self._listening.listen(4)
        except BaseException:
            self._listening.close()
            raise
        self.port: int = self._listening.getsockname()[1]

    def close(self) -> None:
        self._listening.close()

    async def meet(self, remote: Candidate, timeout_s: float) -> trio.socket.SocketType:
        """A connection with ``remote``: ours to it, or its to us, whichever comes first."""
        won: list[trio.socket.SocketType] = []
        async with trio.open_nursery() as nursery:
            nursery.cancel_scope.deadline = trio.current_time() + timeout_s

            async def take(way: Callable[[], Awaitable[trio.socket.SocketType]]) -> None:
                sock = await way()
                if won:  # both ways met in one scheduler round: keep the first
                    sock.close()
                    return
                won.append(sock)
                nursery.cancel_scope.cancel()

            nursery.start_soon(take, lambda: self._accept_from(remote))
            nursery.start_soon(take, lambda: self._connect_to(remote))
        if not won:
            raise PunchError(f"no connection with {remote.ip}:{remote.port} in {timeout_s}s")
        return won[0]

    async def _accept_from(self, remote: Candidate) -> trio.socket.SocketType:
        while True:
            conn, addr = await self._listening.accept()
            if (addr[0], addr[1]) == (remote.ip, remote.port):
                return conn
            conn.close()  # somebody else found the port: not the peer we punch to

    async def _connect_to(self, remote: Candidate) -> trio.socket.SocketType:
        # A router in the way drops SYNs until its own side sent one, and the kernel
        # resends ours; a refusal (the peer's socket not there yet) is worth a new try.
        while True:
            sock = _reusable(self._host, self.port)
            try:
                await sock.connect((remote.ip, remote.port))
                return sock
            except OSError:
                logger.debug("punch connect to %s:%d failed", remote.ip, remote.port, exc_info=True)
                sock.close()
            except BaseException:
                sock.close()
                raise
            await trio.sleep(_RETRY_PAUSE_S)


def _reusable(bind_host: str, port: int) -> trio.socket.SocketType:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((bind_host, port))  # a literal IP: no lookup, so no need for trio's bind
    except BaseException:
        sock.close()
        raise
    return trio.socket.from_stdlib_socket(sock)


def candidate_of(public_ip: PublicIp, port: int) -> Candidate:
    """Our candidate; PunchError while no member has told us where it sees us."""
    ip = public_ip()
    if not ip:
        raise PunchError("no public address known here (no reachability verdict yet)")
    try:
        return Candidate(ip=ip, port=port)
    except FrameError as exc:
        raise PunchError(f"cannot punch from {ip}: {exc}") from exc


async def exchange(stream: INetStream, ours: Candidate, timeout_s: float) -> Candidate:
    """Send ours and read the peer's candidate on ``stream`` (reset on any failure)."""
    try:
        with trio.fail_after(timeout_s):
            await stream.write(ours.to_wire())
            data = await read_exactly(
                StreamReader(stream), CANDIDATE_BYTES, stall_timeout_s=timeout_s, what="candidate"
            )
        theirs = Candidate.from_wire(data)
    except BaseException:
        await reset_quietly(stream)
        raise
    await close_quietly(stream)
    return theirs


async def punch_over(
    stream: INetStream, punch: PunchFrom, timeout_s: float
) -> trio.socket.SocketType:
    """One side's punch, on a PUNCH_PROTOCOL stream either side opened: bind a punch port,
    trade candidates, meet. The stream is reset where we cannot take part (no port, no
    public IP); PunchError, a stream or frame error, or OSError otherwise."""
    try:
        sockets = PunchSockets(punch.bind_host)
    except OSError as exc:
        await reset_quietly(stream)
        raise PunchError(f"no punch port here: {exc}") from exc
    try:
        try:
            ours = candidate_of(punch.public_ip, sockets.port)
        except PunchError:
            await reset_quietly(stream)
            raise
        theirs = await exchange(stream, ours, timeout_s)
        return await sockets.meet(theirs, timeout_s)
    finally:
        sockets.close()


class PunchServer:
    """The receiver's side: PUNCH_PROTOCOL's handler, in the host's trio thread."""

    def __init__(
        self, *, admit: Callable[[str], bool], punch: PunchFrom, redeem: Redeem, timeout_s: float
    ) -> None:
        self._admit = admit
        self._punch = punch
        self._redeem = redeem
        self._timeout_s = timeout_s
        self._busy: set[str] = set()  # peers with a punch under way

    async def serve(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        crowded = peer in self._busy or len(self._busy) >= MAX_PUNCHES
        if crowded or not self._punch.public_ip() or not self._admit(peer):
            await reset_quietly(stream)
            return
        self._busy.add(peer)
        try:
            conn = await punch_over(stream, self._punch, self._timeout_s)
        except (PunchError, FrameError, trio.TooSlowError, *NETWORK_ERRORS) as exc:
            logger.debug("a punch from %s failed: %s", peer, exc)
            return
        finally:
            self._busy.discard(peer)
        logger.debug("punched a lane socket with %s", peer)
        self._redeem(conn)  # the token, as on a dialled lane, says who it is
