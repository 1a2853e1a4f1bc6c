"""How much of our uplink the link probes may take: a share of the time, with a burst at start.

A probe is bulk data: 1 MiB by default, a second of an 8 Mbit/s home uplink. Before this
budget a node probed ``fanout`` peers every round whatever its link; on the testbed's
topology C (issue 25) the homes the plan did not seat sent 51-63% of their uplinks in probes,
and a seated 1 MB/s home 37% beside the naive plan's frames, which then stepped in 2.13 s
against an estimate of 1.13 s (1.67 s with this budget, the estimate 0.91 of it).

``ProbeBudget`` is a token bucket over seconds of probing: it refills at ``share`` seconds per
second up to ``burst_s``, and a probe may start while the bucket holds anything (a probe's
length is known only once it ran, so it is charged after, and the bucket may go negative:
the next probe then waits until it has paid back). The burst lets a newcomer measure every
link at once (the swarm cannot plan it in before), the share bounds the steady state: at 0.1,
a 1 MiB probe on an 8 Mbit/s uplink comes at most every ~10 s, on a 1 Gbit/s LAN every 0.1 s
(where the round's interval binds first). Pure bookkeeping over a clock the caller passes:
tests drive it with a fake one.
"""

import math
from dataclasses import dataclass

from fusionllm.common.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ProbeBudgetConfig:
    share: float = 0.1  # of the time, at most, that our probes occupy our uplink
    burst_s: float = 8.0  # seconds of probing allowed back to back (a full bucket)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.share) and 0 < self.share <= 1):
            raise ConfigError(f"share must be in (0, 1], got {self.share}")
        if not (math.isfinite(self.burst_s) and 0 < self.burst_s <= 3600):
            raise ConfigError(f"burst_s must be in (0, 3600], got {self.burst_s}")


class ProbeBudget:
    """Seconds of probing we may spend now; one per link monitor, used by its probe thread."""

    def __init__(self, config: ProbeBudgetConfig | None = None, *, now: float) -> None:
        self.config = config or ProbeBudgetConfig()
        self._level = self.config.burst_s  # seconds of probing in the bucket
        self._at = now

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self._at)  # a clock that steps back refills nothing
        self._level = min(self.config.burst_s, self._level + elapsed * self.config.share)
        self._at = max(self._at, now)

    def allows(self, now: float) -> bool:
        """Whether a probe may start now."""
        self._refill(now)
        return self._level > 0

    def spend(self, seconds: float, now: float) -> None:
        """Charge a probe that took ``seconds`` (its wall time, failed or not)."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
        self._refill(now)
        self._level -= seconds

    def ready_in(self, now: float) -> float:
        """Seconds until a probe may start (0: now)."""
        self._refill(now)
        return 0.0 if self._level > 0 else -self._level / self.config.share + 1e-9
