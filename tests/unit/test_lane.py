"""Lanes' pure parts: sealed chunks, offers, tickets, and both ends over a local socket pair."""

import itertools
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import trio

from fusionllm.common.errors import FrameError
from fusionllm.node.errors import DeadlineError, TransportError
from fusionllm.node.p2p.blocking_framing import read_exactly_blocking
from fusionllm.node.p2p.lane.offer import LANE_VERSION, OFFER_BYTES, TOKEN_BYTES, Offer, Tickets
from fusionllm.node.p2p.lane.seal import (
    LANE_KEY_BYTES,
    LENGTH,
    LENGTH_BYTES,
    MAX_CHUNK_BYTES,
    Opener,
    Sealer,
    chunk_length,
)
from fusionllm.node.p2p.lane.service import REFUSED_RETRY_S, RetryAfter
from fusionllm.node.p2p.lane.stream import BlockingLaneReader, LaneWriter

KEY = bytes(range(LANE_KEY_BYTES))


def sealed_chunks(key: bytes, *payloads: bytes) -> list[bytes]:
    sealer = Sealer(key)
    return [bytes(sealer.seal(payload)) for payload in payloads]


def open_chunk(opener: Opener, chunk: bytes) -> bytes:
    into = bytearray(MAX_CHUNK_BYTES)
    length = opener.open(chunk[:LENGTH_BYTES], chunk[LENGTH_BYTES:], memoryview(into))
    return bytes(into[:length])


# ----- seal.py --------------------------------------------------------------------------------


def test_chunks_open_in_order_with_the_same_key():
    payloads = [b"a", os.urandom(1000), os.urandom(MAX_CHUNK_BYTES)]
    opener = Opener(KEY)
    assert [open_chunk(opener, c) for c in sealed_chunks(KEY, *payloads)] == payloads


def test_a_chunk_that_was_changed_anywhere_fails_to_open():
    (chunk,) = sealed_chunks(KEY, b"x" * 100)
    for position in (LENGTH_BYTES, LENGTH_BYTES + 50, len(chunk) - 1):  # body, middle, tag
        changed = bytearray(chunk)
        changed[position] ^= 1
        with pytest.raises(FrameError, match="authentication"):
            open_chunk(Opener(KEY), bytes(changed))


def test_a_changed_length_fails_even_when_the_sealed_bytes_match_it():
    # The length is the associated data: a peer in the middle cannot cut a chunk short.
    (chunk,) = sealed_chunks(KEY, b"y" * 100)
    shorter = LENGTH.pack(99) + chunk[LENGTH_BYTES:-1]
    with pytest.raises(FrameError, match="authentication"):
        open_chunk(Opener(KEY), shorter)


def test_replayed_reordered_or_dropped_chunks_fail_to_open():
    first, second, third = sealed_chunks(KEY, b"1", b"2", b"3")
    replayed = Opener(KEY)
    open_chunk(replayed, first)
    with pytest.raises(FrameError):
        open_chunk(replayed, first)
    with pytest.raises(FrameError):
        open_chunk(Opener(KEY), second)  # the first was dropped, or the two swapped
    skipped = Opener(KEY)
    open_chunk(skipped, first)
    with pytest.raises(FrameError):
        open_chunk(skipped, third)


def test_another_key_opens_nothing():
    (chunk,) = sealed_chunks(KEY, b"secret")
    with pytest.raises(FrameError):
        open_chunk(Opener(bytes(LANE_KEY_BYTES)), chunk)


def test_chunk_lengths_are_bounded_before_anything_is_read():
    for length in (0, MAX_CHUNK_BYTES + 1, 2**32 - 1):
        with pytest.raises(FrameError):
            chunk_length(LENGTH.pack(length))
    assert chunk_length(LENGTH.pack(MAX_CHUNK_BYTES)) == MAX_CHUNK_BYTES


def test_sealing_refuses_empty_or_oversize_pieces_and_short_keys():
    with pytest.raises(ValueError, match="a chunk carries"):
        Sealer(KEY).seal(b"")
    with pytest.raises(ValueError, match="a chunk carries"):
        Sealer(KEY).seal(bytes(MAX_CHUNK_BYTES + 1))
    with pytest.raises(ValueError, match="lane key"):
        Sealer(KEY[:16])


# ----- offer.py -------------------------------------------------------------------------------


def test_an_offer_round_trips_and_bad_offers_are_frame_errors():
    offer = Offer(port=4242, token=os.urandom(TOKEN_BYTES), key=os.urandom(LANE_KEY_BYTES))
    wire = offer.to_wire()
    assert len(wire) == OFFER_BYTES
    assert Offer.from_wire(wire) == offer
    bad = [
        wire[:-1],
        wire + b"\0",
        bytes([LANE_VERSION + 1]) + wire[1:],
        wire[:1] + b"\0\0" + wire[3:],  # port 0
    ]
    for data in bad:
        with pytest.raises(FrameError):
            Offer.from_wire(data)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_ticket_is_redeemed_once_by_its_peer_with_its_key():
    tickets = Tickets(per_peer=2, total=8, ttl_s=3.0, clock=FakeClock())
    token, key = tickets.issue("peer-a")
    assert len(token) == TOKEN_BYTES
    assert len(key) == LANE_KEY_BYTES
    assert tickets.redeem(token) == ("peer-a", key)
    assert tickets.redeem(token) is None
    assert tickets.redeem(os.urandom(TOKEN_BYTES)) is None
    assert len(tickets) == 0


def test_tickets_expire():
    clock = FakeClock()
    tickets = Tickets(per_peer=2, total=8, ttl_s=3.0, clock=clock)
    token, _ = tickets.issue("peer-a")
    clock.now += 3.5
    assert tickets.redeem(token) is None


def test_tickets_are_bounded_per_peer_and_in_total_until_they_expire():
    clock = FakeClock()
    tickets = Tickets(per_peer=2, total=3, ttl_s=3.0, clock=clock)
    assert tickets.issue("a") is not None
    assert tickets.issue("a") is not None
    assert tickets.issue("a") is None  # a's share is used up
    assert tickets.issue("b") is not None
    assert tickets.issue("c") is None  # all shares are used up
    clock.now += 4
    assert tickets.issue("c") is not None  # the expired ones were dropped
    assert len(tickets) == 1


# ----- stream.py: both ends over a socket pair -------------------------------------------------


def lane_pair(key: bytes = KEY) -> tuple[LaneWriter, BlockingLaneReader, socket.socket]:
    """(the writer over one end, the reader over the other, the writer's raw socket)."""
    left, right = socket.socketpair()
    writer = LaneWriter(trio.socket.from_stdlib_socket(left), key)
    return writer, BlockingLaneReader(right, key), left


@pytest.mark.parametrize("warm_buffer", [False, True])
def test_frames_cross_a_lane_whole_at_any_size(warm_buffer):
    sizes = [1, 100, MAX_CHUNK_BYTES - 1, MAX_CHUNK_BYTES, MAX_CHUNK_BYTES + 1, 3 * MAX_CHUNK_BYTES]
    frames = [os.urandom(size) for size in sizes]
    writer, reader, _ = lane_pair()
    # A thread writes while this one reads: the socket pair's buffer holds less than a frame.
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(
            lambda: [writer.write_frame((frame[:7], frame[7:]), 5) for frame in frames]
        )
        got = []
        for frame in frames:
            scratch = bytearray(len(frame)) if warm_buffer else None
            body = read_exactly_blocking(reader, len(frame), stall_timeout_s=5, into=scratch)
            got.append(bytes(body))
        sent.result(timeout=5)
    assert got == frames
    trio.run(writer.close)
    reader.set_timeout(5)
    assert reader.read(1) == b""  # a clean end between chunks


class PiecewiseSocket:
    """A socket whose reads return the given byte stream in pieces of the given sizes (in turn),
    whatever a read asks for beyond them: chunks then straddle reads and the reader's buffer."""

    def __init__(self, data: bytes, pieces: list[int]) -> None:
        self._data = memoryview(data)
        self._pieces = itertools.cycle(pieces)
        self.reads = 0

    def settimeout(self, timeout: float | None) -> None:
        pass

    def recv_into(self, into: memoryview, nbytes: int = 0, flags: int = 0) -> int:
        count = min(len(into), next(self._pieces), len(self._data))
        into[:count] = self._data[:count]
        self._data = self._data[count:]
        self.reads += 1
        return count


def _read_to_end(sock: socket.socket) -> bytes:
    data = bytearray()
    while chunk := sock.recv(1 << 20):
        data += chunk
    return bytes(data)


@pytest.mark.parametrize("pieces", [[1], [LENGTH_BYTES + 3, 70_000], [300_000], [262_000, 9]])
def test_frames_read_whole_however_the_socket_cuts_the_stream(pieces):
    frames = [os.urandom(size) for size in (5, MAX_CHUNK_BYTES + 17, 4 * MAX_CHUNK_BYTES, 1, 900)]
    left, right = socket.socketpair()
    writer = LaneWriter(trio.socket.from_stdlib_socket(left), KEY)
    with ThreadPoolExecutor(1) as pool:  # the writer's real output, read off the other end
        wire = pool.submit(_read_to_end, right)
        for frame in frames:
            writer.write_frame((frame[:3], frame[3:]), 5)
        left.shutdown(socket.SHUT_WR)
        stream = wire.result(timeout=5)
    reader = BlockingLaneReader(PiecewiseSocket(stream, pieces), KEY)  # type: ignore[arg-type]
    reader.set_timeout(5)
    got = [bytes(read_exactly_blocking(reader, len(f), stall_timeout_s=5)) for f in frames]
    assert got == frames
    assert reader.read(1) == b""  # the stream ended between chunks: a clean end


def test_a_lane_that_ends_inside_a_chunk_is_a_frame_error():
    _, reader, sock = lane_pair()
    (chunk,) = sealed_chunks(KEY, b"z" * 1000)
    sock.sendall(chunk[:500])
    sock.shutdown(socket.SHUT_WR)
    reader.set_timeout(5)
    with pytest.raises(FrameError, match="ended after"):
        reader.read(1000)


def test_a_lane_from_someone_without_the_key_is_a_frame_error():
    left, right = socket.socketpair()
    writer = LaneWriter(trio.socket.from_stdlib_socket(left), os.urandom(LANE_KEY_BYTES))
    reader = BlockingLaneReader(right, KEY)
    writer.write_frame((b"hello",), 5)
    reader.set_timeout(5)
    with pytest.raises(FrameError, match="authentication"):
        reader.read(5)


def test_a_read_timed_out_inside_a_chunk_leaves_the_lane_unusable():
    _, reader, sock = lane_pair()
    (chunk,) = sealed_chunks(KEY, b"w" * 1000)
    sock.sendall(chunk[: LENGTH_BYTES + 10])
    reader.set_timeout(0.2)
    with pytest.raises(TimeoutError):
        reader.read(1000)
    with pytest.raises(TransportError, match="interrupted"):
        reader.read(1000)


def test_a_chunk_trickled_a_byte_at_a_time_is_cut_off_at_one_deadline():
    _, reader, sock = lane_pair()
    (chunk,) = sealed_chunks(KEY, b"t" * 1000)
    stop = threading.Event()

    def trickle() -> None:
        for byte in chunk:
            if stop.wait(0.02):
                return
            sock.sendall(bytes([byte]))

    thread = threading.Thread(target=trickle)
    thread.start()
    reader.set_timeout(0.3)  # each byte comes well within it; the chunk does not
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            reader.read(1000)
        assert time.monotonic() - started < 1.0
    finally:
        stop.set()
        thread.join()


def test_a_write_that_times_out_breaks_the_lane_and_later_writes_fail_typed():
    writer, _reader, _ = lane_pair()  # nobody reads (kept open): the buffer fills
    with pytest.raises(DeadlineError):
        writer.write_frame((bytes(8 << 20),), 0.3)
    assert writer.broken
    with pytest.raises(TransportError, match="broken"):
        writer.write_frame((b"x",), 1)


def test_a_busy_lane_makes_a_second_writer_wait_its_turn_not_interleave():
    writer, reader, _ = lane_pair()
    assert writer.lock.acquire(blocking=False)
    with pytest.raises(DeadlineError, match="busy"):
        writer.write_frame((b"x",), 0.1)
    writer.lock.release()
    writer.write_frame((b"y" * 10,), 5)
    assert bytes(read_exactly_blocking(reader, 10, stall_timeout_s=5)) == b"y" * 10


# ----- service.py: when to try a lane again ----------------------------------------------------


def test_lane_retries_back_off_while_a_peer_keeps_failing_and_reset_on_success():
    retry = RetryAfter(60.0)
    assert retry.allowed("p", 0.0)
    assert retry.failed("p", 0.0) == 60.0
    assert not retry.allowed("p", 59.0)
    assert retry.allowed("p", 60.0)
    assert retry.failed("p", 60.0) == 120.0
    assert retry.failed("p", 180.0) == 240.0
    for _ in range(20):
        delay = retry.failed("p", 1000.0)
    assert delay == 3600.0  # capped: a peer whose NAT opens later is tried again within the hour
    assert retry.allowed("q", 1000.0)  # per peer
    retry.forget("p")
    assert retry.allowed("p", 1000.0)
    assert retry.failed("p", 1000.0) == 60.0


def test_a_refused_offer_is_asked_again_soon_and_backs_off_from_there():
    retry = RetryAfter(60.0)
    assert retry.failed("p", 0.0, refused=True) == REFUSED_RETRY_S
    assert retry.allowed("p", REFUSED_RETRY_S)
    assert retry.failed("p", 2.0, refused=True) == 2 * REFUSED_RETRY_S
    assert retry.failed("p", 6.0) == 240.0  # an unreachable port after two refusals: 3rd failure
    assert RetryAfter(1.0).failed("q", 0.0, refused=True) == 1.0  # never above retry_s


# ----- where a lane is dialled (dial.lane_ips) ----------------------------------------------


def test_a_connection_we_dialled_takes_its_lane_where_we_reached_the_peer():
    from fusionllm.node.p2p.lane.dial import lane_ips

    assert lane_ips("203.0.113.5", dialled=True, listen_ips=["198.51.100.1"]) == ["203.0.113.5"]


def test_a_connection_the_peer_dialled_tries_its_listen_ips_first_then_the_source():
    from fusionllm.node.p2p.lane.dial import MAX_LISTEN_IPS, lane_ips

    # The peer dialled from 127.0.0.1 but listens on 127.0.0.2 (a second interface, a gateway).
    assert lane_ips("127.0.0.1", dialled=False, listen_ips=["127.0.0.2"]) == [
        "127.0.0.2",
        "127.0.0.1",
    ]
    assert lane_ips("127.0.0.1", dialled=False, listen_ips=[]) == ["127.0.0.1"]
    # Only IPs of the connection's family, no 0.0.0.0, no junk, no repeats, the source last.
    named = ["::1", "0.0.0.0", "not-an-ip", "10.0.0.7", "10.0.0.7", "127.0.0.1"]
    assert lane_ips("127.0.0.1", dialled=False, listen_ips=named) == ["10.0.0.7", "127.0.0.1"]
    # A peer naming many addresses gets a few tried, not all.
    many = [f"10.0.0.{i}" for i in range(1, 50)]
    tried = lane_ips("192.0.2.1", dialled=False, listen_ips=many)
    assert tried == [*many[:MAX_LISTEN_IPS], "192.0.2.1"]
