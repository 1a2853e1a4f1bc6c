"""LaneSenders: a caller's thread writes frames to a lane itself and never waits for the network."""

import os
import socket
import time

import pytest
import trio

from fusionllm.node.errors import DeadlineError
from fusionllm.node.p2p.blocking_framing import read_exactly_blocking
from fusionllm.node.p2p.lane.seal import LANE_KEY_BYTES
from fusionllm.node.p2p.lane.senders import LaneSenders
from fusionllm.node.p2p.lane.stream import BlockingLaneReader, LaneWriter
from fusionllm.node.p2p.transport_types import PeerCounters

KEY = bytes(range(LANE_KEY_BYTES))
PEER = "peer"


@pytest.fixture
def lane():
    left, right = socket.socketpair()
    writer = LaneWriter(trio.socket.from_stdlib_socket(left), KEY)
    counters = PeerCounters()
    senders = LaneSenders(counters)
    senders.add(PEER, writer)
    yield senders, writer, BlockingLaneReader(right, KEY), counters
    right.close()
    trio.run(writer.close)


def test_a_frame_the_socket_takes_at_once_is_done_when_try_write_returns(lane):
    senders, _, reader, counters = lane
    future = senders.try_write(PEER, (b"head", b"body"), 5)
    assert future is not None
    assert future.done()
    assert future.result() is None
    assert bytes(read_exactly_blocking(reader, 8, stall_timeout_s=5)) == b"headbody"
    assert counters.snapshot()[PEER].bytes_out == 8


def test_a_frame_larger_than_the_socket_buffer_goes_on_without_the_caller(lane):
    senders, writer, reader, counters = lane
    body = os.urandom(8 << 20)  # far more than a socket pair buffers
    started = time.monotonic()
    future = senders.try_write(PEER, (b"h", body), 10)
    assert time.monotonic() - started < 0.5  # the caller did not wait for the reader
    assert not future.done()
    assert writer.lock.locked()  # the lane is the frame's until it is out ...
    assert senders.try_write(PEER, (b"x", b"y"), 1) is None  # ... so the next frame waits
    got = read_exactly_blocking(reader, 1 + len(body), stall_timeout_s=5)
    assert future.result(timeout=5) is None
    assert bytes(got) == b"h" + body
    assert not writer.lock.locked()
    assert counters.snapshot()[PEER].bytes_out == 1 + len(body)


def test_a_frame_nobody_takes_in_time_fails_typed_and_the_lane_is_dropped(lane):
    senders, writer, _, _ = lane  # nobody reads
    future = senders.try_write(PEER, (b"h", bytes(8 << 20)), 0.3)
    with pytest.raises(DeadlineError):
        future.result(timeout=5)
    assert writer.broken
    assert senders.try_write(PEER, (b"x", b"y"), 1) is None  # no lane: the other path opens one
