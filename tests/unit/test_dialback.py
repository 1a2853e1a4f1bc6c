"""Dial-back (node/p2p/dialback.py) with a fake stream and network: the server dials only the
IP the request came from, on new connections, within its limits; answers are checked; and
the verdict (node/p2p/reachability.py) needs several members to agree."""

import struct
from types import SimpleNamespace

import pytest
import trio
from libp2p.connection_types import ConnectionType
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from fusionllm.common.errors import ConfigError, PeerError
from fusionllm.node.p2p.dialback import (
    FAILED,
    MAGIC,
    REACHED,
    REFUSED,
    DialBackAnswer,
    DialBackConfig,
    DialBackServer,
    decode_answer,
    encode_request,
)
from fusionllm.node.p2p.reachability import Reachability, Settler, announced, judge, punch_ip

PEER = ID.from_pubkey(create_new_key_pair().public_key)
OTHER = ID.from_pubkey(create_new_key_pair().public_key)


class FakeStream:
    """A request already sent, from ``remote``; what the server writes is kept."""

    def __init__(self, request: bytes, peer: ID = PEER, remote=("203.0.113.7", 40000),
                 kind=lambda: ConnectionType.DIRECT) -> None:  # fmt: skip
        self._data = request
        self.muxed_conn = SimpleNamespace(peer_id=peer, get_connection_type=kind)
        self._remote = remote
        self.written = b""
        self.closed = self.was_reset = False

    async def read(self, n: int) -> bytes:
        data, self._data = self._data[:n], self._data[n:]
        return data

    async def write(self, data: bytes) -> None:
        self.written += data

    def get_remote_address(self):
        return self._remote

    async def close(self) -> None:
        self.closed = True

    async def reset(self) -> None:
        self.was_reset = True


class FakeNetwork:
    """TCP connects that open to the ``IP:PORT`` in ``open_at``; records every dial."""

    def __init__(self, open_at: set[str]) -> None:
        self.open_at = open_at
        self.dials: list[str] = []
        self.closed: list[str] = []

    async def connect(self, ip: str, port: int):
        self.dials.append(f"{ip}:{port}")
        if f"{ip}:{port}" not in self.open_at:
            raise OSError("connection timed out")
        return SimpleNamespace(aclose=lambda: self._close(f"{ip}:{port}"))

    async def _close(self, where: str) -> None:
        self.closed.append(where)


def _server(open_at=(), **kwargs):
    network = FakeNetwork(set(open_at))
    clock = kwargs.pop("clock", lambda: 0.0)
    allow = kwargs.pop("allow", None)
    config = DialBackConfig(**kwargs)
    return DialBackServer(config, allow=allow, clock=clock, connect=network.connect), network


def _answer(stream: FakeStream, ports) -> DialBackAnswer:
    return decode_answer("peer", stream.written, ports)


def test_the_server_dials_back_only_the_ip_it_sees_on_new_connections():
    server, network = _server(open_at={"203.0.113.7:4001"})
    stream = FakeStream(encode_request([4001, 4002]))
    trio.run(server.serve, stream)
    assert network.dials == ["203.0.113.7:4001", "203.0.113.7:4002"]
    assert network.closed == ["203.0.113.7:4001"]  # closed at once
    answer = _answer(stream, [4001, 4002])
    assert answer.observed_ip == "203.0.113.7"
    assert answer.reached == {4001: True, 4002: False}
    assert stream.closed
    assert server.counts == {"served": 1, "refused": 0, "errors": 0}


def test_a_dial_that_hangs_fails_at_the_deadline():
    async def hanging(ip, port):
        await trio.sleep_forever()

    server = DialBackServer(DialBackConfig(dial_timeout_s=0.05), connect=hanging)
    stream = FakeStream(encode_request([4001]))
    trio.run(server.serve, stream)
    assert _answer(stream, [4001]).reached == {4001: False}


def _untyped():
    raise AttributeError("'PskConn' object has no attribute '_connection_type'")


@pytest.mark.parametrize(
    ("stream_kwargs", "server_kwargs"),
    [
        ({"kind": lambda: ConnectionType.RELAYED}, {}),
        ({"kind": _untyped}, {}),
        ({"remote": None}, {}),
        ({}, {"allow": lambda peer: peer != PEER.to_base58()}),
    ],
    ids=["over a relay", "untyped (a private swarm's)", "no remote address", "not a member"],
)
def test_the_server_refuses_without_dialing(stream_kwargs, server_kwargs):
    server, network = _server(open_at={"203.0.113.7:4001"}, **server_kwargs)
    stream = FakeStream(encode_request([4001]), **stream_kwargs)
    trio.run(server.serve, stream)
    assert network.dials == []
    answer = _answer(stream, [4001])
    assert answer.refused
    assert answer.reached == {4001: False}
    assert server.counts["refused"] == 1


def test_one_peer_is_served_once_per_interval_and_another_meanwhile():
    now = [100.0]
    server, network = _server(min_interval_s=10.0, clock=lambda: now[0])
    for peer, at, refused in [(PEER, 100, False), (PEER, 105, True), (OTHER, 105, False),
                              (PEER, 111, False)]:  # fmt: skip
        now[0] = at
        stream = FakeStream(encode_request([4001]), peer=peer)
        trio.run(server.serve, stream)
        assert _answer(stream, [4001]).refused is refused, (peer, at)
    assert len(network.dials) == 3


@pytest.mark.parametrize(
    "request_bytes",
    [b"XXXX\x01\x0f\xa1", MAGIC + b"\x05" + b"\x00\x01" * 5, MAGIC + b"\x01\x00\x00", MAGIC],
    ids=["magic", "too many ports", "port 0", "cut short"],
)
def test_a_bad_request_only_resets_its_stream(request_bytes):
    server, network = _server()
    stream = FakeStream(request_bytes)
    trio.run(server.serve, stream)
    assert stream.was_reset
    assert stream.written == b""
    assert network.dials == []
    assert server.counts["errors"] == 1


def test_requests_and_answers_are_checked():
    assert encode_request([1, 65535]) == MAGIC + struct.pack(">BHH", 2, 1, 65535)
    for ports in ([], [0], [70000], [1, 2, 3, 4, 5]):
        with pytest.raises(ValueError, match="ports"):
            encode_request(ports)
    good = bytes([8]) + b"10.0.0.1" + bytes([REACHED, FAILED])
    assert decode_answer("p", good, [1, 2]).reached == {1: True, 2: False}
    for bad, match in [
        (good[:-1], "answer of 10 bytes"),
        (bytes([8]) + b"10.0.0.x" + bytes([0, 0]), "names no IP"),
        (bytes([8]) + b"10.0.0.1" + bytes([0, 9]), "statuses"),
        (b"", "answer of 0 bytes"),
    ]:
        with pytest.raises(PeerError, match=match):
            decode_answer("p", bad, [1, 2])
    assert decode_answer("p", bytes([7]) + b"0.0.0.0" + bytes([REFUSED]), [1]).refused
    with pytest.raises(ConfigError, match="dial_timeout_s"):
        DialBackConfig(dial_timeout_s=0)


def _a(peer: str, ip: str, **reached: bool) -> DialBackAnswer:
    ports = {int(p[1:]): v for p, v in reached.items()}  # p4001=True: port 4001 reached
    return DialBackAnswer(peer=peer, observed_ip=ip, reached=ports)


def test_a_verdict_needs_members_to_agree():
    listen = ["10.0.0.5"]
    reached = [_a("m1", "10.0.0.5", p4001=True), _a("m2", "10.0.0.5", p4001=True)]
    assert judge(reached, listen_ips=listen).verdict == "public"
    assert judge(reached, listen_ips=listen).addrs == ("10.0.0.5:4001",)
    assert judge(reached[:1], listen_ips=listen).verdict == "unknown"  # one member's word
    mapped = judge([_a(m, "198.51.100.9", p4001=True) for m in ("m1", "m2")], listen_ips=listen)
    assert (mapped.verdict, mapped.addrs) == ("mapped", ("198.51.100.9:4001",))
    blind = [_a(m, "198.51.100.9", p4001=False) for m in ("m1", "m2", "m3")]
    private = judge(blind, listen_ips=listen)
    assert (private.verdict, private.addrs, private.observed_ips, private.answers) == (
        "private", (), ("198.51.100.9",), 3,
    )  # fmt: skip
    assert judge([*blind, reached[0]], listen_ips=listen).verdict == "unknown"  # disagreement
    refused = DialBackAnswer(peer="m4", observed_ip="0.0.0.0", reached={4001: False}, refused=True)
    assert judge([blind[0], refused], listen_ips=listen).verdict == "unknown"
    # a member's latest answer counts: m1 and m2 now reach us
    assert judge([*blind, *reached], listen_ips=listen).verdict == "public"
    assert announced(["1.2.3.4:4001"]).verdict == "announced"


def test_a_thin_demoting_verdict_holds_only_when_repeated():
    public = Reachability(verdict="public", addrs=("10.0.0.5:4001",), answers=1)
    thin = Reachability(verdict="private", observed_ips=("10.0.0.5",), answers=1)
    firm = Reachability(verdict="private", observed_ips=("10.0.0.5",), answers=2)
    settler = Settler(confirmations=2, repeats=2)
    assert settler.settle(public, firm) == firm  # members agree: at once
    assert settler.settle(public, thin) == public
    assert settler.pending
    assert settler.settle(public, thin) == thin
    assert not settler.pending
    mapped = Reachability(verdict="mapped", addrs=("198.51.100.9:4001",), answers=1)
    assert settler.settle(public, mapped) == public  # mapped demotes too (a DHT client)
    assert settler.settle(public, thin) == public  # another verdict: counted from one
    assert settler.settle(public, thin) == thin
    unknown = Reachability(verdict="unknown")
    assert settler.settle(unknown, public) == public  # promotions are never held back
    assert settler.settle(thin, thin) == thin  # nothing changes: nothing to hold
    assert Settler(confirmations=2, repeats=1).settle(public, thin) == thin
    with pytest.raises(ValueError, match="must be >= 1"):
        Settler(confirmations=2, repeats=0)


def test_a_private_node_punches_from_the_one_ip_its_members_saw():
    seen = Reachability(verdict="private", observed_ips=("198.51.100.7",), answers=2)
    assert punch_ip(seen) == "198.51.100.7"
    two = Reachability(verdict="private", observed_ips=("198.51.100.7", "203.0.113.9"))
    assert punch_ip(two) is None  # which one would a peer see? not known
    public = Reachability(verdict="public", observed_ips=("198.51.100.7",))
    assert punch_ip(public) is None  # peers dial it: nothing to punch
    assert punch_ip(Reachability(verdict="unknown")) is None
