"""The TCP socket under a py-libp2p stream's connection, for the kernel's view of it.

A probe timed by the node's Python reads and writes reads the CPU share it got, not the link:
a reader throttled by its cgroup drains a backlog the kernel received earlier, and a ping
answered late adds the wait to the round trip (issue 25: 1.2-1.9x over-reads on a loaded
testbed). The kernel counts received bytes and times round trips itself (``TCP_INFO``), so
the probe asks it where the connection is plain TCP.

py-libp2p 0.8.1 exposes no socket: it is found by walking the layers a TCP connection has
(yamux -> secure session -> noise packets -> raw connection -> trio stream -> socket). None
where a layer is missing (a relayed circuit, QUIC, another py-libp2p): callers then do
without the kernel's figures rather than guess.
"""

from collections.abc import Callable

import trio

from fusionllm.node.p2p.lane.tcp_info import TcpInfo, TcpInfoError, read_tcp_info
from fusionllm.node.p2p.relay_client import relayed_conn

# The attribute each layer keeps the one below it in, first match wins at each step.
_LAYERS = ("secured_conn", "conn", "read_writer", "read_write_closer", "stream")
_MAX_DEPTH = 8


def connection_socket(stream: object) -> trio.socket.SocketType | None:
    """The TCP socket carrying ``stream``'s connection, or None if there is none to find."""
    layer = getattr(stream, "muxed_conn", None)
    for _ in range(_MAX_DEPTH):
        if layer is None:
            return None
        sock = getattr(layer, "socket", None)
        if isinstance(sock, trio.socket.SocketType):
            return sock
        layer = next(
            (below for name in _LAYERS if (below := getattr(layer, name, None)) is not None),
            None,
        )
    return None


def kernel_view(stream: object) -> Callable[[], TcpInfo | None] | None:
    """A reader of the kernel's ``TCP_INFO`` for ``stream``'s connection (None where it has
    no socket to read; the reader returns None once the socket cannot be read)."""
    # A relayed circuit's socket goes to the relay and carries others' circuits too.
    if relayed_conn(getattr(stream, "muxed_conn", None)):
        return None
    sock = connection_socket(stream)
    if sock is None:
        return None

    def read() -> TcpInfo | None:
        try:
            return read_tcp_info(sock)
        except TcpInfoError:
            return None

    return read
