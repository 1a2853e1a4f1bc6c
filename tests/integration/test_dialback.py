"""Dial-back between two real PeerHosts on 127.0.0.1: a member is dialled back at its
listen port, and in a private swarm (py-libp2p 0.8.1 cannot type its connections) the
server refuses, and its host lives on (an error escaping a handler once ended it)."""

import os

import pytest
from libp2p.peer.id import ID

from fusionllm.common.swarm_key import SwarmKey
from fusionllm.node.p2p.dialback import DIALBACK_PROTOCOL, DialBackConfig, DialBackServer, ask
from fusionllm.node.p2p.peer_host import HostConfig, PeerHost

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

CONFIG = DialBackConfig(dial_timeout_s=3.0)


def _port(host: PeerHost) -> int:
    return int(host.bound_addrs[0].split("/tcp/")[1].split("/")[0])


@pytest.mark.parametrize("private", [False, True], ids=["public swarm", "private swarm"])
def test_a_member_is_dialled_back_and_a_private_swarm_is_refused_safely(tmp_path, private):
    key = SwarmKey(os.urandom(32)) if private else None
    server = PeerHost(HostConfig(key_path=tmp_path / "s.key", swarm_key=key)).start()
    client = PeerHost(HostConfig(key_path=tmp_path / "c.key", swarm_key=key)).start()
    try:
        dialback = DialBackServer(CONFIG)
        server.set_stream_handler(DIALBACK_PROTOCOL, dialback.serve)
        peer = ID.from_base58(client.connect(server.addrs[0]))
        answer = client.call(ask, client.libp2p, peer, [_port(client)], CONFIG)
        assert answer.observed_ip == ("0.0.0.0" if private else "127.0.0.1")
        assert answer.refused is private
        assert answer.reached == {_port(client): not private}
        # the server's host lives on: a newcomer connects and is answered
        with PeerHost(HostConfig(key_path=tmp_path / "n.key", swarm_key=key)) as newcomer:
            newcomer.connect(server.addrs[0], timeout=5.0)
            again = newcomer.call(ask, newcomer.libp2p, peer, [_port(newcomer)], CONFIG)
            assert again.refused is private
        assert dialback.counts == {"served": 2 * (not private), "refused": 2 * private,
                                   "errors": 0}  # fmt: skip
    finally:
        client.close()
        server.close()
