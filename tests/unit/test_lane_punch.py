"""Hole punching's pure parts and its sockets on 127.0.0.1 (node/p2p/lane/punch.py)."""

from types import SimpleNamespace

import pytest
import trio

from fusionllm.common.errors import FrameError
from fusionllm.node.p2p.lane.punch import (
    CANDIDATE_BYTES,
    Candidate,
    PunchError,
    PunchFrom,
    PunchServer,
    PunchSockets,
    candidate_of,
)


def test_a_candidate_round_trips_in_six_bytes():
    candidate = Candidate(ip="203.0.113.7", port=40123)
    wire = candidate.to_wire()
    assert len(wire) == CANDIDATE_BYTES == 6
    assert Candidate.from_wire(wire) == candidate


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        (b"\x01\x02\x03\x04\x00", "6 bytes, got 5"),
        (b"\x00\x00\x00\x00\x10\x00", "0.0.0.0, where nothing"),
        (b"\xe0\x00\x00\x01\x10\x00", "224.0.0.1, where nothing"),
        (b"\xff\xff\xff\xff\x10\x00", "255.255.255.255, where nothing"),
        (b"\x0a\x00\x00\x01\x00\x00", "names port 0"),
    ],
)
def test_a_peer_cannot_name_a_candidate_nothing_answers_at(wire, match):
    with pytest.raises(FrameError, match=match):
        Candidate.from_wire(wire)


def test_no_candidate_until_a_member_said_where_it_sees_us():
    with pytest.raises(PunchError, match="no public address known"):
        candidate_of(lambda: None, 4000)
    with pytest.raises(PunchError, match="cannot punch from ::1"):
        candidate_of(lambda: "::1", 4000)  # NATs that punching gets through are IPv4
    assert candidate_of(lambda: "198.51.100.2", 4000) == Candidate(ip="198.51.100.2", port=4000)


async def _meet_both(a: PunchSockets, b: PunchSockets, timeout_s: float):
    socks = {}

    async def meet(name, ours, theirs):
        socks[name] = await ours.meet(Candidate(ip="127.0.0.1", port=theirs.port), timeout_s)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(meet, "a", a, b)
        nursery.start_soon(meet, "b", b, a)
    return socks["a"], socks["b"]


def test_two_punch_sockets_meet_whoever_connects_first():
    async def main():
        a, b = PunchSockets("127.0.0.1"), PunchSockets("127.0.0.1")
        try:
            sock_a, sock_b = await _meet_both(a, b, 5.0)
        finally:
            a.close()
            b.close()
        with sock_a, sock_b:
            # one connection between the two punch ports, whichever way it was made
            assert sock_a.getsockname()[1] == sock_b.getpeername()[1] == a.port
            assert sock_b.getsockname()[1] == sock_a.getpeername()[1] == b.port
            await sock_a.send(b"over the punched path")
            assert await sock_b.recv(64) == b"over the punched path"

    trio.run(main)


def test_a_punch_nobody_answers_ends_at_its_deadline_and_a_stranger_is_not_taken():
    async def main():
        silent = trio.socket.socket()  # holds a port, never listens: each connect is refused
        await silent.bind(("127.0.0.1", 0))
        ours = PunchSockets("127.0.0.1")
        try:
            stranger = trio.socket.socket()
            with stranger:
                await stranger.connect(("127.0.0.1", ours.port))  # queued on the listener
                start = trio.current_time()
                with pytest.raises(PunchError, match=r"no connection with 127\.0\.0\.1"):
                    await ours.meet(Candidate(ip="127.0.0.1", port=silent.getsockname()[1]), 0.5)
                assert 0.5 <= trio.current_time() - start < 3.0
                assert await stranger.recv(1) == b""  # accepted, then closed unread
        finally:
            silent.close()
            ours.close()

    trio.run(main)


class FakeStream:
    """A punch request from ``peer`` that sends nothing: it only records how it ended."""

    def __init__(self, peer: str) -> None:
        self.muxed_conn = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: peer))
        self.ended = ""

    async def reset(self) -> None:
        self.ended = "reset"

    async def write(self, data: bytes) -> None:
        raise AssertionError("a refused punch writes nothing")


@pytest.mark.parametrize(
    ("admitted", "ip", "busy"),
    [(False, "198.51.100.2", False), (True, None, False), (True, "198.51.100.2", True)],
    ids=["not a member", "no verdict here", "a punch of it under way"],
)
def test_a_punch_request_is_refused_before_any_socket_or_byte(admitted, ip, busy):
    redeemed = []
    punch = PunchFrom(public_ip=lambda: ip, bind_host="127.0.0.1")
    server = PunchServer(admit=lambda peer: admitted, punch=punch, redeem=redeemed.append,
                         timeout_s=1.0)  # fmt: skip
    if busy:
        server._busy.add("QmPeer")
    stream = FakeStream("QmPeer")
    trio.run(server.serve, stream)
    assert (stream.ended, redeemed) == ("reset", [])
