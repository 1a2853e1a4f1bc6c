"""Lanes open to peers, by peer: where a caller's thread writes a frame itself.

The host's trio thread adds a lane when it opens one and drops it when the lane ends or
breaks; any thread may ``try_write`` a frame to a peer. A frame written here costs no hop to
the trio thread (through it, ~0.4 ms of Python per frame on a busy core). When the lane is busy
(another thread is writing) or there is none yet, ``try_write`` returns None and the frame
takes the trio path instead.
"""

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.node.p2p.lane.bulk import BULK_TIMEOUT_S, run_bulk
from fusionllm.node.p2p.lane.bulk_figure import samples_text
from fusionllm.node.p2p.lane.stream import LaneWriter
from fusionllm.node.p2p.lane.wire_meter import WireSample
from fusionllm.node.p2p.transport_types import PeerCounters

logger = get_logger(__name__)


class LaneSenders:
    def __init__(self, counters: PeerCounters) -> None:
        self._counters = counters
        self._by_peer: dict[str, LaneWriter] = {}  # single dict operations: safe across threads

    def add(self, peer: str, lane: LaneWriter) -> None:
        self._by_peer[peer] = lane

    def has(self, peer: str) -> bool:
        """Whether a lane to ``peer`` is open (any thread)."""
        return peer in self._by_peer

    def drop(self, peer: str, lane: LaneWriter) -> None:
        if self._by_peer.get(peer) is lane:
            del self._by_peer[peer]

    def clear(self) -> None:
        self._by_peer.clear()

    def wire_samples(self) -> dict[str, WireSample]:
        """Each open lane's newest kernel-timed figure (wire_meter.py), by peer; any thread."""
        lanes = list(self._by_peer.items())  # one operation: a copy safe across threads
        return {
            peer: replace(s, punched=True) if lane.punched else s
            for peer, lane in lanes
            if (s := lane.meter.latest()) is not None
        }

    def bulk_probe(
        self, peer: str, nbytes: int, timeout: float = BULK_TIMEOUT_S
    ) -> WireSample | None:
        """The link to ``peer`` timed by the kernel under ``nbytes`` of filler on our lane to it
        (lane/bulk.py), from this thread: None where no lane is open, it stayed busy with
        frames, or no sample was trusted (then a stream probe measures). A lane whose write
        failed is dropped, as a frame's would be."""
        lane = self._by_peer.get(peer)
        if lane is None:
            return None
        written = 0

        def on_frame(size: int) -> None:
            nonlocal written
            written += size
            self._counters.sent(peer, size)

        try:
            # Counted frame by frame: a busy lane sends nothing, a broken one part of it.
            sample = run_bulk(lane, nbytes, timeout, on_frame=on_frame)
        except FusionError:
            logger.debug("a bulk probe to %s broke its lane", peer, exc_info=True)
            self.drop(peer, lane)
            return None
        if sample is None:
            return None
        logger.info("bulk probe to %s: %.3g MB/s, rtt %.1f ms, from %d bytes; samples (MB/s, "
                    "* in slow start) %s", peer, sample.bandwidth / 1e6, sample.rtt * 1e3,
                    written, samples_text(sample.samples))  # fmt: skip
        return replace(sample, punched=lane.punched or sample.punched, probe_bytes=written)

    def try_write(
        self, peer: str, parts: tuple[bytes, bytes], timeout: float
    ) -> "Future[None] | None":
        """Seal and write a frame (head, body) from this thread, if a lane to ``peer`` is open
        and free; None otherwise. Never waits for the network: what the socket does not take
        at once, a thread of the frame's own sends (holding the lane until it is out, so the
        next frames wait in the other path's ``max_in_flight``). The future resolves when the
        frame is out, or fails when the lane broke (the next frame opens a new one)."""
        lane = self._by_peer.get(peer)
        if lane is None or not lane.lock.acquire(blocking=False):
            return None
        if lane.broken:  # closed after we found it (idle, outbound.py): the other path reopens
            lane.lock.release()
            return None
        future: Future[None] = Future()
        deadline = time.monotonic() + timeout
        try:
            finish = lane.start_locked(parts)
        except FusionError as exc:
            lane.lock.release()
            self._settle(future, peer, lane, parts, exc)
            return future
        if finish is None:
            lane.lock.release()
            self._settle(future, peer, lane, parts, None)
            return future
        # The socket's buffer is full (a slow link, a busy peer): compute goes on meanwhile.
        threading.Thread(
            target=self._finish,
            args=(future, peer, lane, parts, finish, deadline),
            name="lane-finish",
            daemon=True,
        ).start()
        return future

    def _finish(
        self,
        future: "Future[None]",
        peer: str,
        lane: LaneWriter,
        parts: tuple[bytes, bytes],
        finish: Callable[[float], None],
        deadline: float,
    ) -> None:
        error: FusionError | None = None
        try:
            finish(deadline)
        except FusionError as exc:
            error = exc
        finally:
            lane.lock.release()
        self._settle(future, peer, lane, parts, error)

    def _settle(
        self,
        future: "Future[None]",
        peer: str,
        lane: LaneWriter,
        parts: tuple[bytes, bytes],
        error: FusionError | None,
    ) -> None:
        if error is not None:
            logger.debug("a frame to %s failed on its lane", peer, exc_info=error)
            self.drop(peer, lane)
            future.set_exception(error)
            return
        self._counters.sent(peer, sum(len(part) for part in parts))
        future.set_result(None)
