"""A py-libp2p stream as a ``framing.Reader``."""

from libp2p.abc import INetStream
from libp2p.network.stream.exceptions import StreamEOF, StreamReset

from fusionllm.node.errors import TransportError


class StreamReader:
    """A py-libp2p stream as a framing.Reader: EOF is b"", a reset is a TransportError."""

    def __init__(self, stream: INetStream) -> None:
        self._stream = stream

    async def read(self, n: int) -> bytes:
        try:
            return await self._stream.read(n)
        except StreamEOF:
            return b""
        except StreamReset as exc:
            raise TransportError("stream reset by peer") from exc
