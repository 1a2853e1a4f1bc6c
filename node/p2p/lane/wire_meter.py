"""A link's bandwidth and latency as the kernel timed the lane's own frames.

``WireMeter`` turns the ``tcp_info`` a lane's sender reads after its frames into a figure for
the links table. Which kernel figures count, and why:

- the delivery rate of a sample taken while data was queued (not ``app_limited``): the kernel
  timed ACKs for bytes that waited on the link, so the rate is what the path carried, whoever
  had the CPU. A sample taken while the lane ran dry (an idle link, a small frame, a sender
  starved of CPU between frames) says how fast we wrote, not what the link can do: dropped,
  never filed as a slow link. Receive-window or slow-start limits can still hold a busy sample
  below the link's rate, so it is a lower bound like a probe's, and the book keeps the best of
  its window (bandwidth.py).
- the latency: the kernel's windowed minimum RTT (the smoothed one counts our own queue).
- a sample only once at least ``min_bytes`` more were acknowledged than at the last one
  (the kernel's rate stays put while a lane idles: the same figure must not count twice),
  and the figure is the median of an interval's (``min_interval_s``) samples: a sample can
  read low without being app-limited (its interval may span a gap between frames) and high
  (ACKs bunched by a queue: 1.14x of the cap seen on the testbed), and the book keeps the
  best of its window, where a high one would stick.
- measured on the testbed (docs/testbed.md): frames of 1 MiB, back to back or 50 ms apart,
  read a 1 Gbit/s link at 91-124 MB/s whatever the sender's CPU share; frames of 128 KiB
  20 ms apart give no figure worth filing (they never fill the pipe for long).
"""

import math
import statistics
import threading
from dataclasses import dataclass, field

from fusionllm.common.errors import ConfigError
from fusionllm.node.p2p.lane.tcp_info import TcpInfo

_ESTABLISHED = 1  # TCP_ESTABLISHED in linux/tcp_states.h
# Tighter than a gossiped link's bound (1e15, dht/records.py): a kernel counter gone wrong
# must not become a link the planner routes everything over.
MAX_WIRE_BYTES_PER_S = 100e9
MIN_WIRE_RTT_S = 1e-6
MAX_WIRE_RTT_S = 600.0
_MAX_PER_INTERVAL = 256


@dataclass(frozen=True)
class WireSample:
    bandwidth: float  # bytes/s
    rtt: float  # s
    measured_at: float  # wall clock
    punched: bool = False  # the lane's socket was punched through NATs (punch.py)
    probe_bytes: int = 0  # what a bulk probe wrote to take it (0: a frame's figure)
    # A bulk probe's counted rate samples in order (bytes/s; negative: read in slow start),
    # for the log: a figure over the link's cap is told from its samples (bulk_figure.py).
    samples: tuple[float, ...] = field(default=(), compare=False)


@dataclass(frozen=True, kw_only=True)
class WireMeterConfig:
    min_bytes: int = 256 << 10
    min_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.min_bytes, bool) or not isinstance(self.min_bytes, int):
            raise ConfigError(f"min_bytes must be an int, got {self.min_bytes!r}")
        if self.min_bytes < 1:
            raise ConfigError(f"min_bytes must be >= 1, got {self.min_bytes}")
        if not (math.isfinite(self.min_interval_s) and self.min_interval_s >= 0):
            raise ConfigError(f"min_interval_s must be finite and >= 0, got {self.min_interval_s}")


class WireMeter:
    """One lane's kernel-timed figure; ``observe`` from the sending thread, ``latest`` from
    any (thread-safe)."""

    def __init__(self, config: WireMeterConfig | None = None) -> None:
        self.config = config or WireMeterConfig()
        self._lock = threading.Lock()
        self._acked = 0  # bytes_acked at the last sample taken
        self._started = -math.inf  # when the current interval began
        self._rates: list[float] = []  # the current interval's samples
        self._rtts: list[float] = []
        self._latest: WireSample | None = None

    def observe(self, info: TcpInfo, now: float) -> WireSample | None:
        """File ``info`` read at wall-clock ``now``; the figure it changed, or None."""
        if not trusted(info):
            return None
        with self._lock:
            if info.bytes_acked - self._acked < self.config.min_bytes:
                return None
            self._acked = info.bytes_acked
            if now - self._started >= self.config.min_interval_s:
                self._started = now
                self._rates.clear()
                self._rtts.clear()
            if len(self._rates) < _MAX_PER_INTERVAL:
                self._rates.append(info.delivery_rate)
                self._rtts.append(info.min_rtt_s)
            rate = statistics.median(self._rates)
            self._latest = WireSample(rate, min(self._rtts), now)
            return self._latest

    def latest(self) -> WireSample | None:
        with self._lock:
            return self._latest


def trusted(info: TcpInfo) -> bool:
    """A sample the kernel took while data was queued on an established lane, in bounds."""
    return (
        info.state == _ESTABLISHED
        and not info.app_limited
        and 0 < info.delivery_rate <= MAX_WIRE_BYTES_PER_S
        and MIN_WIRE_RTT_S <= info.min_rtt_s <= MAX_WIRE_RTT_S
    )
