"""How long a step waits for one frame before it gives up on the peer that owes it.

A fixed 60 s wait let a member that stopped sending mid-run (its process and heartbeat still
up) hold the swarm for a minute before anyone noticed. A step in a steady plan has a measured
rhythm, though: the wall time from one step's start to the next (which includes our own
checkpoint writes and every wait on the other stages) bounds how long any frame of a healthy
step takes. ``Patience`` waits a few of the slowest recent intervals, never less than a floor
(a collection pause, a loaded volunteer machine), never less than what the frame needs over a
slow WAN link (100 ms RTT and 8 Mbit/s, or the measured bandwidth where that is slower), and
never more than the configured step timeout. Until a plan has run a few steps, there is no
rhythm yet: the step timeout applies.

Pure: fed intervals and byte counts, no clock (tests/unit/test_patience.py).
"""

from collections import deque
from dataclasses import dataclass

from fusionllm.common.errors import ConfigError

SLOW_LINK_BYTES_PER_S = 1e6  # 8 Mbit/s: the slowest link the papers train over
SLOW_LINK_RTT_S = 0.1


@dataclass(frozen=True, kw_only=True)
class PatienceConfig:
    cap_s: float = 60.0  # the configured step timeout: the longest wait, and the first steps'
    floor_s: float = 15.0  # the shortest wait, whatever the rhythm
    factor: float = 4.0  # times the slowest recent step interval
    window: int = 32  # recent step intervals kept (covers a checkpoint interval of 20)
    min_steps: int = 3  # intervals measured before the rhythm counts

    def __post_init__(self) -> None:
        if not 0 < self.floor_s <= self.cap_s:
            raise ConfigError(f"need 0 < floor_s <= cap_s, got {self.floor_s} and {self.cap_s}")
        if not 1.0 <= self.factor <= 100.0:
            raise ConfigError(f"factor must be in [1, 100], got {self.factor}")
        if not 1 <= self.min_steps <= self.window <= 4096:
            raise ConfigError(
                f"need 1 <= min_steps <= window <= 4096, got {self.min_steps} and {self.window}"
            )


class Patience:
    """One runner's frame deadlines, from the intervals between its step starts."""

    def __init__(self, config: PatienceConfig) -> None:
        self.config = config
        self._intervals: deque[float] = deque(maxlen=config.window)
        self._last: tuple[int, float] | None = None  # (step, when it started)

    def step_started(self, step: int, now: float) -> None:
        """Step ``step`` begins at ``now`` (monotonic): the interval since the previous step
        counts only when that was step - 1 (a failed step or a plan switch breaks the rhythm)."""
        if self._last is not None and self._last[0] == step - 1 and now >= self._last[1]:
            self._intervals.append(now - self._last[1])
        self._last = (step, now)

    def rhythm_s(self) -> float | None:
        """The slowest recent interval, or None before ``min_steps`` were measured."""
        if len(self._intervals) < self.config.min_steps:
            return None
        return max(self._intervals)

    def wait_s(self, frame_bytes: int, link_bytes_per_s: float = SLOW_LINK_BYTES_PER_S) -> float:
        """How long to wait for a frame of ``frame_bytes`` (over a link measured at
        ``link_bytes_per_s``) before giving up on its sender."""
        c = self.config
        rhythm = self.rhythm_s()
        if rhythm is None:
            return c.cap_s
        rate = min(max(link_bytes_per_s, 1.0), SLOW_LINK_BYTES_PER_S)
        transfer = SLOW_LINK_RTT_S + max(frame_bytes, 0) / rate
        return min(max(c.floor_s, c.factor * rhythm, transfer), c.cap_s)

    def grace_s(self) -> float:
        """How long, after our own wait ran out, the other members' word on their waits is
        worth waiting for (blame.py): they started waiting within about a step of us."""
        rhythm = self.rhythm_s()
        if rhythm is None:
            return self.config.cap_s / 4
        return min(max(5.0, 2.0 * rhythm), self.wait_s(0))
