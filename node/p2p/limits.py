"""What one peer may cost the data plane: a rate floor for frames, byte budgets, refusals.

- ``RateFloor``: a frame must keep arriving at ``min_bytes_per_s`` measured over windows of
  ``window_s``. A per-read stall deadline alone lets a peer trickle one byte per deadline and
  hold a body's buffer for hours; the floor cuts it at the first window it falls short in.
- ``ByteBudget``: bytes of announced bodies a peer may have in progress, per peer and in
  total, reserved when a frame's length is read and released when the frame is done. Memory
  itself is committed only as bytes arrive (framing.read_exactly); the budget bounds what
  announced-but-unsent bodies may claim.
- ``Refusals``: counts of streams and frames refused before they cost anything, by reason,
  never by peer: a stranger with fresh identities must not grow a table.
- ``InFlight``: frames to a peer not yet written (send backpressure), any thread.
- ``Slots``: a semaphore for the trio thread and plain threads alike (the inbox's slots).

``RateFloor`` is pure and clock-free (callers pass ``now``), one per frame; ``ByteBudget``,
``Refusals`` and ``InFlight`` are locked, for any thread (streams are read in the host's trio
thread, lanes each in a thread of their own).
"""

import contextlib
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import trio

from fusionllm.common.errors import ConfigError
from fusionllm.node.errors import DeadlineError


@dataclass(frozen=True, kw_only=True)
class RateFloorConfig:
    min_bytes_per_s: float
    window_s: float

    def __post_init__(self) -> None:
        if not 0 < self.min_bytes_per_s < float("inf"):
            raise ConfigError(f"min_bytes_per_s must be > 0, got {self.min_bytes_per_s}")
        if not 0 < self.window_s < float("inf"):
            raise ConfigError(f"window_s must be > 0, got {self.window_s}")


class RateFloor:
    """The rate check of one frame's ``total`` bytes, read since ``now``."""

    def __init__(self, config: RateFloorConfig, total: int, now: float) -> None:
        self._config = config
        self._total = total
        self._window_start = now
        self._got_at_start = 0

    def check(self, now: float, got: int) -> None:
        """After a read: DeadlineError if a whole window passed with too few bytes.

        A window asks for ``min_bytes_per_s`` times its length, or the rest of the frame if
        less is left; then the next window starts. Checked after reads only (never by
        cancelling one), so a silent peer is left to the stall deadline.
        """
        elapsed = now - self._window_start
        if elapsed < self._config.window_s:
            return
        need = min(self._config.min_bytes_per_s * elapsed, self._total - self._got_at_start)
        got_here = got - self._got_at_start
        if got_here < need:
            raise DeadlineError(
                f"peer sent {got_here} bytes in {elapsed:.1f}s, below the floor of "
                f"{self._config.min_bytes_per_s:.0f} bytes/s ({got} of {self._total} so far)"
            )
        self._window_start, self._got_at_start = now, got


class ByteBudget:
    """Bytes reserved per peer (at most ``per_peer``) and by all peers (at most ``total``)."""

    def __init__(self, *, per_peer: int, total: int) -> None:
        if not 1 <= per_peer <= total:
            raise ConfigError(f"need 1 <= per_peer <= total, got {per_peer} and {total}")
        self.per_peer = per_peer
        self.total = total
        self._lock = threading.Lock()
        self._by_peer: dict[str, int] = {}
        self._used = 0

    def reserve(self, peer: str, nbytes: int) -> bool:
        """Reserve ``nbytes`` for ``peer``; False (nothing reserved) if either bound would break."""
        with self._lock:
            held = self._by_peer.get(peer, 0)
            if nbytes < 0 or held + nbytes > self.per_peer or self._used + nbytes > self.total:
                return False
            self._by_peer[peer] = held + nbytes
            self._used += nbytes
            return True

    def release(self, peer: str, nbytes: int) -> None:
        with self._lock:
            held = self._by_peer.get(peer, 0)
            if not 0 <= nbytes <= held:
                raise ValueError(f"releasing {nbytes} bytes of {peer}, which holds {held}")
            self._used -= nbytes
            if held == nbytes:
                del self._by_peer[peer]  # nothing kept for a peer that holds nothing
            else:
                self._by_peer[peer] = held - nbytes

    @property
    def used(self) -> int:
        return self._used

    def held_by(self, peer: str) -> int:
        return self._by_peer.get(peer, 0)

    def peers(self) -> int:
        return len(self._by_peer)


class Refusals:
    """How many streams or frames were refused, by reason; any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, reason: str) -> int:
        """Count one more; returns how many of this reason so far."""
        with self._lock:
            self._counts[reason] += 1
            return self._counts[reason]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class InFlight:
    """Frames in flight per peer, at most ``limit`` each; any thread.

    A peer with nothing in flight has no entry, so peers that went away leave nothing behind.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ConfigError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._cond = threading.Condition()
        self._count: dict[str, int] = {}

    def acquire(self, peer: str, timeout: float) -> bool:
        """Take a slot for ``peer``; False if none frees up within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._count.get(peer, 0) >= self.limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            self._count[peer] = self._count.get(peer, 0) + 1
            return True

    def release(self, peer: str) -> None:
        with self._cond:
            left = self._count.get(peer, 0) - 1
            if left < 0:
                raise ValueError(f"no frame in flight to {peer}")
            if left:
                self._count[peer] = left
            else:
                del self._count[peer]
            self._cond.notify_all()

    def peers(self) -> int:
        with self._cond:
            return len(self._count)


class Slots:
    """A semaphore shared by the host's trio thread, lanes' threads and callers' threads:
    ``acquire_async`` in trio, ``acquire`` in a thread, ``release`` from any thread.

    The inbox's slots bound frames waiting for ``recv`` from streams (read in trio) and lanes
    (read in threads) alike; a plain trio.Semaphore would cost a lane's thread a hop into trio
    per frame, and every ``recv`` one back.
    """

    def __init__(self, value: int) -> None:
        if value < 1:
            raise ConfigError(f"value must be >= 1, got {value}")
        self._cond = threading.Condition()
        self._value = value
        self._trio_waiters: list[tuple[Any, Any]] = []  # (trio token, trio.Event)

    @property
    def value(self) -> int:
        with self._cond:
            return self._value

    def try_acquire(self) -> bool:
        with self._cond:
            if self._value > 0:
                self._value -= 1
                return True
            return False

    def acquire(self, timeout: float | None = None) -> bool:
        """Block this (non-trio) thread for a slot; False if none within ``timeout``."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._value > 0, timeout):
                return False
            self._value -= 1
            return True

    async def acquire_async(self) -> None:
        """Wait in trio for a slot (cancellable: a cancelled wait takes none)."""
        while not self.try_acquire():
            event = trio.Event()
            waiter = (trio.lowlevel.current_trio_token(), event)
            with self._cond:
                if self._value > 0:
                    continue
                self._trio_waiters.append(waiter)
            try:
                await event.wait()
            finally:
                with self._cond:
                    if waiter in self._trio_waiters:
                        self._trio_waiters.remove(waiter)

    def release(self) -> None:
        with self._cond:
            self._value += 1
            self._cond.notify()
            waiters, self._trio_waiters = self._trio_waiters, []
        for token, event in waiters:  # each tries again; those that lose wait again
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(event.set)
