"""The link prober's measure over a lane (``NodeDaemon.lane_probe``): a bulk probe (bulk.py) on
our lane to the peer, opening one first where none is open.

Lanes open when a frame is first sent, so without this only the links the plan uses had one:
every other member link got the stream probe (noise and yamux paced by Python), which on a
CPU-throttled host reads a 1 Gbit/s link at 0.06-0.47 of its rate, where a bulk probe reads
113-122 MB/s of 125 (issue 25). The planner then saw LAN links outside the plan 2-15x slower
than they are. A peer no lane can reach (lanes off, relayed and not punched, refusing us) gets
None, and the stream probe measures it.
"""

from collections.abc import Callable

from fusionllm.common.logs import get_logger
from fusionllm.node.errors import TransportClosedError
from fusionllm.node.p2p.lane.senders import LaneSenders
from fusionllm.node.p2p.lane.wire_meter import WireSample

logger = get_logger(__name__)

# How long the probe thread waits for a new lane. On a LAN one opens in an offer's round trip
# and a TCP handshake (milliseconds); a lane that cannot open fails within the transport's
# lane_timeout_s (3 s by default: a filtered port), a punched one within twice that. Past
# this the link gets the stream probe this round, and a lane opened meanwhile serves the next.
LANE_OPEN_WAIT_S = 4.0

# (peer, longest wait in s) -> whether a lane to it is open now: Transport.open_lane.
OpenLane = Callable[[str, float], bool]


class LaneProber:
    """``(peer, nbytes) -> WireSample | None``: the kernel-timed figure of a bulk probe on a
    lane to ``peer``, opened for it where none was; None where no lane could be had in
    ``open_wait_s``, or the probe found it busy or trusted no sample (then a stream probe
    measures). Called from the daemon's probe thread."""

    def __init__(
        self, senders: LaneSenders, open_lane: OpenLane, *, open_wait_s: float = LANE_OPEN_WAIT_S
    ) -> None:
        self._senders = senders
        self._open_lane = open_lane
        self._open_wait_s = open_wait_s

    def __call__(self, peer: str, nbytes: int) -> WireSample | None:
        if not self._senders.has(peer) and not self._opened(peer):
            return None
        return self._senders.bulk_probe(peer, nbytes)

    def _opened(self, peer: str) -> bool:
        try:
            opened = self._open_lane(peer, self._open_wait_s)
        except TransportClosedError:
            return False  # training ended; the daemon's stream probe goes on without it
        logger.debug("opening a lane to probe %s: %s", peer[:16], "open" if opened else "none")
        return opened
