"""blocking_framing: the frame head and body read by a lane's thread, within the same limits."""

import math
import socket
import threading
import time

import pytest

from fusionllm.common.errors import FrameError
from fusionllm.node.errors import DeadlineError
from fusionllm.node.p2p.blocking_framing import read_exactly_blocking, read_head_blocking
from fusionllm.node.p2p.framing import FrameHeader, encode_head
from fusionllm.node.p2p.limits import RateFloorConfig

HEADER = FrameHeader(step=3, micro_batch=1, kind="activation", stage=0)


class SocketReader:
    """The BlockingReader surface over a plain socket (a lane's reader adds only the seal)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def set_timeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def read(self, n: int) -> bytes:
        return self.sock.recv(n)

    def read_into(self, into: memoryview) -> int:
        return self.sock.recv_into(into)


def pair() -> tuple[socket.socket, SocketReader]:
    left, right = socket.socketpair()
    return left, SocketReader(right)


def test_a_head_and_body_arrive_whole():
    sender, reader = pair()
    sender.sendall(encode_head(HEADER, 5) + b"hello")
    header, body_len = read_head_blocking(reader, max_body_bytes=10, stall_timeout_s=1)
    assert (header, body_len) == (HEADER, 5)
    assert bytes(read_exactly_blocking(reader, 5, stall_timeout_s=1)) == b"hello"


def test_a_body_longer_than_allowed_is_refused_before_it_is_read():
    sender, reader = pair()
    sender.sendall(encode_head(HEADER, 11))
    with pytest.raises(FrameError, match="body length"):
        read_head_blocking(reader, max_body_bytes=10, stall_timeout_s=1)


def test_idle_between_frames_is_a_clean_end_and_so_is_eof():
    sender, reader = pair()
    assert (
        read_head_blocking(reader, max_body_bytes=10, stall_timeout_s=1, idle_timeout_s=0.1) is None
    )
    sender.close()
    assert read_head_blocking(reader, max_body_bytes=10, stall_timeout_s=1) is None


def test_a_head_trickled_past_its_one_deadline_is_cut_off():
    sender, reader = pair()
    head = encode_head(HEADER, 5)

    def trickle() -> None:
        for byte in head:
            sender.sendall(bytes([byte]))
            time.sleep(0.05)

    thread = threading.Thread(target=trickle)
    thread.start()
    started = time.monotonic()
    with pytest.raises(DeadlineError):
        read_head_blocking(reader, max_body_bytes=10, stall_timeout_s=0.3, idle_timeout_s=math.inf)
    assert time.monotonic() - started < 1.0  # one deadline for the head, not one per byte
    thread.join()


def test_a_body_that_stalls_or_ends_early_is_refused():
    sender, reader = pair()
    sender.sendall(b"abc")
    with pytest.raises(DeadlineError, match="3 of 10"):
        read_exactly_blocking(reader, 10, stall_timeout_s=0.1)
    sender.close()
    with pytest.raises(FrameError, match="ended"):
        read_exactly_blocking(reader, 10, stall_timeout_s=0.5)


def test_a_body_below_the_rate_floor_is_cut_off_though_bytes_keep_coming():
    sender, reader = pair()
    stop = threading.Event()

    def drip() -> None:
        while not stop.is_set():
            sender.sendall(b"x")
            time.sleep(0.02)

    thread = threading.Thread(target=drip)
    thread.start()
    try:
        with pytest.raises(DeadlineError, match="below the floor"):
            read_exactly_blocking(
                reader,
                1 << 20,
                stall_timeout_s=1,
                floor=RateFloorConfig(min_bytes_per_s=10_000, window_s=0.2),
            )
    finally:
        stop.set()
        thread.join()


def test_a_warm_buffer_is_filled_in_place():
    sender, reader = pair()
    sender.sendall(b"0123456789")
    scratch = bytearray(16)
    body = read_exactly_blocking(reader, 10, stall_timeout_s=1, into=scratch)
    assert bytes(body) == b"0123456789"
    assert bytes(scratch[:10]) == b"0123456789"
