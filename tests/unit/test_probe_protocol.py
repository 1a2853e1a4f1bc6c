"""The bandwidth probe's protocol (node/p2p/probes.py) over in-memory stream pairs: the ack
proves the payload arrived, echoes prove the pings did, nonces are fresh, and the server
serves one probe per peer at a time within its slots."""

import os
from dataclasses import replace
from types import SimpleNamespace

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.network.stream.exceptions import StreamEOF, StreamReset
from libp2p.peer.id import ID

from fusionllm.node.errors import ControlError, ProbeRefusedError
from fusionllm.node.p2p.lane.tcp_info import TcpInfo
from fusionllm.node.p2p.probes import (
    ACK_BYTES,
    PING_BYTES,
    PROBE_HEADER,
    PROBE_MAGIC,
    STEADY_TRUST,
    TAIL,
    ProbeServer,
    payload_hasher,
    probe_bandwidth,
    probe_over,
    tail_bandwidth,
)


class FakeStream:
    """One end of an in-memory stream: reads return what the other end wrote, at most ``n``."""

    def __init__(self, inbox, outbox, peer: ID) -> None:
        self._inbox, self._outbox = inbox, outbox
        self._buffer = b""
        self.muxed_conn = SimpleNamespace(peer_id=peer)
        self.written: list[bytes] = []
        self.was_reset = False

    async def read(self, n: int) -> bytes:
        if not self._buffer:
            try:
                self._buffer = await self._inbox.receive()
            except trio.EndOfChannel:
                raise StreamEOF() from None
            except trio.ClosedResourceError:
                raise StreamReset() from None
        data, self._buffer = self._buffer[:n], self._buffer[n:]
        return data

    async def write(self, data: bytes) -> None:
        self.written.append(bytes(data))
        await self._outbox.send(bytes(data))

    async def close(self) -> None:
        await self._outbox.aclose()

    async def reset(self) -> None:
        self.was_reset = True
        await self._outbox.aclose()
        await self._inbox.aclose()


def stream_pair(client_peer: ID, server_peer: ID) -> tuple[FakeStream, FakeStream]:
    to_server_send, to_server_recv = trio.open_memory_channel(1 << 16)
    to_client_send, to_client_recv = trio.open_memory_channel(1 << 16)
    client = FakeStream(to_client_recv, to_server_send, server_peer)
    server = FakeStream(to_server_recv, to_client_send, client_peer)
    return client, server


def new_peer() -> ID:
    return ID.from_pubkey(create_new_key_pair().public_key)


class Counter(dict):
    def __call__(self, name: str, n: int = 1) -> None:
        self[name] = self.get(name, 0) + n


def new_server(count: Counter, **overrides) -> ProbeServer:
    fields = {"max_bytes": 1 << 20, "max_per_peer_per_min": 100, "max_concurrent": 2}
    return ProbeServer(**{**fields, **overrides}, timeout_s=5.0, count=count)


async def probe(server: ProbeServer, client_peer: ID, nbytes: int = 100_000):
    client, server_end = stream_pair(client_peer, new_peer())
    error = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve, server_end)
        try:
            result = await probe_over(client, "server", nbytes)
        except Exception as exc:  # raised out here, not inside the nursery's group
            error = exc
            await client.reset()
    if error is not None:
        raise error
    return result, client


async def stall_after_header(server: ProbeServer, peer: ID, nursery) -> FakeStream:
    """A prober that asks, is admitted, and sends nothing more: it holds a slot."""
    client, server_end = stream_pair(peer, new_peer())
    nursery.start_soon(server.serve, server_end)
    await client.write(PROBE_HEADER.pack(PROBE_MAGIC, 1000, os.urandom(16)))
    assert await client.read(1) == b"\x00"
    return client


def test_honest_probe_is_acked_with_the_keyed_digest_of_its_payload():
    count = Counter()

    async def main():
        result, client = await probe(new_server(count), new_peer(), nbytes=300_000)
        assert result.bytes == 300_000
        assert result.bandwidth > 0
        header = client.written[0]
        magic, nbytes, nonce = PROBE_HEADER.unpack(header)
        assert (magic, nbytes) == (PROBE_MAGIC, 300_000)
        payload = b"".join(client.written[1 + 3 :])
        assert len(payload) == 300_000
        assert payload != bytes(300_000)  # random, not zeros a liar could hash unseen
        expected = payload_hasher(nonce)
        expected.update(payload)
        assert len(expected.digest()) == ACK_BYTES
        return nonce

    first, second = trio.run(main), trio.run(main)
    assert first != second  # a fresh nonce per probe
    assert count == {"probes_served": 2}


async def _lying_server(stream: FakeStream, *, ack: bytes | None, echo_early: bool) -> None:
    header = await stream.read(PROBE_HEADER.size)
    _magic, nbytes, _nonce = PROBE_HEADER.unpack(header)
    await stream.write(b"\x00")
    if echo_early:  # echoes sent before the pings arrive: they cannot match
        await stream.write(bytes(3 * PING_BYTES))
        return
    for _ in range(3):
        await stream.write(await stream.read(PING_BYTES))
    await stream.write(ack + TAIL.pack(0, 0))  # acked at once, without reading the payload
    got = 0
    while got < nbytes:
        got += len(await stream.read(1 << 16))
    await stream.close()


@pytest.mark.parametrize(
    "ack",
    [bytes(ACK_BYTES), payload_hasher(bytes(16)).digest()],
    ids=["zeros", "digest-of-nothing"],
)
def test_ack_that_does_not_prove_the_payload_is_refused(ack):
    async def main():
        client, server_end = stream_pair(new_peer(), new_peer())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _lying_server(server_end, ack=ack, echo_early=False))
            with pytest.raises(ControlError, match="digest of other bytes"):
                await probe_over(client, "liar", 50_000)

    trio.run(main)


def test_echoes_sent_before_the_pings_are_refused():
    async def main():
        client, server_end = stream_pair(new_peer(), new_peer())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _lying_server(server_end, ack=None, echo_early=True))
            with pytest.raises(ControlError, match="echoed"):
                await probe_over(client, "liar", 50_000)

    trio.run(main)


def test_one_probe_per_peer_and_others_still_served():
    count = Counter()
    server = new_server(count, max_concurrent=2)
    stranger, honest = new_peer(), new_peer()

    async def main():
        async with trio.open_nursery() as nursery:
            held = await stall_after_header(server, stranger, nursery)
            # The stranger's second probe is refused: it may hold one slot, not all of them.
            with pytest.raises(ProbeRefusedError, match="still running"):
                await probe(server, stranger)
            result, _ = await probe(server, honest)
            assert result.bytes == 100_000
            await held.reset()

    trio.run(main)
    assert count == {"probes_refused": 1, "probes_served": 1, "probe_errors": 1}


def test_all_slots_taken_by_distinct_peers_is_busy_and_frees_on_exit():
    count = Counter()
    server = new_server(count, max_concurrent=2)

    async def main():
        async with trio.open_nursery() as nursery:
            held = [await stall_after_header(server, new_peer(), nursery) for _ in range(2)]
            with pytest.raises(ProbeRefusedError, match="busy"):
                await probe(server, new_peer())
            await held[0].reset()
            await trio.testing.wait_all_tasks_blocked()
            result, _ = await probe(server, new_peer())
            assert result.bytes == 100_000
            await held[1].reset()

    trio.run(main)
    assert count == {"probes_refused": 1, "probes_served": 1, "probe_errors": 2}


def test_a_finished_probe_frees_the_peer_for_the_next():
    count = Counter()
    server = new_server(count)
    peer = new_peer()

    async def main():
        for _ in range(3):
            await probe(server, peer)

    trio.run(main)
    assert count == {"probes_served": 3}


@pytest.mark.parametrize(
    "header",
    [
        b"FLP1" + (1000).to_bytes(8, "big") + bytes(16),
        PROBE_MAGIC + (0).to_bytes(8, "big") + bytes(16),
    ],
    ids=["old-magic", "zero-bytes"],
)
def test_bad_header_is_a_probe_error(header):
    count = Counter()

    async def main():
        client, server_end = stream_pair(new_peer(), new_peer())
        await client.write(header)
        await new_server(count).serve(server_end)
        assert server_end.was_reset

    trio.run(main)
    assert count == {"probe_errors": 1}


def test_probe_bandwidth_is_net_of_the_acks_round_trip_and_at_most_twice_the_raw_figure():
    # 1 MB in 10 ms with a 2 ms round trip: 8 ms of transfer.
    assert probe_bandwidth(1_000_000, 0.010, 0.002) == pytest.approx(125e6)
    # The same link probed with a quarter of the bytes reads the same, not 2/3 of it.
    assert probe_bandwidth(250_000, 0.004, 0.002) == pytest.approx(125e6)
    # Almost all round trip (a ping slower than the whole probe, on a busy host): capped.
    assert probe_bandwidth(16_000, 0.001, 0.0009) == pytest.approx(32e6)
    assert probe_bandwidth(16_000, 0.001, 0.005) == pytest.approx(32e6)
    assert probe_bandwidth(16_000, 0.001, 0.0) == pytest.approx(16e6)


def test_the_tail_counts_where_faster_up_to_the_trust_factor():
    """1 MB in 1.002 s with a 2 ms round trip: 1 MB/s whole (slow start on a far link); the
    server timed the second half at 1.8 MB/s (the window open): that is the link."""
    assert probe_bandwidth(1_000_000, 1.002, 0.002, tail=1.8e6) == pytest.approx(1.8e6)
    assert probe_bandwidth(1_000_000, 1.002, 0.002, tail=0.5e6) == pytest.approx(1e6)
    assert probe_bandwidth(1_000_000, 1.002, 0.002, tail=0.0) == pytest.approx(1e6)
    # A server claiming its tail came in at 1 GB/s gains at most STEADY_TRUST.
    assert probe_bandwidth(1_000_000, 1.002, 0.002, tail=1e9) == pytest.approx(STEADY_TRUST * 1e6)


@pytest.mark.parametrize(
    ("tail_bytes", "tail_s", "expected"),
    [(500_000, 0.1, 5e6), (125_000, 0.1, 1.25e6), (124_999, 0.1, 0.0), (1_000_001, 0.1, 0.0),
     (0, 0.1, 0.0), (500_000, 0.0, 0.0)],
)  # fmt: skip
def test_a_tail_outside_the_payload_or_too_short_to_time_says_nothing(tail_bytes, tail_s, expected):
    assert tail_bandwidth(1_000_000, tail_bytes, tail_s) == pytest.approx(expected)


class WireStream(FakeStream):
    """The server's end behind a link of ``rate`` bytes/s, on a fake clock: payload bytes
    arrive at that rate from the first payload read, reads take only what arrived, each read
    costs 0.1 ms, and once the reader passed ``stall_at`` bytes it stalls ``stall_s`` (its
    CPU quota throttled) while the link goes on delivering into the kernel's buffer."""

    def __init__(self, inbox, outbox, peer: ID, *, rate: float, stall_at: int, stall_s: float):
        super().__init__(inbox, outbox, peer)
        self.rate, self.stall_at, self.stall_s = rate, stall_at, stall_s
        self.preamble = PROBE_HEADER.size + 3 * PING_BYTES  # before the payload: no link
        self.now_ns, self.read_bytes, self.nbytes, self.head = 0, 0, 0, b""
        self.app_tail: tuple[int, int] | None = None  # (bytes left, ns) at the half's read

    def arrived(self) -> int:
        return min(self.nbytes, int(self.rate * self.now_ns / 1e9))

    def kernel(self) -> TcpInfo:
        return replace(BUSY_INFO, bytes_received=self.preamble + self.arrived())

    async def read(self, n: int) -> bytes:
        if self.read_bytes < self.preamble:
            data = await super().read(min(n, self.preamble - self.read_bytes))
            self.read_bytes += len(data)
            self.head += data
            if len(self.head) == PROBE_HEADER.size:
                self.nbytes = PROBE_HEADER.unpack(self.head)[1]
            return data
        got = self.read_bytes - self.preamble
        if got >= self.stall_at and self.stall_s:
            self.now_ns += int(self.stall_s * 1e9)
            self.stall_s = 0.0
        self.now_ns += 100_000
        if self.arrived() <= got:  # nothing buffered: wait for the next 64 KiB or the end
            want = min(got + (64 << 10), self.nbytes)
            self.now_ns = max(self.now_ns, int(want / self.rate * 1e9) + 1)
        data = await super().read(min(n, self.arrived() - got))
        self.read_bytes += len(data)
        half = self.nbytes - self.nbytes // 2
        if self.app_tail is None and 0 < self.nbytes - got - len(data) <= half:
            self.app_tail = (self.nbytes - got - len(data), self.now_ns)
        return data


BUSY_INFO = TcpInfo(
    state=1, rtt_s=0.05, min_rtt_s=0.04, snd_cwnd=40, snd_mss=1448, bytes_acked=0,
    delivery_rate=0.0, app_limited=False, busy_s=0.0, rwnd_limited_s=0.0, sndbuf_limited_s=0.0,
)  # fmt: skip


def _over_a_link(nbytes: int, *, stall_s: float, kernel: bool = True):
    """A probe of ``nbytes`` into a WireStream of 1 MB/s; (result, the server's (tail bytes,
    tail ns), the server end)."""
    count = Counter()

    async def main():
        to_server_send, to_server_recv = trio.open_memory_channel(1 << 16)
        to_client_send, to_client_recv = trio.open_memory_channel(1 << 16)
        client = FakeStream(to_client_recv, to_server_send, new_peer())
        server_end = WireStream(
            to_server_recv, to_client_send, new_peer(), rate=1e6, stall_at=int(0.4 * nbytes),
            stall_s=stall_s,
        )  # fmt: skip
        server = new_server(
            count, max_bytes=4 << 20, clock_ns=lambda: server_end.now_ns,
            kernel=lambda stream: stream.kernel if kernel else None,
        )  # fmt: skip
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve, server_end)
            result = await probe_over(client, "server", nbytes)
        return result, server_end

    result, server_end = trio.run(main)
    return result, TAIL.unpack(server_end.written[-1][-TAIL.size :]), server_end


def test_the_server_times_the_payloads_second_half_as_the_kernel_received_it():
    nbytes = 1 << 20
    result, (tail_bytes, tail_ns), _ = _over_a_link(nbytes, stall_s=0.0)
    # From the read past half to the last: about half the payload, at the link's rate.
    assert nbytes // 2 - (64 << 10) <= tail_bytes <= nbytes // 2
    assert tail_bytes / (tail_ns / 1e9) == pytest.approx(1e6, rel=0.05)
    assert result.tail_bandwidth == pytest.approx(tail_bytes / (tail_ns / 1e9))


def test_a_reader_draining_a_backlog_does_not_time_the_tail_faster_than_the_link():
    """Session 7's over-reads (1.2-1.9x the cap on links stream-probed by throttled hosts):
    the reader stalled before the half, the kernel kept receiving, and the tail's clock
    started at the read past half, so the backlog's bytes counted as if they came after."""
    nbytes = 1 << 20
    _, (tail_bytes, tail_ns), server_end = _over_a_link(nbytes, stall_s=0.6)
    app_bytes, app_from_ns = server_end.app_tail
    app_rate = app_bytes / ((server_end.now_ns - app_from_ns) / 1e9)
    assert app_rate > 5e6  # what the reads alone would say: over 5x the link's 1 MB/s
    assert tail_bytes < nbytes // 8  # little arrived after the clock started
    assert tail_bytes / (tail_ns / 1e9) <= 1e6 * 1.01


def test_without_the_kernels_counts_the_server_sends_no_tail():
    result, tail, _ = _over_a_link(300_000, stall_s=0.0, kernel=False)
    assert tail == (0, 0)
    assert result.tail_bandwidth == 0.0


class SenderKernel:
    """The prober's socket as its kernel reports it: each reading after another 256 KiB
    acknowledged, at ``rates`` in turn; ``app_limited`` marks every sample idle."""

    def __init__(self, rates: list[float], *, app_limited: bool = False) -> None:
        self.rates, self.app_limited, self.readings = rates, app_limited, 0

    def __call__(self) -> TcpInfo:
        rate = self.rates[min(self.readings, len(self.rates) - 1)]
        info = replace(
            BUSY_INFO, bytes_acked=self.readings * (256 << 10), delivery_rate=rate,
            app_limited=self.app_limited,
        )  # fmt: skip
        self.readings += 1
        return info


def _probe_with_sender_kernel(kernel: SenderKernel, nbytes: int = 1 << 20):
    async def main():
        client, server_end = stream_pair(new_peer(), new_peer())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(new_server(Counter(), max_bytes=4 << 20).serve, server_end)
            return await probe_over(client, "server", nbytes, kernel=lambda stream: kernel)

    return trio.run(main)


def test_the_probers_kernel_times_the_payload_from_busy_samples():
    # Slow start, then the link's 2.5 MB/s; one reading per 256 KiB written, then the ack's.
    kernel = SenderKernel([0.4e6, 1.1e6] + [2.5e6] * 30)
    result = _probe_with_sender_kernel(kernel)
    assert kernel.readings >= 1 + 4  # the start, each 256 KiB write, the ack (and the RTT)
    assert result.wire_bandwidth == pytest.approx(2.5e6)
    assert result.bandwidth >= result.wire_bandwidth


def test_a_prober_that_kept_nothing_queued_gets_no_kernel_figure():
    """A CPU-bound prober (a LAN faster than its Python): every sample app-limited."""
    result = _probe_with_sender_kernel(SenderKernel([90e6], app_limited=True))
    assert result.wire_bandwidth == 0.0
    assert result.bandwidth > 0  # the probe's own figure stands
