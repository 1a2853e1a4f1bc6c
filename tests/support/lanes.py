"""A lane over real loopback TCP for unit tests: its writer and the receiving socket."""

import socket

import trio

from fusionllm.node.p2p.lane.seal import LANE_KEY_BYTES
from fusionllm.node.p2p.lane.stream import LaneWriter

KEY = bytes(range(LANE_KEY_BYTES))


def loopback_lane() -> tuple[LaneWriter, socket.socket]:
    """A connected lane writer and the socket its frames arrive on (the caller closes both)."""
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    server.close()
    return LaneWriter(trio.socket.from_stdlib_socket(client), KEY), peer
