"""How long moving state between nodes may take: its bytes at the link's measured bandwidth.

The waits were fixed figures tuned on loopback (a hand-over 30 s, donors 5 s), whatever the
state's size: at 8 Mbit/s a GPT-2 small stage's parameters and AdamW moments take minutes, so
a node gave up on a hand-over still arriving and the next plan rolled back. A wait is now the
fixed figure (round trips, a link not measured yet) plus the bytes at the measured rate with a
slack (the rate is a mean, and the transfer shares the link with training), capped.
"""

import math
from dataclasses import dataclass

from fusionllm.common.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class TransferWait:
    floor_s: float  # the wait for a small state, or on a link not measured yet
    slack: float = 3.0  # times the bytes' time at the measured rate
    cap_s: float = 1800.0  # a link measured far too slow must not hold a plan for hours

    def __post_init__(self) -> None:
        if not 0 < self.floor_s <= self.cap_s:
            raise ConfigError(f"need 0 < floor_s <= cap_s, got {self.floor_s}, {self.cap_s}")
        if not 1.0 <= self.slack <= 100.0:
            raise ConfigError(f"slack must be in [1, 100], got {self.slack}")

    def seconds(self, nbytes: int, bytes_per_s: float) -> float:
        """The wait for ``nbytes`` over a link measured at ``bytes_per_s`` (0, inf or nan:
        unmeasured, the floor alone)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if not math.isfinite(bytes_per_s) or bytes_per_s <= 0:
            return self.floor_s
        return min(self.cap_s, self.floor_s + self.slack * nbytes / bytes_per_s)


HAND_OVER = TransferWait(floor_s=30.0)  # a leaver's live stage to its keeper
MOVES = TransferWait(floor_s=30.0)  # state moved between members as a plan starts
DONORS = TransferWait(floor_s=5.0)  # copies from nodes outside the plan (they may be gone)
