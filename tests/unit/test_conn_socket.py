"""Finding the TCP socket under a py-libp2p stream (node/p2p/conn_socket.py): through the
layers a direct connection has, never through a relayed circuit, None where a layer is
missing."""

from types import SimpleNamespace

import trio
from libp2p.network.connection.raw_connection import ConnectionType

from fusionllm.node.p2p.conn_socket import connection_socket, kernel_view


def _layers(sock, *, relayed: bool = False) -> SimpleNamespace:
    """yamux -> secure session -> noise packets -> raw connection -> trio stream -> socket."""
    trio_stream = SimpleNamespace(socket=sock)
    raw = SimpleNamespace(stream=SimpleNamespace(stream=trio_stream))
    noise = SimpleNamespace(read_writer=SimpleNamespace(read_write_closer=raw))
    kind = ConnectionType.RELAYED if relayed else ConnectionType.DIRECT
    muxed = SimpleNamespace(
        secured_conn=SimpleNamespace(conn=noise), get_connection_type=lambda: kind
    )
    return SimpleNamespace(muxed_conn=muxed)


def test_the_socket_is_found_through_the_layers_and_read_by_the_kernel():
    async def main():
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        client = trio.socket.socket()
        await client.connect(listener.getsockname())
        with listener, client:
            stream = _layers(client)
            assert connection_socket(stream) is client
            info = kernel_view(stream)()
            assert info is not None
            assert info.state == 1  # established
            assert kernel_view(_layers(client, relayed=True)) is None

    trio.run(main)


def test_no_socket_no_view():
    assert connection_socket(SimpleNamespace(muxed_conn=SimpleNamespace(peer_id="p"))) is None
    assert connection_socket(object()) is None
    assert kernel_view(_layers("not a socket")) is None
