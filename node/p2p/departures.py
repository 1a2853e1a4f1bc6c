"""A libp2p notifee that says when a peer's last connection closed (by its base58 id)."""

from collections.abc import Callable

from libp2p.abc import INetConn, INetStream, INetwork, INotifee


class Departures(INotifee):
    """Tells the transport when a peer's last connection closed."""

    def __init__(self, on_gone: Callable[[str], None]) -> None:
        self._on_gone = on_gone

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        peer = conn.muxed_conn.peer_id
        if not network.get_connections(peer):
            self._on_gone(peer.to_base58())

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        pass

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def listen(self, network: INetwork, multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr) -> None:
        pass
