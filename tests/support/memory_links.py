"""Slow links for ``MemoryNetwork``: per-link delay and rate, delivered by a timer thread.

``LinkShape(delay_s, rate)`` on the link from one peer to another: a frame leaves the sender
once the link has sent the frames before it and its own bytes at ``rate`` (bytes/s; the
sender's future resolves then, as a real write returns once the socket took the bytes) and
reaches the receiver ``delay_s`` later. The departure times come from the testbed's ``Fifo``
(fusionllm.testbed.shaping), with no queue limit: the in-memory network loses nothing on its
own. A frame that could not leave within its send timeout fails with DeadlineError and takes
no link time. Frames of one link arrive in the order sent; unshaped links stay synchronous.
"""

import contextlib
import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from fusionllm.node.errors import DeadlineError, TransportClosedError
from fusionllm.testbed.shaping import Fifo

_NO_LIMIT = 1 << 62


@dataclass(frozen=True, kw_only=True)
class LinkShape:
    delay_s: float = 0.0  # one way
    rate: float | None = None  # bytes/s; None: no cap

    def __post_init__(self) -> None:
        if not (0 <= self.delay_s < math.inf):
            raise ValueError(f"delay_s must be finite and >= 0, got {self.delay_s}")
        if self.rate is not None and not (0 < self.rate < math.inf):
            raise ValueError(f"rate must be finite and > 0, got {self.rate}")


class DelayLine:
    """Runs callbacks at their times, in time order (ties in call order), on one thread."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def at(self, when: float, action: Callable[[], None]) -> None:
        """Run ``action`` at ``time.monotonic() == when`` (or as soon after as the thread can)."""
        with self._wake:
            if self._closed:
                return
            heapq.heappush(self._heap, (when, next(self._seq), action))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="links", daemon=True)
                self._thread.start()
            self._wake.notify()

    def close(self) -> list[Callable[[], None]]:
        """Stop; returns the actions that never ran."""
        with self._wake:
            self._closed = True
            left = [action for _when, _seq, action in sorted(self._heap)]
            self._heap.clear()
            self._wake.notify()
        return left

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    left = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._wake.wait(left)
                if self._closed:
                    return
                _when, _seq, action = heapq.heappop(self._heap)
            action()


class ShapedLinks:
    """The shapes of a network's links and the departure clock of each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shapes: dict[tuple[str, str], LinkShape] = {}
        self._fifos: dict[tuple[str, str], Fifo] = {}

    def shape(self, src: str, dst: str, shape: LinkShape) -> None:
        with self._lock:
            self._shapes[(src, dst)] = shape
            self._fifos[(src, dst)] = Fifo(rate=shape.rate, limit_bytes=_NO_LIMIT)

    def plan(self, src: str, dst: str, size: int, timeout: float) -> tuple[float, float] | None:
        """(leaves, arrives) in ``time.monotonic()`` for a frame of ``size`` bytes sent now;
        None when the link is not shaped. (inf, inf) when it could not leave in ``timeout``."""
        with self._lock:
            shape = self._shapes.get((src, dst))
            if shape is None:
                return None
            fifo = self._fifos[(src, dst)]
            now = time.monotonic()
            wait = (fifo.backlog(now) + size) / shape.rate if shape.rate else 0.0
            if wait > timeout:
                return math.inf, math.inf
            leaves = fifo.offer(now, size)
            assert leaves is not None  # no queue limit
        return leaves, leaves + shape.delay_s


class SlowLinks:
    """What ``MemoryNetwork`` asks of its links: shape them, send over them, stop."""

    def __init__(self) -> None:
        self._links = ShapedLinks()
        self._line = DelayLine()
        self._lock = threading.Lock()
        self._in_flight: set[Future] = set()  # sent on a shaped link, not delivered yet

    def shape(self, src: str, dst: str, shape: LinkShape, *, both_ways: bool) -> None:
        self._links.shape(src, dst, shape)
        if both_ways:
            self._links.shape(dst, src, shape)

    def send(
        self, src: str, dst: str, size: int, future: Future, timeout: float,
        deliver: Callable[[], None],
    ) -> bool:  # fmt: skip
        """Resolve ``future`` as the frame leaves and ``deliver`` it as it arrives (or fail
        it with DeadlineError); False, doing nothing, when the link is not shaped."""
        plan = self._links.plan(src, dst, size, timeout)
        if plan is None:
            return False
        leaves, arrives = plan
        if leaves == math.inf:
            _fail(future, DeadlineError(f"a frame to {dst} could not leave in {timeout}s"))
            return True
        with self._lock:
            self._in_flight.add(future)

        def arrive() -> None:
            with self._lock:
                self._in_flight.discard(future)
            deliver()

        self._line.at(leaves, lambda: _resolve(future))
        self._line.at(arrives, arrive)
        return True

    def close(self) -> None:
        """Stop delivering; frames still on their way fail with TransportClosedError."""
        self._line.close()
        with self._lock:
            in_flight, self._in_flight = self._in_flight, set()
        for future in in_flight:
            _fail(future, TransportClosedError("network closed during send"))


def _resolve(future: Future) -> None:
    with contextlib.suppress(Exception):  # failed or resolved meanwhile
        future.set_result(None)


def _fail(future: Future, error: BaseException) -> None:
    with contextlib.suppress(Exception):
        future.set_exception(error)
