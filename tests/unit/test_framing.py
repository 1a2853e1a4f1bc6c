"""Frame prefix, header and the exact-length read loop, against in-memory fake streams."""

import contextlib
import functools
import math
import struct

import msgpack
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from fusionllm.common.errors import FrameError
from fusionllm.node.errors import DeadlineError
from fusionllm.node.p2p.framing import (
    MAX_HEADER_BYTES,
    MAX_MICRO_BATCH,
    MAX_STAGE,
    MAX_STEP,
    PREFIX,
    PREFIX_BYTES,
    FrameHeader,
    FrameKind,
    encode_head,
    parse_prefix,
    read_exactly,
    read_head,
)

headers = st.builds(
    FrameHeader,
    step=st.integers(0, MAX_STEP),
    micro_batch=st.integers(0, MAX_MICRO_BATCH),
    kind=st.sampled_from(list(FrameKind)),
    stage=st.integers(0, MAX_STAGE),
)


class FakeStream:
    """Serves ``data`` in chunks of the given sizes (cycled), then EOF or a stall forever."""

    def __init__(self, data: bytes, chunk_sizes=(1 << 20,), *, stall_at_end: bool = False):
        self.data = data
        self.pos = 0
        self.chunk_sizes = chunk_sizes
        self.reads = 0
        self.stall_at_end = stall_at_end

    async def read(self, n: int) -> bytes:
        if self.pos >= len(self.data):
            if self.stall_at_end:
                await trio.sleep_forever()
            return b""
        size = min(n, self.chunk_sizes[self.reads % len(self.chunk_sizes)])
        self.reads += 1
        chunk = self.data[self.pos : self.pos + size]
        self.pos += len(chunk)
        await trio.lowlevel.checkpoint()
        return chunk


def run(async_fn, *args):
    """Run under a mock clock: deadlines fire instantly, no test sleeps for real."""
    return trio.run(async_fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


async def read_frame(stream, max_body_bytes=1 << 20, stall=1.0, idle=math.inf):
    head = await read_head(
        stream, max_body_bytes=max_body_bytes, stall_timeout_s=stall, idle_timeout_s=idle
    )
    if head is None:
        return None
    header, body_len = head
    return header, bytes(await read_exactly(stream, body_len, stall_timeout_s=stall))


@given(headers)
def test_header_round_trips(header):
    wire = header.to_wire()
    assert len(wire) <= MAX_HEADER_BYTES
    assert FrameHeader.from_wire(wire) == header


@settings(max_examples=50, deadline=None)
@given(
    headers,
    st.binary(min_size=1, max_size=3000),
    st.lists(st.integers(1, 700), min_size=1, max_size=5),
)
def test_frames_round_trip_whatever_the_chunking(header, body, chunks):
    frames = [encode_head(header, len(body)) + body, encode_head(header, 1) + b"x"]
    stream = FakeStream(b"".join(frames), tuple(chunks))

    async def main():
        first = await read_frame(stream)
        second = await read_frame(stream)
        end = await read_frame(stream)
        return first, second, end

    assert run(main) == ((header, body), (header, b"x"), None)


def test_header_accepts_the_kind_as_a_string():
    assert FrameHeader(step=1, micro_batch=0, kind="gradient", stage=2).kind is FrameKind.GRADIENT


@pytest.mark.parametrize(
    "fields",
    [
        {"step": -1},
        {"step": MAX_STEP + 1},
        {"step": True},
        {"step": 1.0},
        {"micro_batch": MAX_MICRO_BATCH + 1},
        {"stage": MAX_STAGE + 1},
        {"stage": "0"},
        {"kind": "weights"},
        {"kind": None},
    ],
)
def test_bad_header_values_are_refused_locally_and_on_the_wire(fields):
    good = {"step": 1, "micro_batch": 2, "kind": "activation", "stage": 3}
    with pytest.raises(ValueError, match=next(iter(fields))):
        FrameHeader(**(good | fields))
    with pytest.raises(FrameError, match=next(iter(fields))):
        FrameHeader.from_wire(msgpack.packb(good | fields))


@pytest.mark.parametrize(
    "payload",
    [
        {"step": 1, "micro_batch": 2, "kind": "activation"},
        {"step": 1, "micro_batch": 2, "kind": "activation", "stage": 3, "extra": 0},
        [1, 2, "activation", 3],
        "activation",
    ],
)
def test_header_maps_must_have_exactly_the_known_keys(payload):
    with pytest.raises(FrameError, match=r"map|max_map_len|max_array_len"):
        FrameHeader.from_wire(msgpack.packb(payload))


@given(st.binary(max_size=300))
def test_garbage_headers_give_frame_errors_only(data):
    with contextlib.suppress(FrameError):
        FrameHeader.from_wire(data)


@pytest.mark.parametrize(
    ("prefix", "match"),
    [
        (PREFIX.pack(2, 10, 10), "version"),
        (PREFIX.pack(1, 0, 10), "header length"),
        (PREFIX.pack(1, MAX_HEADER_BYTES + 1, 10), "header length"),
        (PREFIX.pack(1, 10, 0), "body length"),
        (PREFIX.pack(1, 10, 4097), "body length"),
        (b"\x01\x00", "prefix must be"),
    ],
)
def test_bad_prefixes_are_refused(prefix, match):
    with pytest.raises(FrameError, match=match):
        parse_prefix(prefix, max_body_bytes=4096)


def test_an_oversize_length_is_refused_before_the_body_is_read():
    header = FrameHeader(step=0, micro_batch=0, kind="control", stage=0)
    head = encode_head(header, 1 << 30)
    stream = FakeStream(head + b"\0" * 100)
    with pytest.raises(FrameError, match="body length"):
        run(read_frame, stream, 4096)
    assert stream.pos == PREFIX_BYTES  # not even the header was read


@pytest.mark.parametrize("cut", [1, PREFIX_BYTES - 1, PREFIX_BYTES + 3, -1])
def test_a_truncated_frame_is_a_frame_error(cut):
    header = FrameHeader(step=5, micro_batch=1, kind="activation", stage=0)
    frame = encode_head(header, 64) + bytes(64)
    with pytest.raises(FrameError, match="stream ended"):
        run(read_frame, FakeStream(frame[:cut], (3,)))


def test_a_stall_inside_a_frame_is_a_deadline_error():
    header = FrameHeader(step=5, micro_batch=1, kind="activation", stage=0)
    frame = encode_head(header, 64) + bytes(10)
    with pytest.raises(DeadlineError, match="stalled"):
        run(read_frame, FakeStream(frame, stall_at_end=True))


def test_an_idle_stream_ends_quietly_at_the_idle_deadline():
    stream = FakeStream(b"", stall_at_end=True)
    assert run(read_frame, stream, 4096, 1.0, 5.0) is None


def test_a_stream_returning_more_than_asked_is_refused():
    class Greedy:
        async def read(self, n):
            return bytes(n + 1)

    with pytest.raises(FrameError, match="were asked"):
        run(functools.partial(read_exactly, stall_timeout_s=1.0), Greedy(), 10)


def test_encode_refuses_an_empty_body():
    header = FrameHeader(step=0, micro_batch=0, kind="control", stage=0)
    with pytest.raises(ValueError, match="body length"):
        encode_head(header, 0)


def test_prefix_layout_is_stable():
    header = FrameHeader(step=0, micro_batch=0, kind="control", stage=0)
    head = encode_head(header, 300)
    version, header_len, body_len = struct.unpack(">BHI", head[:PREFIX_BYTES])
    assert (version, header_len, body_len) == (1, len(head) - PREFIX_BYTES, 300)


def test_batched_reads_pause_only_while_much_of_the_body_is_left():
    body = bytes(range(256)) * (16 << 10)  # 4 MiB
    stream = FakeStream(body, chunk_sizes=(64 << 10,))

    async def main():
        started = trio.current_time()
        data = await read_exactly(stream, len(body), stall_timeout_s=1.0, batch_s=0.002)
        return bytes(data), trio.current_time() - started

    data, elapsed = run(main)
    assert data == body
    # A pause after each 64 KiB read that left at least 1 MiB to come, none in the tail.
    pauses = sum(
        1 for end in range(64 << 10, len(body) + 1, 64 << 10) if len(body) - end >= 1 << 20
    )
    assert elapsed == pytest.approx(pauses * 0.002)
    assert stream.reads == len(body) // (64 << 10)


def test_big_reads_and_unbatched_reads_never_pause():
    body = bytes(3 << 20)

    async def elapsed(chunk: int, batch_s: float) -> float:
        started = trio.current_time()
        await read_exactly(
            FakeStream(body, (chunk,)), len(body), stall_timeout_s=1.0, batch_s=batch_s
        )
        return trio.current_time() - started

    assert run(elapsed, 1 << 20, 0.002) == 0
    assert run(elapsed, 64 << 10, 0.0) == 0
