"""``framing.read_head`` and ``read_exactly`` for a reader in a thread of its own (a lane's).

The same limits as the event-loop versions: waiting for a frame's first byte is idle time
(``idle_timeout_s``, then a clean end); the rest of the head arrives within one stall deadline;
a body's bytes keep coming within ``stall_timeout_s`` of each other and above the rate floor;
memory grows with the bytes received, never with the announced length alone. Deadlines are
the socket's timeouts (``BlockingReader.set_timeout``), the rate floor runs on the monotonic
clock.
"""

import math
import time
from typing import Protocol

from fusionllm.common.errors import FrameError
from fusionllm.node.errors import DeadlineError
from fusionllm.node.p2p.framing import (
    PREFIX_BYTES,
    ByteSink,
    FrameHeader,
    parse_prefix,
)
from fusionllm.node.p2p.limits import RateFloor, RateFloorConfig

# A read is never asked to wait less than this, so a deadline that is nearly spent still
# gets one real look at the socket instead of a zero timeout (which means "don't block").
_MIN_WAIT_S = 0.001


class BlockingReader(Protocol):
    """A byte stream read from one thread: ``read(n)`` gives 1..n bytes or b"" at the end,
    ``read_into(view)`` likewise into ``view`` (0 at the end); both raise TimeoutError when no
    byte came within the timeout last set (None: wait forever)."""

    def set_timeout(self, timeout: float | None) -> None: ...

    def read(self, n: int) -> bytes: ...

    def read_into(self, into: memoryview) -> int: ...


def read_exactly_blocking(
    reader: BlockingReader,
    n: int,
    *,
    stall_timeout_s: float,
    what: str = "frame",
    into: bytearray | None = None,
    floor: RateFloorConfig | None = None,
    deadline: float | None = None,
) -> bytearray | memoryview:
    """Exactly ``n`` bytes (into ``into`` when it is large enough): FrameError if the stream
    ends first, DeadlineError if it stalls for ``stall_timeout_s``, falls below ``floor``, or
    (given a monotonic ``deadline``) is not done by then."""
    sink = ByteSink(n, into)
    rate = RateFloor(floor, n, time.monotonic()) if floor is not None else None
    while sink.got < n:
        wait = stall_timeout_s
        if deadline is not None:
            wait = min(wait, max(deadline - time.monotonic(), _MIN_WAIT_S))
        reader.set_timeout(wait)
        try:
            if sink.view is not None:
                got = sink.advance(reader.read_into(sink.free()))
            else:
                got = sink.add(reader.read(n - sink.got))
        except TimeoutError as exc:
            raise DeadlineError(
                f"peer stalled for {wait:.3g}s after {sink.got} of {n} {what} bytes"
            ) from exc
        if not got:
            raise FrameError(f"stream ended after {sink.got} of {n} {what} bytes")
        if rate is not None:
            rate.check(time.monotonic(), sink.got)
    return sink.result()


def read_head_blocking(
    reader: BlockingReader,
    *,
    max_body_bytes: int,
    stall_timeout_s: float,
    idle_timeout_s: float = math.inf,
) -> tuple[FrameHeader, int] | None:
    """The next frame's header and body length, or None at a clean end (EOF or idle)."""
    reader.set_timeout(None if math.isinf(idle_timeout_s) else idle_timeout_s)
    try:
        first = reader.read(PREFIX_BYTES)
    except TimeoutError:
        return None  # idle for idle_timeout_s between frames: close, as the stream does
    if not first:
        return None
    if len(first) > PREFIX_BYTES:
        raise FrameError(f"stream returned {len(first)} bytes where {PREFIX_BYTES} were asked")
    # The whole head (at most ~260 bytes) within one stall deadline.
    deadline = time.monotonic() + stall_timeout_s
    rest = b""
    if len(first) < PREFIX_BYTES:
        rest = read_exactly_blocking(
            reader,
            PREFIX_BYTES - len(first),
            stall_timeout_s=stall_timeout_s,
            what="prefix",
            deadline=deadline,
        )
    header_len, body_len = parse_prefix(bytes(first) + rest, max_body_bytes=max_body_bytes)
    head = read_exactly_blocking(
        reader, header_len, stall_timeout_s=stall_timeout_s, what="header", deadline=deadline
    )
    return FrameHeader.from_wire(head), body_len
