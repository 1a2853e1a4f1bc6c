"""The stream probe's payload as the prober's kernel timed it on the connection's socket.

A probe's own clocks read its hosts' CPU shares as much as the link: on a host whose quota a
busy loop takes, 20 Mbit/s links read 0.58-0.88 of their cap by the whole probe and the
server's tail (docs/results.md, session 8), because a throttled reader holds yamux's window
and the sender waits. The kernel times every ACK itself: a delivery-rate sample taken while
the prober had data queued (not app-limited) is what the path carried, whoever had the CPU,
as the lanes' bulk probe reads it (lane/bulk_figure.py: the same figure, the best but one of
the trusted samples each after an eighth of the probe more was acknowledged). The prober reads
``TCP_INFO`` after each 256 KiB write and once the ack is in; where no sample is trusted (a prober
too slow to keep the socket busy: a CPU-bound LAN) there is no figure, never a guess.
"""

import time
from collections.abc import Callable

from fusionllm.node.p2p.lane.bulk_figure import bulk_figure
from fusionllm.node.p2p.lane.tcp_info import TcpInfo
from fusionllm.node.p2p.lane.wire_meter import WireSample

_MAX_READINGS = 4096
_SAMPLES = 8


class SendTimer:
    """Readings of the prober's socket through a probe; ``figure`` the link's rate."""

    def __init__(
        self, view: Callable[[], TcpInfo | None] | None, wall: Callable[[], float] = time.time
    ) -> None:
        self._view = view
        self._wall = wall
        self._start: TcpInfo | None = None
        self._readings: list[tuple[TcpInfo, float]] = []

    def mark(self) -> None:
        """Read the kernel's view now (the first one is the start)."""
        info = self._view() if self._view is not None else None
        if info is None:
            return
        if self._start is None:
            self._start = info
        elif len(self._readings) < _MAX_READINGS:
            self._readings.append((info, self._wall()))

    def figure(self, nbytes: int) -> WireSample | None:
        if self._start is None:
            return None
        return bulk_figure(self._start, self._readings, min_bytes=max(1, nbytes // _SAMPLES))
