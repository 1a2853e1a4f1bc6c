"""A member's relay on 127.0.0.1 (node/p2p/member_relay.py): members reserve a slot and
meet through it, a stranger can neither reserve nor open a circuit."""

import time

import pytest
from libp2p.connection_types import ConnectionType
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from fusionllm.node.errors import TransportError
from fusionllm.node.local_swarm import wait_for
from fusionllm.node.p2p.member_relay import MemberRelay, MemberRelayConfig
from fusionllm.node.p2p.peer_host import HostConfig, PeerHost
from fusionllm.node.p2p.probes import PROBE_PROTOCOL, ProbeServer, run_probe
from fusionllm.node.p2p.relay_addrs import relayed_addr
from fusionllm.node.p2p.relay_client import RelayClient
from fusionllm.node.p2p.transport import Transport, TransportConfig
from tests.support.relayed import exchange_both_ways, relayed_hosts

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

ECHO = TProtocol("/fusionllm/test-echo/1.0.0")
RELAYED = ConnectionType.RELAYED


async def _echo(stream) -> None:
    await stream.write(await stream.read(64))
    await stream.close()


async def _ask(libp2p, peer: ID, payload: bytes) -> tuple[bytes, ConnectionType]:
    stream = await libp2p.new_stream(peer, [ECHO])
    await stream.write(payload)
    answer = await stream.read(64)
    await stream.close()
    return answer, stream.muxed_conn.get_connection_type()


def test_members_meet_through_a_members_relay_and_a_stranger_does_not(tmp_path):
    hosts = {n: PeerHost(HostConfig(key_path=tmp_path / f"{n}.key")).start()
             for n in ("relay", "home", "other", "stranger")}  # fmt: skip
    try:
        members = {hosts[n].peer_id for n in ("relay", "home", "other")}
        relay = MemberRelay(hosts["relay"], MemberRelayConfig(),
                            is_member=members.__contains__).start()  # fmt: skip
        relay_addr = hosts["relay"].addrs[0]
        relay_id = hosts["relay"].peer_id
        clients = {}
        for name in ("home", "other", "stranger"):
            clients[name] = RelayClient(hosts[name]).start()
            hosts[name].connect(relay_addr)
        hosts["home"].set_stream_handler(ECHO, _echo)
        assert clients["home"].reserve(relay_id)
        home_id = ID.from_base58(hosts["home"].peer_id)
        through = relayed_addr(relay_addr, hosts["home"].peer_id)
        other = hosts["other"]
        other.connect(through, timeout=20.0)
        answer = other.call(_ask, other.libp2p, home_id, b"through the relay")
        assert answer == (b"through the relay", ConnectionType.RELAYED)
        stranger = hosts["stranger"]
        assert not clients["stranger"].reserve(relay_id)
        with pytest.raises(TransportError, match="failed"):
            stranger.connect(through, timeout=20.0)
        assert relay.counts["refused"] >= 2
    finally:
        for host in hosts.values():
            host.close()


@pytest.fixture
def relayed(tmp_path):
    """A member's relay, a member with a relay client ("home") and another ("other"),
    both connected to the relay; home has no slot yet."""
    with relayed_hosts(tmp_path) as (hosts, clients):
        yield hosts, clients


def test_a_node_reaches_a_member_at_its_relayed_address(relayed):
    """RelayClient: ``PeerHost.connect`` dials a relayed address like any other."""
    hosts, clients = relayed
    home, other = hosts["home"], hosts["other"]
    relay_addr = hosts["relay"].addrs[0]
    home.set_stream_handler(ECHO, _echo)
    with pytest.raises(TransportError, match="failed"):  # no slot yet: the relay says 204
        other.connect(relayed_addr(relay_addr, home.peer_id))
    nobody = ID.from_pubkey(create_new_key_pair().public_key).to_base58()  # not connected
    with pytest.raises(TransportError, match="no relay client here"):  # the relay runs none
        hosts["relay"].connect(relayed_addr(other.addrs[0], nobody))
    assert clients["home"].reserve(hosts["relay"].peer_id)
    assert other.connect(relayed_addr(relay_addr, home.peer_id)) == home.peer_id
    answer = other.call(_ask, other.libp2p, ID.from_base58(home.peer_id), b"relayed")
    assert answer == (b"relayed", ConnectionType.RELAYED)
    # connected already: a second dial returns at once, on the same connection
    assert other.connect(relayed_addr(relay_addr, home.peer_id)) == home.peer_id
    assert len(other.libp2p.get_network().get_connections(ID.from_base58(home.peer_id))) == 1
    # a probe runs over the path the traffic takes, and says it is relayed; one to the relay
    # itself (a direct connection) does not
    for host in (home, hosts["relay"]):
        server = ProbeServer(max_bytes=1 << 20, max_per_peer_per_min=60, max_concurrent=2,
                             timeout_s=10.0, count=lambda name: None)  # fmt: skip
        host.set_stream_handler(PROBE_PROTOCOL, server.serve)
    probe = other.call(run_probe, other.libp2p, ID.from_base58(home.peer_id), 256 << 10, 20.0)
    assert (probe.bytes, probe.relayed) == (256 << 10, True)
    direct = other.call(run_probe, other.libp2p, ID.from_base58(hosts["relay"].peer_id),
                        256 << 10, 20.0)  # fmt: skip
    assert not direct.relayed


def test_tensors_to_a_member_reached_through_a_relay_go_on_streams_inside_the_circuit(
    relayed, tmp_path
):
    """A lane would dial the member (behind NAT: it cannot be dialled): frames stay inside
    the relayed connection, both ways, and none is lost."""
    hosts, clients = relayed
    home, other = hosts["home"], hosts["other"]
    relay_addr = hosts["relay"].addrs[0]
    assert clients["home"].reserve(hosts["relay"].peer_id)
    transports = [Transport(TransportConfig(key_path=tmp_path / f"{n}.key"), host=hosts[n])
                  for n in ("home", "other")]  # fmt: skip
    try:
        for transport in transports:
            transport.start()
        at_home, away = transports
        away.connect(relayed_addr(relay_addr, home.peer_id))
        exchange_both_ways(at_home, away, rounds=5)
        assert away.outbound_lanes() == at_home.outbound_lanes() == []
        conns = other.libp2p.get_network().get_connections(ID.from_base58(home.peer_id))
        kinds = {c.muxed_conn.get_connection_type() for c in conns}
        assert kinds == {ConnectionType.RELAYED}
    finally:
        for transport in transports:
            transport.close()


async def _hang_up(libp2p, peer: ID) -> None:
    await libp2p.get_network().close_peer(peer)


def test_a_circuit_that_ends_leaves_the_others_to_the_same_member_standing(tmp_path):
    """py-libp2p 0.8.1's relay files each circuit's streams under its ends' peer ids: a newer
    circuit to the same member replaced the older one's entry, and when the older one ended,
    its cleanup closed the newer one's streams (docs/nat.md: relayed frames stalled). A new
    stream then redialled through a fresh circuit, so only the connection shows it."""
    with relayed_hosts(tmp_path, more=("third",)) as (hosts, clients):
        home, other, third = hosts["home"], hosts["other"], hosts["third"]
        relay_addr = hosts["relay"].addrs[0]
        home.set_stream_handler(ECHO, _echo)
        assert clients["home"].reserve(hosts["relay"].peer_id)
        home_id = ID.from_base58(home.peer_id)
        for host in (third, other):  # two circuits to home, the older one third's
            host.connect(relayed_addr(relay_addr, home.peer_id), timeout=20.0)
            assert host.call(_ask, host.libp2p, home_id, b"hello") == (b"hello", RELAYED)
        (newer,) = other.libp2p.get_network().get_connections(home_id)
        third.call(_hang_up, third.libp2p, home_id)  # the older circuit ends
        ends = home.libp2p.get_network().get_connections
        wait_for(lambda: not ends(ID.from_base58(third.peer_id)), 20, "the older circuit to end")
        for i in range(4):  # the relay cleaned up while the newer circuit carries streams
            payload = f"still {i}".encode()
            assert other.call(_ask, other.libp2p, home_id, payload) == (payload, RELAYED)
            time.sleep(0.5)
        assert other.libp2p.get_network().get_connections(home_id) == [newer]
        assert not newer.muxed_conn.is_closed
