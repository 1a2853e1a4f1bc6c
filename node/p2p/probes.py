"""The bandwidth/RTT probe: ``/fusionllm/probe/3.0.0``, one new stream per probe.

    client: "FLP3" | u64 nbytes | 16-byte nonce   server: 1 status byte (0 ok, else refused, EOF)
    client: 8 random bytes  x3                    server: echoes each (RTT = min of the 3)
    client: nbytes of payload, random tail        server: BLAKE2b-128 of the payload, keyed
                                                          by the nonce, once all of it arrived,
                                                          then u64 tail bytes | u64 tail ns

Two figures make the bandwidth (``probe_bandwidth``). The whole probe: nbytes over the time
from the first payload byte written to the ack read, less one RTT. On a far, fast link that
mostly times TCP's slow start (1 MiB over 100 Mbit/s and 100 ms read 2.6 MB/s of 12.5 cold,
docs/testbed.md): so the server also times the payload's second half as it arrives (the
"tail", from the read that passed half of it to the last), when the window has opened. The
tail's bytes are what the kernel received on the connection meanwhile (``TCP_INFO``
bytes_received), not what the server read: a reader throttled by its CPU quota drains a
backlog that arrived before its clock started, and counting that read 1.2-1.9x the cap on the
testbed (docs/results.md, session 8). Where the connection has no socket to ask (a relayed
circuit), the server sends no tail. The faster of the two counts, but never more than
``STEADY_TRUST`` times the whole probe's figure: the tail's timing is the server's word, and
what a lying server gains stays bounded. The round trip is the fastest of the pings and the
kernel's minimum RTT of the connection (a ping answered by a throttled peer counts its wait;
subtracting that from the whole probe's time read it high). Pings and
the nonce are fresh random bytes per probe, so a prober only accepts an echo or an ack made
from what it sent on this stream: a peer cannot answer early (to look near or fast) nor
replay an old answer; the payload ends in fresh random bytes and the stream is in order, so
the ack also proves that every byte before them arrived. The server refuses a request over
``max_bytes``, a second one from a peer whose probe is still running, one past
``max_per_peer_per_min``, or past ``max_concurrent``; every read runs under a deadline and a
misbehaving prober only gets its own stream reset. Both sides run in the host's trio thread.
"""

import dataclasses
import hashlib
import os
import secrets
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.id import ID

from fusionllm.common.errors import PeerError
from fusionllm.common.logs import get_logger
from fusionllm.node.errors import ControlError, DeadlineError, ProbeRefusedError
from fusionllm.node.p2p.conn_socket import kernel_view
from fusionllm.node.p2p.gossip import Count
from fusionllm.node.p2p.lane.tcp_info import TcpInfo
from fusionllm.node.p2p.peer_host import NETWORK_ERRORS, close_quietly, reset_quietly
from fusionllm.node.p2p.probe_wire import SendTimer
from fusionllm.node.p2p.relay_client import relayed_conn

logger = get_logger(__name__)

PROBE_PROTOCOL = TProtocol("/fusionllm/probe/3.0.0")
MAX_PROBE_BYTES = 256 << 20

PROBE_MAGIC = b"FLP3"
PROBE_HEADER = struct.Struct(">4sQ16s")  # magic, payload bytes, nonce
PING_BYTES = 8
ACK_BYTES = 16
TAIL = struct.Struct(">QQ")  # after the ack: tail bytes, tail nanoseconds (server's clock)
# The tail's figure counts up to this many times the whole probe's. Measured on the testbed
# (benchmarks/testbed_probes.py, docs/testbed.md): warm tails read 100 Mbit/s caps at 40-100 ms
# within 0.86-1.04, whole probes 0.40-0.94; but a reader that lagged under load, then drained
# its buffer, read 1.6-1.7x the cap, and the book keeps the best recent figure. The bound
# limits what a lying server gains and most over-reads, at some cost to slow whole probes.
STEADY_TRUST = 2.0
_PROBE_PINGS = 3
_PROBE_OK = 0
_PROBE_TOO_LARGE = 1
_PROBE_TOO_OFTEN = 2
_PROBE_BUSY = 3
_PROBE_ALREADY_RUNNING = 4
_PROBE_REASONS = {
    _PROBE_TOO_LARGE: "too large",
    _PROBE_TOO_OFTEN: "probed too often",
    _PROBE_BUSY: "busy",
    _PROBE_ALREADY_RUNNING: "a probe from this peer is still running",
}
_PROBE_CHUNK_BYTES = 256 << 10
# The kernel is asked for its rate after each write. Not smaller: on loopback 64 KiB writes
# moved 41 MB/s where 256 KiB moved 54 (medians of 8 alternating probes, load 4-9), and a
# LAN probe is CPU-bound (docs/results.md, session 8).
_PROBE_WRITE_BYTES = 256 << 10
_PROBE_TAIL_BYTES = 16
_PROBE_READ_BYTES = 64 << 10
_PROBE_WINDOW_S = 60.0

# Per-prober state is kept for at most this many peers; idle entries go first.
_MAX_TRACKED_PROBERS = 4096


@dataclass(frozen=True)
class ProbeResult:
    peer: str
    bandwidth: float  # bytes/s, the whole probe's or its tail's figure (probe_bandwidth)
    rtt: float  # s, the fastest of the ping round trips
    bytes: int
    seconds: float  # first payload byte written -> ack read
    tail_bandwidth: float = 0.0  # bytes/s the server timed the payload's second half at (0: none)
    wire_bandwidth: float = 0.0  # bytes/s our kernel timed the payload's ACKs at (0: none)
    relayed: bool = False  # measured through a relay (the path the peer's traffic takes)


def payload_hasher(nonce: bytes) -> "hashlib.blake2b":
    """What the server feeds every payload byte to; its digest is the ack."""
    return hashlib.blake2b(key=nonce, digest_size=ACK_BYTES)


async def run_probe(host: IHost, peer: ID, nbytes: int, timeout: float) -> ProbeResult:
    """Probe ``peer``; ProbeRefusedError, DeadlineError or ControlError if it fails."""
    stream: INetStream | None = None
    try:
        with trio.fail_after(timeout):
            stream = await host.new_stream(peer, [PROBE_PROTOCOL])
            result = await probe_over(stream, peer.to_base58(), nbytes)
        await close_quietly(stream)
        result = dataclasses.replace(result, relayed=relayed_conn(stream.muxed_conn))
    except trio.TooSlowError:
        await reset_quietly(stream)
        raise DeadlineError(f"probe of {nbytes} bytes to {peer} took over {timeout}s") from None
    except ControlError:
        await reset_quietly(stream)
        raise
    except (PeerError, *NETWORK_ERRORS) as exc:
        await reset_quietly(stream)
        logger.debug("probe to %s failed", peer, exc_info=True)
        raise ControlError(f"probe to {peer} failed: {type(exc).__name__}: {exc}") from exc
    return result


async def probe_over(
    stream: INetStream,
    peer: str,
    nbytes: int,
    kernel: Callable[[INetStream], Callable[[], TcpInfo | None] | None] = kernel_view,
) -> ProbeResult:
    """The client's side of one probe on an open stream (no deadline of its own)."""
    nonce = secrets.token_bytes(16)
    # A random block repeated, then fresh random bytes at the very end: the stream is in
    # order, so only a peer that read every byte has the tail to hash. (One random block, not
    # nbytes of them: os.urandom of a whole large probe would stall the host's trio thread.)
    block = os.urandom(min(nbytes, _PROBE_CHUNK_BYTES))
    tail = os.urandom(min(nbytes, _PROBE_TAIL_BYTES))
    expected = payload_hasher(nonce)
    rtt = await _request(stream, peer, nbytes, nonce)
    timer = SendTimer(kernel(stream))
    timer.mark()
    started = time.perf_counter()
    sent, body = 0, nbytes - len(tail)
    while sent < body:
        chunk = block[: min(len(block), body - sent, _PROBE_WRITE_BYTES)]
        expected.update(chunk)
        await stream.write(chunk)
        timer.mark()
        sent += len(chunk)
    expected.update(tail)
    await stream.write(tail)
    ack = await _read_exactly(stream, ACK_BYTES)
    seconds = time.perf_counter() - started
    timer.mark()
    if not secrets.compare_digest(ack, expected.digest()):
        raise ControlError(f"{peer} acked a probe with a digest of other bytes")
    tail_bytes, tail_ns = TAIL.unpack(await _read_exactly(stream, TAIL.size))
    tail = tail_bandwidth(nbytes, tail_bytes, tail_ns / 1e9)
    view = kernel(stream)
    rtt = _wire_rtt(view, rtt)
    wire = timer.figure(nbytes)
    wire_bandwidth = wire.bandwidth if wire is not None else 0.0
    return ProbeResult(
        peer=peer,
        # The kernel's figure is our own socket's, not the peer's word: it needs no bound.
        bandwidth=max(probe_bandwidth(nbytes, seconds, rtt, tail=tail), wire_bandwidth),
        rtt=rtt,
        bytes=nbytes,
        seconds=seconds,
        tail_bandwidth=tail,
        wire_bandwidth=wire_bandwidth,
    )


def _wire_rtt(view: Callable[[], TcpInfo | None] | None, pinged: float) -> float:
    """The faster of the pings' round trip and the kernel's minimum for the connection."""
    info = view() if view is not None else None
    if info is None or info.min_rtt_s <= 0:
        return pinged
    return min(pinged, info.min_rtt_s)


class KernelTail:
    """The payload's tail as the kernel received it: bytes that came off the wire between
    ``start`` and ``stop`` (whatever the server had read by then), over the server's clock.
    Each end reads the clock on the side that can only shorten the count."""

    def __init__(self, view: Callable[[], TcpInfo | None] | None, clock_ns: Callable[[], int]):
        self._view = view
        self._clock_ns = clock_ns
        self._from_ns = 0
        self._from_bytes: int | None = None

    def start(self) -> None:
        if self._view is None or self._from_bytes is not None:
            return
        self._from_ns = self._clock_ns()
        info = self._view()
        self._from_bytes = info.bytes_received if info is not None else None

    def stop(self, nbytes: int) -> tuple[int, int]:
        """(tail bytes, tail ns); (0, 0) where the kernel could not be asked at both ends."""
        info = self._view() if self._view is not None else None
        if info is None or self._from_bytes is None:
            return 0, 0
        tail_ns = self._clock_ns() - self._from_ns
        return min(max(info.bytes_received - self._from_bytes, 0), nbytes), tail_ns


def tail_bandwidth(nbytes: int, tail_bytes: int, tail_s: float) -> float:
    """Bytes/s of the payload's tail as the server timed it; 0 where that says nothing (a
    tail read in one go, or one outside the payload: a server's figures are checked)."""
    if not (nbytes // 8 <= tail_bytes <= nbytes and tail_bytes > 0 and tail_s > 0):
        return 0.0
    return tail_bytes / tail_s


def probe_bandwidth(nbytes: int, seconds: float, rtt: float, *, tail: float = 0.0) -> float:
    """Bytes/s of a probe that took ``seconds`` from its first byte to the ack, and whose tail
    the server timed at ``tail`` bytes/s (0: not timed).

    ``seconds`` ends with the ack's round trip, which the planner already charges as the
    link's RTT: net of it, a small probe no longer reads slower than a large one on the same
    link (16 KB probes read 3-4x below 64 KB ones on loopback). Never more than twice the raw
    figure, so a probe that is almost all round trip cannot claim a huge bandwidth. The tail
    (the window open) counts where faster, up to ``STEADY_TRUST`` times the whole figure."""
    whole = nbytes / max(seconds - rtt, seconds / 2)
    return max(whole, min(tail, STEADY_TRUST * whole))


async def _request(stream: INetStream, peer: str, nbytes: int, nonce: bytes) -> float:
    """Ask for a probe of ``nbytes`` and ping; the fastest round trip."""
    await stream.write(PROBE_HEADER.pack(PROBE_MAGIC, nbytes, nonce))
    (status,) = await _read_exactly(stream, 1)
    if status != _PROBE_OK:
        reason = _PROBE_REASONS.get(status, f"status {status}")
        raise ProbeRefusedError(f"{peer} refused a probe of {nbytes} bytes: {reason}")
    rtts = []
    for i in range(_PROBE_PINGS):
        ping = os.urandom(PING_BYTES)
        started = time.perf_counter()
        await stream.write(ping)
        echo = await _read_exactly(stream, PING_BYTES)
        rtts.append(time.perf_counter() - started)
        if echo != ping:
            raise ControlError(f"{peer} echoed {echo!r} to probe ping {i}")
    return min(rtts)


class ProbeServer:
    """Serves probes (the stream handler ``serve``) within its size, rate and slot limits.

    Made and used in the trio thread. ``count`` gets "probes_served", "probes_refused" and
    "probe_errors". One probe per peer at a time: a peer (or a stranger's one identity) never
    holds more than one of the ``max_concurrent`` slots.
    """

    def __init__(
        self,
        *,
        max_bytes: int,
        max_per_peer_per_min: int,
        max_concurrent: int,
        timeout_s: float,
        count: Count,
        kernel: Callable[[INetStream], Callable[[], TcpInfo | None] | None] = kernel_view,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        self._kernel = kernel  # the stream's connection as its kernel sees it (conn_socket.py)
        self._clock_ns = clock_ns
        self._max_bytes = max_bytes
        self._max_per_peer_per_min = max_per_peer_per_min
        self._timeout_s = timeout_s
        self._count = count
        self._slots = trio.Semaphore(max_concurrent)
        self._probes_by_peer: dict[str, deque[float]] = {}
        self._running: set[str] = set()  # peers whose probe holds a slot now

    async def serve(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        try:
            # Twice the client's default deadline: a client within its own deadline is served.
            with trio.fail_after(2 * self._timeout_s):
                await self._serve_steps(peer, stream)
        except (trio.TooSlowError, PeerError, *NETWORK_ERRORS):
            # The prober's fault (or its network's): drop this stream, keep everything else.
            self._count("probe_errors")
            logger.debug("dropping a probe stream from %s", peer, exc_info=True)
            await reset_quietly(stream)
        except Exception:
            self._count("probe_errors")
            logger.warning("unexpected error serving a probe to %s", peer, exc_info=True)
            await reset_quietly(stream)

    async def _serve_steps(self, peer: str, stream: INetStream) -> None:
        header = await _read_exactly(stream, PROBE_HEADER.size)
        magic, nbytes, nonce = PROBE_HEADER.unpack(header)
        if magic != PROBE_MAGIC or nbytes < 1:
            raise PeerError(f"bad probe header from {peer}: {magic!r}, {nbytes}")
        refusal = self._admit(peer, nbytes)
        if refusal == _PROBE_OK:
            try:
                self._slots.acquire_nowait()
            except trio.WouldBlock:
                refusal = _PROBE_BUSY
        if refusal != _PROBE_OK:
            self._count("probes_refused")
            logger.debug("refused a probe of %d bytes from %s: %s", nbytes, peer, refusal)
            await stream.write(bytes([refusal]))
            await close_quietly(stream)
            return
        self._running.add(peer)
        try:
            await stream.write(bytes([_PROBE_OK]))
            for _ in range(_PROBE_PINGS):
                await stream.write(await _read_exactly(stream, PING_BYTES))
            received = payload_hasher(nonce)
            remaining, half = nbytes, nbytes - nbytes // 2
            tail = KernelTail(self._kernel(stream), self._clock_ns)
            while remaining:
                chunk = await _read_some(stream, min(remaining, _PROBE_READ_BYTES))
                received.update(chunk)
                remaining -= len(chunk)
                if 0 < remaining <= half:  # the tail's clock starts here (once)
                    tail.start()
            tail_bytes, tail_ns = tail.stop(nbytes)
            # Counted before the ack, so a prober that has its result sees it counted here.
            self._count("probes_served")
            await stream.write(received.digest() + TAIL.pack(tail_bytes, tail_ns))
        finally:
            self._running.discard(peer)
            self._slots.release()
        await close_quietly(stream)

    def _admit(self, peer: str, nbytes: int) -> int:
        if nbytes > self._max_bytes:
            return _PROBE_TOO_LARGE
        if peer in self._running:
            return _PROBE_ALREADY_RUNNING
        now = time.monotonic()
        recent = self._probes_by_peer.setdefault(peer, deque())
        while recent and now - recent[0] >= _PROBE_WINDOW_S:
            recent.popleft()
        if len(recent) >= self._max_per_peer_per_min:
            return _PROBE_TOO_OFTEN
        recent.append(now)
        if len(self._probes_by_peer) > _MAX_TRACKED_PROBERS:
            for other, times in list(self._probes_by_peer.items()):
                if not times or now - times[-1] >= _PROBE_WINDOW_S:
                    del self._probes_by_peer[other]
        return _PROBE_OK


async def _read_some(stream: INetStream, n: int) -> bytes:
    """Up to ``n`` bytes (py-libp2p returns one muxer frame at most); EOF is an error."""
    try:
        data = await stream.read(n)
    except StreamEOF:
        data = b""
    except StreamReset as exc:
        raise PeerError("probe stream reset by peer") from exc
    if not data:
        raise PeerError("probe stream ended early")
    return data


async def _read_exactly(stream: INetStream, n: int) -> bytes:
    buffer = bytearray()
    while len(buffer) < n:
        buffer += await _read_some(stream, n - len(buffer))
    return bytes(buffer)
