"""How long the daemon's DHT rounds take (heartbeat, propose, adopt): count, sum, last, max.

The daemon times each round where it runs (``NodeDaemon._timed``); the node's metrics read a
snapshot. Locked: the heartbeat and the epochs run in different threads.
"""

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    count: int
    total_s: float
    last_s: float
    max_s: float


class Timings:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, Timing] = {}

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            old = self._by_name.get(name, Timing(0, 0.0, 0.0, 0.0))
            self._by_name[name] = Timing(
                old.count + 1, old.total_s + seconds, seconds, max(old.max_s, seconds)
            )

    def snapshot(self) -> dict[str, Timing]:
        with self._lock:
            return dict(self._by_name)
