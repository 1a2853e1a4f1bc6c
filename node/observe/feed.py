"""What the status page shows: one read of the swarm per interval, however many watch.

A thread reads the swarm (``read``: ``control.status.read_swarm`` on one open DHT client) every
``interval_s`` and keeps the newest description and a loss curve; every browser's request gets
that copy, so viewers cost the DHT nothing. A read that fails keeps the last good one and says
why. The loss curve takes each peer's reported (step, loss) only when both are sane numbers:
records are signed and schema-checked, but a member may still lie, so the curve is bounded.
"""

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fusionllm.common.errors import ConfigError, FusionError
from fusionllm.common.logs import get_logger

logger = get_logger(__name__)

_MAX_STEP = 1 << 40


@dataclass(frozen=True, kw_only=True)
class FeedConfig:
    interval_s: float = 3.0  # between DHT reads (and the page's refreshes)
    max_points: int = 2000  # of the loss curve; the oldest go first

    def __post_init__(self) -> None:
        if not 0.2 <= self.interval_s <= 3600:
            raise ConfigError(f"interval_s must be in [0.2, 3600] s, got {self.interval_s}")
        if not 2 <= self.max_points <= 1_000_000:
            raise ConfigError(f"max_points must be in [2, 1000000], got {self.max_points}")


class LossCurve:
    """step -> loss from what peers report, at most ``max_points``, in step order."""

    def __init__(self, max_points: int) -> None:
        self._max = max_points
        self._points: dict[int, float] = {}

    def add(self, status: dict[str, Any]) -> None:
        for peer in status.get("peers", ()):
            step, loss = peer.get("step"), peer.get("loss")
            if _sane(step, loss):
                self._points[step] = float(loss)
        while len(self._points) > self._max:
            del self._points[min(self._points)]

    def points(self) -> list[list[float]]:
        return [[step, self._points[step]] for step in sorted(self._points)]


def _sane(step: object, loss: object) -> bool:
    return (
        isinstance(step, int)
        and not isinstance(step, bool)
        and 0 <= step < _MAX_STEP
        and isinstance(loss, int | float)
        and math.isfinite(loss)
    )


class StatusFeed:
    def __init__(
        self,
        read: Callable[[], dict[str, Any]],
        config: FeedConfig,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._read = read
        self._clock = clock
        self._lock = threading.Lock()
        self._curve = LossCurve(config.max_points)
        self._status: dict[str, Any] | None = None
        self._read_at: float | None = None
        self._error: str | None = None
        self.reads = 0  # DHT reads so far (tests check viewers do not add any)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> None:
        """One read of the swarm; a failure is kept as the page's error line."""
        self.reads += 1
        try:
            status = self._read()
        except Exception as exc:  # the page says why; the next interval tries again
            if isinstance(exc, FusionError):
                logger.info("could not read the swarm: %s", exc)
            else:
                logger.exception("reading the swarm failed unexpectedly")
            with self._lock:
                self._error = f"{type(exc).__name__}: {exc}"
            return
        with self._lock:
            self._curve.add(status)
            self._status, self._read_at, self._error = status, self._clock(), None

    def latest(self) -> dict[str, Any]:
        """What the page's JSON endpoint serves."""
        with self._lock:
            return {
                "status": self._status,
                "loss_curve": self._curve.points(),
                "read_at": self._read_at,
                "error": self._error,
                "interval_s": self.config.interval_s,
            }

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="status-feed", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30.0)

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.poll()
            self._stop.wait(max(0.0, self.config.interval_s - (time.monotonic() - started)))
