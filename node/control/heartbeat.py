"""Our record on the DHT, kept alive: written every ``period_s`` on its own thread, and at once
when something in it changed (``wake``: a suspicion, a pace, a reachability verdict).

Its own thread because a slow epoch (DHT gets waiting on a dead peer) must not let our record
expire, or every other node would drop us and re-plan. A quiet node's record promises fewer
refreshes (quiet.py: its ``beat``); it writes that seldom, unless asked.
"""

import threading
import time
from collections.abc import Callable

from fusionllm.common.logs import get_logger
from fusionllm.dht.client import DhtError
from fusionllm.dht.records import NodeInfo, RecordError
from fusionllm.node.control.beat_clock import next_wake

logger = get_logger(__name__)


class Heartbeat:
    def __init__(
        self,
        *,
        period_s: float,
        ttl_s: float,
        stop: threading.Event,
        record: Callable[[int], NodeInfo],
        announce: Callable[[NodeInfo, float], bool],
        cadence: Callable[[], int],
        timed: Callable[..., None] = lambda what, step, *args: step(*args),
    ) -> None:
        self.period_s, self.ttl_s = period_s, ttl_s
        self._stop = stop
        self._record = record  # our record for a beat (NodeDaemon._info)
        self._announce = announce  # (record, ttl_s) -> whether the DHT stored it
        self._cadence = cadence  # the beat our quiet cadence wants now (quiet.py)
        self._timed = timed
        self._beat, self._written = 1, 0.0  # our last record's beat, and when it was written
        self._now = threading.Event()  # write before the next period

    def wake(self) -> None:
        """Write our record now, not at the next period (also ends the loop's wait on stop)."""
        self._now.set()

    def loop(self) -> None:
        woke = time.monotonic()
        while not self._stop.is_set():
            wake_at = next_wake(woke, time.monotonic(), self.period_s)
            asked = self._now.wait(max(0.0, wake_at - time.monotonic()))
            self._now.clear()
            woke = time.monotonic()  # the period counts from here, the store's time inside it
            if self._stop.is_set():
                return
            # A quiet node's record promised fewer refreshes (quiet.py); one that woke
            # refreshes at once, so that its record shows what it follows now.
            due = self._written + self.period_s * (self._beat - 0.5)
            quiet = self._cadence() >= self._beat
            if not asked and time.monotonic() < due and quiet:
                continue
            self._beat_safely()

    def _beat_safely(self) -> None:
        try:
            self._timed("heartbeat", self.beat)
        except (DhtError, RecordError) as exc:
            logger.warning("heartbeat failed (will retry): %s", exc)
        except Exception:  # a record that stops refreshing takes us out of every plan
            logger.exception("heartbeat failed unexpectedly (will retry)")

    def beat(self) -> None:
        """Write our record now, on this thread; raises what the DHT raises."""
        beat = self._cadence()
        self._beat, self._written = beat, time.monotonic()
        if not self._announce(self._record(beat), self.ttl_s * beat):
            # hivemind reports the last replica's answer: one peer holding a newer (forged)
            # entry under our subkey says no even when the honest replicas stored ours.
            logger.info("a DHT replica did not store our record (or none is reachable)")
