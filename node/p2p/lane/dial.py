"""The sending side of a lane: ask the peer for an offer over libp2p, then connect and redeem."""

import socket

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
from fusionllm.node.p2p.lane.stream import LaneWriter, recv_exactly, send_all, tune
from fusionllm.node.p2p.peer_host import close_quietly, reset_quietly
from fusionllm.node.p2p.stream_reader import StreamReader


class LaneRefusedError(TransportError):
    """The peer reset our request for a lane offer at once: it does not admit us (yet: a plan
    it has not adopted), or has no ticket left. Worth asking again soon, unlike a port that
    cannot be reached."""


# A reset offer stream: refused during protocol negotiation, or before the offer's bytes.
_REFUSALS = (StreamFailure, StreamReset, StreamEOF, FrameError)


async def open_lane(host: IHost, peer: str, timeout_s: float) -> LaneWriter:
    """A lane to ``peer``, set up within ``timeout_s``; LaneRefusedError if the peer refuses
    to offer one, TransportError (or DeadlineError) if its port cannot be reached from here."""
    try:
        with trio.fail_after(timeout_s):
            try:
                offer, remote_ip = await _ask_offer(host, peer, timeout_s)
            except _REFUSALS as exc:
                raise LaneRefusedError(f"{peer} refused a lane: {type(exc).__name__}") from exc
            return await _redeem(offer, remote_ip)
    except trio.TooSlowError as exc:
        raise DeadlineError(f"a lane to {peer} took over {timeout_s}s to set up") from exc


async def _ask_offer(host: IHost, peer: str, timeout_s: float) -> tuple[Offer, str]:
    stream = await host.new_stream(ID.from_base58(peer), [LANE_PROTOCOL])
    try:
        data = await read_exactly(
            StreamReader(stream), OFFER_BYTES, stall_timeout_s=timeout_s, what="lane offer"
        )
        offer = Offer.from_wire(data)
        # The lane goes where the authenticated connection goes, never to an address the
        # peer names: an offer cannot point this node's connect at somebody else.
        remote = stream.get_remote_address()
    except BaseException:
        await reset_quietly(stream)
        raise
    await close_quietly(stream)
    if remote is None:
        raise TransportError(f"the connection to {peer} has no IP address for a lane")
    return offer, remote[0]


async def _redeem(offer: Offer, remote_ip: str) -> LaneWriter:
    sock = trio.socket.socket(address_family("remote address", remote_ip), socket.SOCK_STREAM)
    try:
        await sock.connect((remote_ip, offer.port))
        tune(sock)
        await send_all(sock, offer.token)
        answer = bytearray(len(ACCEPTED))
        if await recv_exactly(sock, memoryview(answer)) != len(ACCEPTED) or answer != ACCEPTED:
            raise TransportError("the peer did not accept our lane token")
    except BaseException:
        sock.close()
        raise
    return LaneWriter(sock, offer.key)
