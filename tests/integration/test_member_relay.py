"""A member's relay on 127.0.0.1 (node/p2p/member_relay.py): members reserve a slot and
meet through it, a stranger can neither reserve nor open a circuit."""

import pytest
from libp2p.connection_types import ConnectionType
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from fusionllm.common.errors import FusionError
from fusionllm.node.p2p.member_relay import MemberRelay, MemberRelayConfig
from fusionllm.node.p2p.peer_host import HostConfig, PeerHost
from tests.support.relay_client import dial_through, relay_client, reserve

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

ECHO = TProtocol("/fusionllm/test-echo/1.0.0")


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
        relay_id = ID.from_base58(hosts["relay"].peer_id)
        clients = {}
        for name in ("home", "other", "stranger"):
            host = hosts[name]
            clients[name] = host.start_service(relay_client, host.libp2p).value
            host.connect(relay_addr)
        hosts["home"].set_stream_handler(ECHO, _echo)
        assert hosts["home"].call(reserve, clients["home"], relay_id)
        home_id = ID.from_base58(hosts["home"].peer_id)
        other = hosts["other"]
        other.call(dial_through, clients["other"], relay_addr, home_id)
        answer = other.call(_ask, other.libp2p, home_id, b"through the relay")
        assert answer == (b"through the relay", ConnectionType.RELAYED)
        stranger = hosts["stranger"]
        assert not stranger.call(reserve, clients["stranger"], relay_id)
        with pytest.raises((FusionError, ConnectionError, OSError)):
            stranger.call(dial_through, clients["stranger"], relay_addr, home_id)
        assert relay.counts["refused"] >= 2
    finally:
        for host in hosts.values():
            host.close()
