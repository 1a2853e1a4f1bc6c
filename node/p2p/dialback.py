"""Dial-back, ``/fusionllm/dialback/1.0.0``: may peers dial this node? Asked of members.

    client: "FLD1" | u8 n | n x u16 port     server: u8 len | the IP it sees (ASCII) | n x u8

The server dials the client back at the IP the request came from (never one the client
names: nobody can aim a member at a third party) on each port with a plain TCP connect, and
answers, per port, whether it opened (it is closed at once). The client learns what its
router shows the world (its observed IP) and whether that address takes connections from
outside: ``reachability.judge`` makes the verdict. A TCP connect proves the port is open
from outside, not which program answers (a private swarm's listener speaks only its
pre-shared key's cipher); it opens no libp2p connection on purpose: py-libp2p's gossipsub
drops a peer from its mesh when *any* of its connections closes (``PubsubNotifee``), so a
test connection, opened and closed, cut gossip with the member that asked.

Why not py-libp2p 0.8.1's AutoNAT v1 (``libp2p.host.autonat``): its server dials back with
``host.connect``, which returns at once when a connection to the peer exists, and the
request itself came on one; on the testbed it answered OK within 0.1 s to a node behind a
cone and one behind a symmetric NAT, whose routers drop every unasked connection
(``tests/testbed/test_reachability.py``). Given only private listen addresses, it refuses.

The server answers at most one request per peer per ``min_interval_s``, ``max_concurrent``
at a time, reads under a deadline and dials under one: a bad peer only loses its stream.
"""

import ipaddress
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import trio
from libp2p.abc import IHost, INetStream
from libp2p.connection_types import ConnectionType
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from fusionllm.common.errors import ConfigError, PeerError
from fusionllm.common.logs import get_logger
from fusionllm.node.errors import ControlError, DeadlineError
from fusionllm.node.p2p.peer_host import NETWORK_ERRORS, close_quietly, reset_quietly
from fusionllm.node.p2p.stream_reader import StreamReader

logger = get_logger(__name__)

DIALBACK_PROTOCOL = TProtocol("/fusionllm/dialback/1.0.0")
MAGIC = b"FLD1"
MAX_PORTS = 4
REACHED, FAILED, REFUSED = 0, 1, 2
_MAX_IP_TEXT = 45  # the longest IPv6 text
_MAX_TRACKED_PEERS = 4096


@dataclass(frozen=True, kw_only=True)
class DialBackConfig:
    dial_timeout_s: float = 5.0  # a dropped SYN is retried for ~2 min: never wait on it
    read_timeout_s: float = 5.0
    min_interval_s: float = 10.0  # between two requests one peer gets served
    max_concurrent: int = 4

    def __post_init__(self) -> None:
        for name in ("dial_timeout_s", "read_timeout_s", "min_interval_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value <= 600):
                raise ConfigError(f"{name} must be in (0, 600] s, got {value!r}")
        if not (isinstance(self.max_concurrent, int) and 1 <= self.max_concurrent <= 64):
            raise ConfigError(f"max_concurrent must be in [1, 64], got {self.max_concurrent!r}")

    @property
    def answer_timeout_s(self) -> float:
        """How long a client waits for the answer to a request of ``MAX_PORTS`` ports."""
        return self.read_timeout_s + MAX_PORTS * self.dial_timeout_s + 5.0


@dataclass(frozen=True, kw_only=True)
class DialBackAnswer:
    """One member's answer: the IP it saw us at, and per port asked whether it got through."""

    peer: str
    observed_ip: str
    reached: dict[int, bool]
    refused: bool = False  # the member would not try (rate, busy, or not a member to it)


def encode_request(ports: Sequence[int]) -> bytes:
    if not 1 <= len(ports) <= MAX_PORTS or not all(0 < p < 65536 for p in ports):
        raise ValueError(f"ports {list(ports)}: 1-{MAX_PORTS} of 1-65535")
    return MAGIC + struct.pack(f">B{len(ports)}H", len(ports), *ports)


def decode_answer(peer: str, data: bytes, ports: Sequence[int]) -> DialBackAnswer:
    """The server's answer to a request for ``ports``; PeerError if it is not one."""
    if not data or len(data) != 1 + data[0] + len(ports):
        raise PeerError(f"{peer}: a dial-back answer of {len(data)} bytes for {len(ports)} ports")
    text = data[1 : 1 + data[0]]
    try:
        observed = str(ipaddress.ip_address(text.decode("ascii")))
    except (UnicodeDecodeError, ValueError):
        raise PeerError(f"{peer}: dial-back answer names no IP: {text[:64]!r}") from None
    statuses = data[1 + data[0] :]
    if any(s not in (REACHED, FAILED, REFUSED) for s in statuses):
        raise PeerError(f"{peer}: dial-back statuses {list(statuses)}")
    return DialBackAnswer(
        peer=peer,
        observed_ip=observed,
        reached={p: s == REACHED for p, s in zip(ports, statuses, strict=True)},
        refused=all(s == REFUSED for s in statuses),
    )


async def _read_exactly(reader: StreamReader, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = await reader.read(n - len(data))
        if not part:
            raise PeerError(f"stream ended after {len(data)} of {n} bytes")
        data += part
    return data


async def ask(
    host: IHost, peer: ID, ports: Sequence[int], config: DialBackConfig
) -> DialBackAnswer:
    """Ask ``peer`` to dial us back on ``ports``; DeadlineError or ControlError if it fails."""
    request = encode_request(ports)
    stream: INetStream | None = None
    try:
        with trio.fail_after(config.answer_timeout_s):
            stream = await host.new_stream(peer, [DIALBACK_PROTOCOL])
            await stream.write(request)
            reader = StreamReader(stream)
            (length,) = await _read_exactly(reader, 1)
            if length > _MAX_IP_TEXT:
                raise PeerError(f"{peer}: an observed IP of {length} characters")
            rest = await _read_exactly(reader, length + len(ports))
        await close_quietly(stream)
    except trio.TooSlowError:
        await reset_quietly(stream)
        timeout = config.answer_timeout_s
        raise DeadlineError(f"dial-back from {peer}: no answer in {timeout}s") from None
    except (PeerError, *NETWORK_ERRORS) as exc:
        await reset_quietly(stream)
        raise ControlError(f"dial-back from {peer} failed: {type(exc).__name__}: {exc}") from exc
    return decode_answer(peer.to_base58(), bytes([length]) + rest, ports)


class DialBackServer:
    """Serves dial-back requests (``serve`` is the stream handler) within its limits.

    Made and used in the trio thread. ``allow(peer)`` says whom to serve (the swarm's
    members); ``counts`` has "served", "refused" and "errors".
    """

    def __init__(
        self,
        config: DialBackConfig,
        *,
        allow: Callable[[str], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
        connect: Callable[[str, int], Awaitable[trio.abc.Stream]] = trio.open_tcp_stream,
    ) -> None:
        self._connect = connect
        self._config = config
        self._allow = allow or (lambda _peer: True)
        self._clock = clock
        self._last: dict[str, float] = {}  # peer -> when it was last served
        self._active = 0
        self.counts = {"served": 0, "refused": 0, "errors": 0}

    async def serve(self, stream: INetStream) -> None:
        peer_id = stream.muxed_conn.peer_id
        peer = peer_id.to_base58()
        try:
            with trio.fail_after(self._config.read_timeout_s):
                ports = await _read_request(StreamReader(stream))
            ip = None if _is_relayed(stream) else _observed_ip(stream)
            if ip is None or not self._admit(peer):
                self.counts["refused"] += 1
                statuses = [REFUSED] * len(ports)
            else:
                self._active += 1
                try:
                    statuses = [await self._dial(peer_id, ip, port) for port in ports]
                finally:
                    self._active -= 1
                self.counts["served"] += 1
            text = (ip or "0.0.0.0").encode("ascii")
            await stream.write(bytes([len(text)]) + text + bytes(statuses))
            await close_quietly(stream)
        except (trio.TooSlowError, PeerError, *NETWORK_ERRORS):
            self.counts["errors"] += 1
            logger.debug("dial-back request from %s failed", peer, exc_info=True)
            await reset_quietly(stream)

    def _admit(self, peer: str) -> bool:
        now = self._clock()
        last = self._last.get(peer)
        if not self._allow(peer) or self._active >= self._config.max_concurrent:
            return False
        if last is not None and now - last < self._config.min_interval_s:
            return False
        if len(self._last) >= _MAX_TRACKED_PEERS:
            del self._last[min(self._last, key=self._last.__getitem__)]
        self._last[peer] = now
        return True

    async def _dial(self, peer: ID, ip: str, port: int) -> int:
        """REACHED if a new TCP connection to ``ip:port`` opens in time, else FAILED."""
        try:
            with trio.move_on_after(self._config.dial_timeout_s):
                # a new connection: the one the request came on proves nothing about inbound
                # ones (py-libp2p's AutoNAT v1 answers over it, see the module docstring)
                stream = await self._connect(ip, port)
                await stream.aclose()
                return REACHED
        except OSError:
            logger.debug("dial-back to %s at %s:%d failed", peer, ip, port, exc_info=True)
        return FAILED


async def _read_request(reader: StreamReader) -> list[int]:
    head = await _read_exactly(reader, len(MAGIC) + 1)
    if head[: len(MAGIC)] != MAGIC or not 1 <= head[-1] <= MAX_PORTS:
        raise PeerError(f"not a dial-back request: {head!r}")
    ports = list(struct.unpack(f">{head[-1]}H", await _read_exactly(reader, 2 * head[-1])))
    if 0 in ports:
        raise PeerError("a dial-back request for port 0")
    return ports


def _observed_ip(stream: INetStream) -> str | None:
    try:
        remote = stream.get_remote_address()
        return str(ipaddress.ip_address(remote[0])) if remote else None
    except Exception:  # whatever py-libp2p raises, we know no address
        return None


def _is_relayed(stream: INetStream) -> bool:
    """Over a relay the remote address is the relay's: never dial it back. Fails closed: a
    connection py-libp2p cannot type counts as relayed (0.8.1 raises AttributeError for
    every connection of a private swarm: its PskConn sets neither ``_connection_type`` nor
    ``_actual_addresses``, so members of a private swarm get no dial-back yet)."""
    try:
        return stream.muxed_conn.get_connection_type() is not ConnectionType.DIRECT
    except Exception:  # an error escaping a handler ends the host's thread (seen here)
        return True
