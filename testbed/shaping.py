"""Shaping, pure: FIFOs with a rate and a drop-tail limit, and a packet's path through them.

A ``Fifo`` keeps only the time its last accepted byte leaves (``busy_until``): its backlog in
bytes is what is left of that at its rate, so there is no per-packet queue to walk. A packet
that finds the backlog over the limit is dropped (drop-tail); otherwise it leaves once the
bytes before it and its own are sent. Departure times are computed, not observed, so a timer
that fires late never slows a link down.

A packet goes ``uplink(src) -> link(src, dst) [loss, rate] -> delay(src, dst) ->
downlink(dst)``; ``Path`` strings those together for the emulator, one step at a time.
"""

import math
import random
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class FifoStats:
    packets: int = 0
    bytes: int = 0
    dropped: int = 0  # queue full
    lost: int = 0  # random loss

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("packets", "bytes", "dropped", "lost")}


@dataclass(kw_only=True)
class Fifo:
    """One direction of a shaped hop. ``rate``: bytes/s (None: no cap, no queue)."""

    rate: float | None
    limit_bytes: int
    busy_until: float = 0.0
    stats: FifoStats = field(default_factory=FifoStats)

    def __post_init__(self) -> None:
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate {self.rate} B/s must be positive and finite")
        if self.limit_bytes <= 0:
            raise ValueError(f"limit {self.limit_bytes} bytes must be positive")

    def backlog(self, now: float) -> float:
        """Bytes still queued at ``now``."""
        if self.rate is None:
            return 0.0
        return max(0.0, self.busy_until - now) * self.rate

    def offer(self, now: float, size: int) -> float | None:
        """When a packet of ``size`` wire bytes offered at ``now`` has left; None: dropped."""
        if self.rate is None:
            self.stats.packets += 1
            self.stats.bytes += size
            return now
        if self.backlog(now) + size > self.limit_bytes:
            self.stats.dropped += 1
            return None
        self.busy_until = max(now, self.busy_until) + size / self.rate
        self.stats.packets += 1
        self.stats.bytes += size
        return self.busy_until


def survives(loss: float, segments: int, rng: random.Random) -> bool:
    """Whether a frame of ``segments`` wire packets gets through a link losing ``loss`` of
    its packets. A GSO burst cannot lose one segment alone here (it is not split): the whole
    burst goes with the chance that any of its segments would, so loss *events*, what TCP
    reacts to, come as often as on the wire (the bytes lost are overcounted)."""
    if loss <= 0:
        return True
    return rng.random() >= 1.0 - (1.0 - loss) ** segments


@dataclass(kw_only=True)
class Path:
    """The shaped path from one host to another; ``down`` is shared by every sender to dst."""

    up: Fifo
    link: Fifo
    delay_s: float
    loss: float
    down: Fifo
