"""The sending side of a lane: ask the peer for an offer over libp2p, then connect and redeem.

Where the lane goes: the offer names a port only, never an address (an offer cannot point this
node's connect at somebody else). The IP is the connection's: on a connection this node dialled,
where it reached the peer. On one the peer dialled, the connection's IP is the peer's source
address, which need not be where it listens (a second interface, a container network's
gateway): there the peer's listen addresses, as its identify told us, come first
(``lane_ips``), at most ``MAX_LISTEN_IPS`` of them, of the connection's address family.
"""

import ipaddress
import socket
from collections.abc import Iterable

import trio
from libp2p.abc import IHost
from libp2p.host.exceptions import StreamFailure
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.id import ID

from fusionllm.common.errors import FrameError
from fusionllm.node.errors import DeadlineError, TransportError
from fusionllm.node.p2p.checks import address_family
from fusionllm.node.p2p.framing import read_exactly
from fusionllm.node.p2p.lane.offer import ACCEPTED, LANE_PROTOCOL, OFFER_BYTES, Offer
from fusionllm.node.p2p.lane.punch import (
    PUNCH_PROTOCOL,
    PunchError,
    PunchFrom,
    punch_over,
)
from fusionllm.node.p2p.lane.stream import LaneWriter, recv_exactly, send_all, tune
from fusionllm.node.p2p.peer_host import close_quietly, reset_quietly
from fusionllm.node.p2p.relay_client import relayed_conn
from fusionllm.node.p2p.stream_reader import StreamReader

MAX_LISTEN_IPS = 3  # a peer that names many addresses cannot make us dial many hosts


class RelayedError(TransportError):
    """Every connection to the peer goes through a relay: a lane would have to dial the peer
    (behind NAT: it cannot be dialled), so its frames stay on streams inside the connection."""


class LaneRefusedError(TransportError):
    """The peer reset our request for a lane offer at once: it does not admit us (yet: a plan
    it has not adopted), or has no ticket left. Worth asking again soon, unlike a port that
    cannot be reached."""


# A reset offer stream: refused during protocol negotiation, or before the offer's bytes.
_REFUSALS = (StreamFailure, StreamReset, StreamEOF, FrameError)


async def open_lane(
    host: IHost, peer: str, timeout_s: float, *, punch: PunchFrom | None = None
) -> LaneWriter:
    """A lane to ``peer``, set up within ``timeout_s``; LaneRefusedError if the peer refuses
    to offer one, TransportError (or DeadlineError) if its port cannot be reached from here.
    Reached through a relay only: punched (``punch``; PunchError if that fails), or none."""
    if only_relayed(host, ID.from_base58(peer)):
        if punch is None:
            raise RelayedError(f"{peer} is reached through a relay only")
        return await _punched(host, peer, timeout_s, punch)
    try:
        with trio.fail_after(timeout_s):
            try:
                offer, ips = await _ask_offer(host, peer, timeout_s)
            except _REFUSALS as exc:
                raise LaneRefusedError(f"{peer} refused a lane: {type(exc).__name__}") from exc
            return await _redeem_at_one_of(offer, ips)
    except trio.TooSlowError as exc:
        raise DeadlineError(f"a lane to {peer} took over {timeout_s}s to set up") from exc


def only_relayed(host: IHost, peer: ID) -> bool:
    """Whether all our connections to ``peer`` are relayed (none: not known to be)."""
    conns = host.get_network().get_connections(peer)
    return bool(conns) and all(relayed_conn(c.muxed_conn) for c in conns)


def lane_ips(remote_ip: str, *, dialled: bool, listen_ips: Iterable[str]) -> list[str]:
    """The IPs to try a peer's lane port at, in order (see the module docstring)."""
    if dialled:
        return [remote_ip]
    family = ipaddress.ip_address(remote_ip).version
    chosen: list[str] = []
    for text in listen_ips:
        try:
            ip = ipaddress.ip_address(text)
        except ValueError:
            continue
        if ip.version == family and not ip.is_unspecified and str(ip) not in chosen:
            chosen.append(str(ip))
        if len(chosen) == MAX_LISTEN_IPS:
            break
    return [*chosen, remote_ip] if remote_ip not in chosen else chosen


def _listen_ips(host: IHost, peer: ID) -> list[str]:
    """The IPs of the peer's listen addresses in our peerstore (from identify), if any."""
    try:
        addrs = host.get_peerstore().addrs(peer)
    except Exception:  # an unknown or expired peer: no addresses
        return []
    found = []
    for addr in addrs:
        parts = str(addr).split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            found.append(parts[2])
    return found


async def _punched(host: IHost, peer: str, timeout_s: float, punch: PunchFrom) -> LaneWriter:
    """A lane on a socket punched with the peer (punch.py); the offer and the candidates
    cross the relay, hence twice the deadline of a dialled lane."""
    try:
        with trio.fail_after(2 * timeout_s):
            try:
                offer, _, _ = await _fetch_offer(host, peer, timeout_s)
            except _REFUSALS as exc:
                raise LaneRefusedError(f"{peer} refused a lane: {type(exc).__name__}") from exc
            try:
                stream = await host.new_stream(ID.from_base58(peer), [PUNCH_PROTOCOL])
                sock = await punch_over(stream, punch, timeout_s)
            except _REFUSALS as exc:  # not admitted, busy, or no verdict of its own
                raise PunchError(f"{peer} refused to punch: {type(exc).__name__}") from exc
            lane = await _present_token(sock, offer)
    except trio.TooSlowError as exc:
        raise PunchError(f"punching to {peer} took over {2 * timeout_s}s") from exc
    except (OSError, FrameError) as exc:
        raise PunchError(f"punching to {peer} failed: {exc}") from exc
    lane.punched = True
    return lane


async def _fetch_offer(
    host: IHost, peer: str, timeout_s: float
) -> tuple[Offer, tuple[str, int] | None, bool]:
    """The peer's offer, the connection's remote address and whether we dialled it."""
    stream = await host.new_stream(ID.from_base58(peer), [LANE_PROTOCOL])
    try:
        data = await read_exactly(
            StreamReader(stream), OFFER_BYTES, stall_timeout_s=timeout_s, what="lane offer"
        )
        offer = Offer.from_wire(data)
        remote = stream.get_remote_address()
        dialled = bool(getattr(stream.muxed_conn, "is_initiator", True))
    except BaseException:
        await reset_quietly(stream)
        raise
    await close_quietly(stream)
    return offer, remote, dialled


async def _ask_offer(host: IHost, peer: str, timeout_s: float) -> tuple[Offer, list[str]]:
    peer_id = ID.from_base58(peer)
    offer, remote, dialled = await _fetch_offer(host, peer, timeout_s)
    if remote is None:
        raise TransportError(f"the connection to {peer} has no IP address for a lane")
    listen = () if dialled else _listen_ips(host, peer_id)
    return offer, lane_ips(remote[0], dialled=dialled, listen_ips=listen)


async def _redeem_at_one_of(offer: Offer, ips: list[str]) -> LaneWriter:
    """The lane at the first IP whose port answers; the last one's error if none does."""
    for ip in ips[:-1]:
        try:
            return await _redeem(offer, ip)
        except OSError:  # refused or unreachable there: the next address
            continue
    return await _redeem(offer, ips[-1])


async def _redeem(offer: Offer, remote_ip: str) -> LaneWriter:
    sock = trio.socket.socket(address_family("remote address", remote_ip), socket.SOCK_STREAM)
    try:
        await sock.connect((remote_ip, offer.port))
    except BaseException:
        sock.close()
        raise
    return await _present_token(sock, offer)


async def _present_token(sock: trio.socket.SocketType, offer: Offer) -> LaneWriter:
    """The lane on a connected ``sock`` once the peer accepted the offer's token (closes
    ``sock`` if not)."""
    try:
        tune(sock)
        await send_all(sock, offer.token)
        answer = bytearray(len(ACCEPTED))
        if await recv_exactly(sock, memoryview(answer)) != len(ACCEPTED) or answer != ACCEPTED:
            raise TransportError("the peer did not accept our lane token")
    except BaseException:
        sock.close()
        raise
    return LaneWriter(sock, offer.key)
