"""A stream handler that raises ends its stream, never the host (PeerHost's handlers)."""

import pytest
import trio
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID

from fusionllm.node.p2p.peer_host import HostConfig, PeerHost

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

BROKEN = TProtocol("/fusionllm/test-broken/1.0.0")
ECHO = TProtocol("/fusionllm/test-echo/1.0.0")


async def _broken(stream) -> None:
    await stream.read(4)
    raise AttributeError("'PskConn' object has no attribute '_connection_type'")


async def _echo(stream) -> None:
    await stream.write(await stream.read(16))
    await stream.close()


async def _ask(libp2p, peer: ID, protocol: TProtocol) -> bytes:
    with trio.fail_after(10):
        stream = await libp2p.new_stream(peer, [protocol])
        await stream.write(b"ping")
        try:
            return await stream.read(16)
        except StreamError:
            return b"<reset>"


def test_a_handler_that_raises_ends_its_stream_and_the_host_serves_on(tmp_path):
    with PeerHost(HostConfig(key_path=tmp_path / "s.key")) as server, \
         PeerHost(HostConfig(key_path=tmp_path / "c.key")) as client:  # fmt: skip
        server.set_stream_handler(BROKEN, _broken)
        server.set_stream_handler(ECHO, _echo)
        peer = ID.from_base58(client.connect(server.addrs[0]))
        assert client.call(_ask, client.libp2p, peer, BROKEN) in (b"", b"<reset>")
        assert client.call(_ask, client.libp2p, peer, ECHO) == b"ping"
        with PeerHost(HostConfig(key_path=tmp_path / "n.key")) as newcomer:
            newcomer.connect(server.addrs[0])
            assert newcomer.call(_ask, newcomer.libp2p, peer, ECHO) == b"ping"
