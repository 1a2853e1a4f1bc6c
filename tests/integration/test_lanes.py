"""Lanes between real node processes on 127.0.0.1: used when both ends offer them, a fallback
to libp2p streams when not, and every stranger's or bad peer's try refused at its own cost.
Tests that need a node without flags share the module's (``plain_node``): they count what
they added to its refusals."""

import contextlib
import os
import socket
import time

import multiaddr
import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.host.exceptions import StreamFailure
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.peerinfo import info_from_p2p_addr

from fusionllm.common.errors import FrameError
from fusionllm.node.errors import TransportError
from fusionllm.node.p2p.framing import read_exactly
from fusionllm.node.p2p.host import new_secure_host
from fusionllm.node.p2p.identity import peer_id_of
from fusionllm.node.p2p.lane.offer import ACCEPTED, LANE_PROTOCOL, OFFER_BYTES, TOKEN_BYTES, Offer
from fusionllm.node.p2p.lane.seal import LENGTH, MAX_CHUNK_BYTES, TAG_BYTES, Sealer
from fusionllm.node.p2p.stream_reader import StreamReader
from fusionllm.node.p2p.transport import Transport, TransportConfig
from tests.support.transport_node import _WAIT_S, HEADER, assert_node_still_echoes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(40)]


def refusals_of(node) -> dict[str, int]:
    return node.command(cmd="stats")["refusals"]


def wait_for_refusal(node, reason: str, before: dict[str, int] | None = None) -> int:
    """How many ``reason`` refusals the node counted since ``before`` (its counters then),
    once there is one."""
    since = (before or {}).get(reason, 0)
    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        refusals = refusals_of(node)
        if refusals.get(reason, 0) > since:
            return refusals[reason] - since
        time.sleep(0.05)
    raise AssertionError(f"node never refused {reason}: {refusals}")


def lane_port_of(node) -> int:
    return node.ready["lane_port"]


def test_frames_go_over_a_lane_when_both_ends_offer_one(plain_node, client):
    node, before = plain_node, refusals_of(plain_node)
    assert lane_port_of(node) > 0
    client.connect(node.addr)
    big = torch.randn(3 * MAX_CHUNK_BYTES // 4 + 5)  # several chunks and a partial one
    for tensor in (torch.arange(6.0), big):
        assert_node_still_echoes(client, node)
        client.send_tensor(node.peer_id, HEADER, tensor, timeout=_WAIT_S)
        assert torch.equal(client.recv(timeout=_WAIT_S).tensor, tensor)
    assert client.outbound_lanes() == [node.peer_id]
    assert refusals_of(node) == before  # nothing of ours refused


def test_a_node_without_lanes_gets_its_frames_over_a_stream(start_node, client):
    node = start_node("--no-lanes")
    assert lane_port_of(node) == 0
    client.connect(node.addr)
    assert_node_still_echoes(client, node)
    assert client.outbound_lanes() == []


def test_a_sender_without_lanes_uses_streams_to_a_node_with_them(tmp_path, plain_node):
    node = plain_node
    config = TransportConfig(key_path=tmp_path / "plain.key", lanes=False)
    with Transport(config) as plain:
        plain.connect(node.addr)
        assert_node_still_echoes(plain, node)
        assert plain.outbound_lanes() == []
        assert plain.lane_port == 0


def test_a_stranger_on_the_lane_port_is_closed_and_the_node_serves_on(plain_node, client):
    node, before = plain_node, refusals_of(plain_node)
    for garbage in (b"", os.urandom(TOKEN_BYTES), b"GET / HTTP/1.1\r\n\r\n" * 4):
        with socket.create_connection(("127.0.0.1", lane_port_of(node)), timeout=_WAIT_S) as s:
            s.sendall(garbage)
            # the node may have refused and reset it already (a bad token read at once)
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_WR)
            try:
                answer = s.recv(16)
            except OSError:  # reset: closed with our bytes unread
                answer = b""
            assert answer == b""  # never accepted
    assert wait_for_refusal(node, "lane_bad_token", before) == 3
    client.connect(node.addr)
    assert_node_still_echoes(client, node)


def lane_session(node_addr: str, attack) -> tuple[str, object]:
    """Ask ``node_addr`` for a lane as a throwaway peer and run ``attack(offer, ip)`` in trio;
    returns (our peer id, what the attack returned, or how the offer failed)."""
    key_pair = create_new_key_pair()

    async def main():
        host = new_secure_host(key_pair, negotiate_timeout_s=5)
        with trio.fail_after(_WAIT_S + 5):
            async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                info = info_from_p2p_addr(multiaddr.Multiaddr(node_addr))
                await host.connect(info)
                try:
                    stream = await host.new_stream(info.peer_id, [LANE_PROTOCOL])
                    data = await read_exactly(
                        StreamReader(stream), OFFER_BYTES, stall_timeout_s=_WAIT_S
                    )
                # Refused: the stream is reset at once (during negotiation, or at the read).
                except (StreamFailure, StreamReset, StreamEOF, FrameError) as exc:
                    return f"no offer: {type(exc).__name__}"
                return await attack(Offer.from_wire(data))

    return peer_id_of(key_pair), trio.run(main)


async def _connect(port: int) -> trio.socket.SocketType:
    sock = trio.socket.socket()
    await sock.connect(("127.0.0.1", port))
    return sock


async def _closed_by_peer(sock: trio.socket.SocketType) -> bool:
    with trio.move_on_after(_WAIT_S):
        while True:
            try:
                if not await sock.recv(4096):
                    return True
            except OSError:
                return True
    return False


def test_a_ticket_opens_one_lane_only(plain_node):
    node, before = plain_node, refusals_of(plain_node)

    async def redeem_twice(offer: Offer):
        answers = []
        for _ in range(2):
            sock = await _connect(offer.port)
            await sock.send(offer.token)
            answers.append(await sock.recv(1))
            sock.close()
        return answers

    _, answers = lane_session(node.addr, redeem_twice)
    assert answers == [ACCEPTED, b""]
    assert wait_for_refusal(node, "lane_bad_token", before) == 1


def test_a_member_sending_tampered_chunks_loses_its_lane_only(plain_node, client):
    node = plain_node

    async def tamper(offer: Offer):
        sock = await _connect(offer.port)
        await sock.send(offer.token)
        assert await sock.recv(1) == ACCEPTED
        chunk = bytearray(Sealer(offer.key).seal(b"\x01" * 64))
        chunk[-1] ^= 1
        await sock.send(chunk)
        return await _closed_by_peer(sock)

    peer, closed = lane_session(node.addr, tamper)
    assert closed is True
    assert node.wait_for_error(peer, "FrameError") == {"FrameError": 1}
    client.connect(node.addr)
    assert_node_still_echoes(client, node)


def test_a_lane_chunk_declaring_more_than_the_limit_is_cut_before_it_is_read(plain_node):
    node = plain_node

    async def oversize(offer: Offer):
        sock = await _connect(offer.port)
        await sock.send(offer.token)
        assert await sock.recv(1) == ACCEPTED
        await sock.send(LENGTH.pack(MAX_CHUNK_BYTES + 1) + bytes(TAG_BYTES))
        return await _closed_by_peer(sock)

    peer, closed = lane_session(node.addr, oversize)
    assert closed is True
    assert node.wait_for_error(peer, "FrameError") == {"FrameError": 1}


def test_a_peer_not_admitted_gets_no_offer(start_node):
    member = create_new_key_pair()
    node = start_node("--admit", peer_id_of(member))

    async def unreachable(offer: Offer):
        return "offered"

    _, outcome = lane_session(node.addr, unreachable)
    assert str(outcome).startswith("no offer")
    assert wait_for_refusal(node, "lane_not_admitted") == 1


def test_a_refused_lane_is_asked_for_again_within_seconds(start_node, client):
    """A member whose peer has not admitted it yet (a plan one side adopted an epoch before the
    other: common off loopback) used to send over streams for the whole lane_retry_s (60 s)."""
    node = start_node("--admit", peer_id_of(create_new_key_pair()))  # not the client
    client.connect(node.addr)
    deadline = time.monotonic() + _WAIT_S
    while refusals_of(node).get("lane_not_admitted", 0) < 2:
        assert time.monotonic() < deadline, refusals_of(node)
        with contextlib.suppress(TransportError):  # the tensor stream is refused too
            client.send_tensor(node.peer_id, HEADER, torch.arange(4.0), timeout=2.0)
        time.sleep(0.5)
    assert client.outbound_lanes() == []


def test_a_lane_port_in_use_is_refused_at_start(tmp_path, plain_node):
    node = plain_node
    config = TransportConfig(key_path=tmp_path / "k", lane_port=lane_port_of(node))
    with pytest.raises(TransportError, match="cannot listen for lanes"):
        Transport(config).start()
    assert_node_still_echoes_from(tmp_path, node)


def assert_node_still_echoes_from(tmp_path, node) -> None:
    with Transport(TransportConfig(key_path=tmp_path / "other.key")) as other:
        other.connect(node.addr)
        assert_node_still_echoes(other, node)
