"""Lanes punched between two members that reach each other through a member's relay only
(node/p2p/lane/punch.py), on 127.0.0.1: real hosts, a real relay, real sockets."""

import logging

import pytest
from libp2p.connection_types import ConnectionType
from libp2p.peer.id import ID

from fusionllm.node.p2p.relay_addrs import relayed_addr
from fusionllm.node.p2p.transport import Transport, TransportConfig
from tests.support.relayed import exchange_both_ways, relayed_hosts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.fixture
def relayed(tmp_path):
    """A member's relay, and two members ("home", "other") with relay clients; home holds a
    slot on it."""
    with relayed_hosts(tmp_path) as (hosts, clients):
        assert clients["home"].reserve(hosts["relay"].peer_id)
        yield hosts


def _transports(hosts, tmp_path, public_ips):
    return [
        Transport(
            TransportConfig(key_path=tmp_path / f"{n}.key"),
            host=hosts[n],
            public_ip=lambda ip=public_ips[n]: ip,
        )
        for n in ("home", "other")
    ]


def test_members_reached_through_a_relay_only_punch_lanes_both_ways(relayed, tmp_path):
    hosts = relayed
    home, other = hosts["home"], hosts["other"]
    transports = _transports(hosts, tmp_path, {"home": "127.0.0.1", "other": "127.0.0.1"})
    try:
        for transport in transports:
            transport.start()
        at_home, away = transports
        away.connect(relayed_addr(hosts["relay"].addrs[0], home.peer_id))
        exchange_both_ways(at_home, away, rounds=5)
        # each direction's frames went on a punched lane, authenticated by its token as a
        # dialled one is, while the libp2p connection between them stays relayed
        assert away.outbound_lanes() == away.punched_lanes() == [home.peer_id]
        assert at_home.outbound_lanes() == at_home.punched_lanes() == [other.peer_id]
        conns = other.libp2p.get_network().get_connections(ID.from_base58(home.peer_id))
        assert {c.muxed_conn.get_connection_type() for c in conns} == {ConnectionType.RELAYED}
        assert at_home.refusals() == away.refusals() == {}
    finally:
        for transport in transports:
            transport.close()


def test_a_punch_the_peer_cannot_answer_leaves_frames_on_the_relayed_stream(
    relayed, tmp_path, caplog
):
    """home has no verdict to punch with (as behind a symmetric NAT, no punch meets): frames
    stay inside the circuit, none lost, and the node says so once per peer."""
    hosts = relayed
    home = hosts["home"]
    transports = _transports(hosts, tmp_path, {"home": None, "other": "127.0.0.1"})
    try:
        for transport in transports:
            transport.start()
        at_home, away = transports
        away.connect(relayed_addr(hosts["relay"].addrs[0], home.peer_id))
        with caplog.at_level(logging.WARNING, logger="fusionllm.node.p2p.lane.service"):
            exchange_both_ways(at_home, away, rounds=5)
        assert away.outbound_lanes() == at_home.outbound_lanes() == []
        told = [r.getMessage() for r in caplog.records if "could be punched" in r.getMessage()]
        assert len(told) == 2, told  # each side once: other's punch was refused, home has no IP
        assert any("refused to punch" in line for line in told), told
        assert any("no public address known" in line for line in told), told
    finally:
        for transport in transports:
            transport.close()
