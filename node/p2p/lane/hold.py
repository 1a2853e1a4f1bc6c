"""Our other lanes held still while a bulk probe runs on one (lane/senders.py).

A probe shares our uplink with our own training frames. On topology C (issue 25) every miss
of the 20% bound, in 16 runs of sessions 13-14, was a link whose sender trained: h1 -> h5
(5 MB/s, 80 ms) read 0.41-0.79 of its cap beside h1's frames to h2 (10 ms), whose short round
trips win the shared queue. Holding our other lanes' locks for the probe makes our frames
wait (a caller's frame then goes to the trio thread, which waits on the lock within the
frame's own timeout) instead of sharing the link, for at most ``max_s``: a probe costs
training that long at most, and never a frame's deadline (5 s and up).
"""

import threading
from collections.abc import Iterable

from fusionllm.node.p2p.lane.stream import LaneWriter

# A lane carrying a frame now is waited for this long at most, then left to it (that probe
# then shares the link, as before).
HOLD_WAIT_S = 0.02
HOLD_MAX_S = 1.0


class LaneHold:
    """The locks of ``lanes`` that were free within ``wait_s`` each, held until ``release``
    or ``max_s``, whichever comes first (any thread; releasing twice is harmless)."""

    def __init__(
        self, lanes: Iterable[LaneWriter], *, wait_s: float = HOLD_WAIT_S, max_s: float = HOLD_MAX_S
    ) -> None:
        self._guard = threading.Lock()
        self._held = [lane for lane in lanes if lane.lock.acquire(timeout=wait_s)]
        self._timer = threading.Timer(max_s, self.release)
        self._timer.daemon = True
        self._timer.start()

    @property
    def held(self) -> int:
        with self._guard:
            return len(self._held)

    def release(self) -> None:
        with self._guard:
            held, self._held = self._held, []
        self._timer.cancel()
        for lane in held:
            lane.lock.release()
