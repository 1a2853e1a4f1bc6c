"""Our side of each peer's outbound path: one lane or libp2p tensor stream per peer, opened on
the first frame (or a lane only, for the link prober: ``open_lane``), watched for the peer
ending it, dropped when it breaks, a lane closed once idle (trio thread only).

A frame goes whole over one writer at a time (the per-peer lock), so a frame cut short by a
failed write ends that writer and nothing more follows on it; the next frame opens a new one.
"""

import time
from dataclasses import dataclass, field

import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH as _NOISE_MAX_PLAINTEXT
from libp2p.stream_muxer.yamux.yamux import HEADER_SIZE as _YAMUX_HEADER_BYTES
from libp2p.stream_muxer.yamux.yamux import MAX_MESSAGE_SIZE as _YAMUX_MAX_FRAME_BYTES

from fusionllm.common.logs import get_logger
from fusionllm.node.errors import DeadlineError
from fusionllm.node.p2p.host import TENSOR_PROTOCOL
from fusionllm.node.p2p.lane.senders import LaneSenders
from fusionllm.node.p2p.lane.service import Lanes
from fusionllm.node.p2p.lane.stream import LaneWriter
from fusionllm.node.p2p.peer_host import NETWORK_ERRORS, PeerHost, reset_quietly
from fusionllm.node.p2p.transport_types import PeerCounters

logger = get_logger(__name__)

# Bytes per stream.write: the most one yamux DATA frame carries inside one Noise message (yamux
# alone cuts 64 KiB frames, one byte over Noise's plaintext limit: twice the messages).
WRITE_CHUNK_BYTES = min(_YAMUX_MAX_FRAME_BYTES, _NOISE_MAX_PLAINTEXT) - _YAMUX_HEADER_BYTES

# A lane that carries no frame for this long is closed by us (a bulk probe's filler does not
# count): the link prober opens lanes to members the plan does not use (open_lane), and the
# receiver, which reads each lane in a thread of its own, would otherwise keep them as long as
# probes come (its idle_timeout_s counts filler). Half the receiver's default idle timeout;
# a peer probed again later, or sent a frame, gets a new lane (one offer, one TCP handshake).
LANE_IDLE_S = 300.0
_BUSY_RECHECK_S = 1.0  # an idle lane found busy (a bulk probe on it) is looked at again then


@dataclass
class _Writer:
    lock: trio.Lock = field(default_factory=trio.Lock)
    stream: INetStream | LaneWriter | None = None


class Outbound:
    """Per-peer writers of one transport; ``nursery`` is set while the transport serves."""

    def __init__(
        self,
        host: PeerHost,
        lanes: Lanes,
        senders: LaneSenders,
        counters: PeerCounters,
        *,
        dial_timeout_s: float,
    ) -> None:
        self._host, self._lanes, self._senders = host, lanes, senders
        self._counters, self._dial_timeout_s = counters, dial_timeout_s
        self._writers: dict[str, _Writer] = {}
        self.nursery: trio.Nursery | None = None

    def __len__(self) -> int:
        return len(self._writers)

    def lane_peers(self) -> list[str]:
        """The peers our frames go to over a lane now (not a libp2p stream)."""
        return sorted(p for p, w in self._writers.items() if isinstance(w.stream, LaneWriter))

    def punched_peers(self) -> list[str]:
        """Those of ``lane_peers`` whose lane's socket was punched, not dialled."""
        lanes = ((p, w.stream) for p, w in self._writers.items())
        return sorted(p for p, lane in lanes if isinstance(lane, LaneWriter) and lane.punched)

    async def write_frame(self, peer: str, head: bytes, body: bytes, timeout: float) -> None:
        out = self._writers.setdefault(peer, _Writer())
        async with out.lock:
            if isinstance(out.stream, LaneWriter) and out.stream.broken:
                self._drop_lane(peer, out)  # a caller's inline write failed on it
            reused = out.stream is not None
            if out.stream is None:
                await self._open(peer, out)
            if isinstance(out.stream, LaneWriter):
                await self._write_lane(peer, out, (head, body), timeout)
                return
            try:
                await self._write_or_drop(out, head)
            except NETWORK_ERRORS:
                if not reused:
                    raise
                # The peer ended the stream we kept (e.g. it refused our last frame) before our
                # watcher noticed; none of this frame went out, so one fresh stream is safe.
                logger.debug("stream to %s was dead; opening a new one", peer, exc_info=True)
                await self._open(peer, out)
                await self._write_or_drop(out, head)
            view = memoryview(body)
            for start in range(0, len(view), WRITE_CHUNK_BYTES):
                await self._write_or_drop(out, view[start : start + WRITE_CHUNK_BYTES])

    def forget(self, peer: str) -> None:
        """The peer has no connection left: drop its idle writer."""
        out = self._writers.get(peer)
        if out is not None and out.stream is None and not out.lock.locked():
            del self._writers[peer]

    async def open_lane(self, peer: str) -> bool:
        """Whether our writer for ``peer`` is a lane, dialling one where it has none (never a
        stream: the link prober wants the path tensors take); False where a stream carries the
        peer's frames, or no lane opened (lanes off, relayed, refused: Lanes.dial backs off).
        The lane then carries frames and is watched like one a frame opened."""
        out = self._writers.setdefault(peer, _Writer())
        async with out.lock:
            if isinstance(out.stream, LaneWriter) and out.stream.broken:
                self._drop_lane(peer, out)
            if out.stream is None:
                lane = await self._lanes.dial(self._host.libp2p, peer)
                if lane is not None:
                    self._adopt_lane(peer, out, lane)
            opened = isinstance(out.stream, LaneWriter)
        self.forget(peer)  # nothing kept for a peer we could not reach
        return opened

    async def reset_all(self) -> None:
        """End every writer (the transport detaches from a host that may live on)."""
        self._senders.clear()
        for out in self._writers.values():
            stream, out.stream = out.stream, None
            await reset_quietly(stream)

    async def _open(self, peer: str, out: _Writer) -> None:
        assert self.nursery is not None
        lane = await self._lanes.dial(self._host.libp2p, peer)
        if lane is not None:
            self._adopt_lane(peer, out, lane)
            return
        dial_s = self._dial_timeout_s
        # Dialing (when not connected yet) and protocol negotiation get the dial deadline, not
        # the longer write deadline: a silent peer would otherwise hold the send for minutes.
        stream: INetStream | None = None
        with trio.move_on_after(dial_s):
            stream = await self._host.libp2p.new_stream(ID.from_base58(peer), [TENSOR_PROTOCOL])
        if stream is None:
            raise DeadlineError(f"opening a stream to {peer} took over {dial_s}s")
        out.stream = stream
        self.nursery.start_soon(self._watch, peer, out, stream)

    def _adopt_lane(self, peer: str, out: _Writer, lane: LaneWriter) -> None:
        assert self.nursery is not None
        out.stream = lane
        self._senders.add(peer, lane)  # from now on callers write to it themselves
        self.nursery.start_soon(self._watch, peer, out, lane)
        self.nursery.start_soon(self._close_when_idle, peer, out, lane)

    async def _close_when_idle(self, peer: str, out: _Writer, lane: LaneWriter) -> None:
        """Close ``lane`` once no frame went over it for LANE_IDLE_S; ends with the lane."""
        while out.stream is lane:
            left = lane.frame_at + LANE_IDLE_S - time.monotonic()
            if left > 0:
                await trio.sleep(left)
            elif await self._close_if_idle(peer, out, lane):
                return
            else:
                await trio.sleep(_BUSY_RECHECK_S)

    async def _close_if_idle(self, peer: str, out: _Writer, lane: LaneWriter) -> bool:
        """Close ``lane`` if it is still ours, free and idle; whether it was closed."""
        async with out.lock:  # no frame of the trio path is being written
            if out.stream is not lane or not lane.lock.acquire(blocking=False):
                return False  # gone, or a caller's frame (or a bulk probe) is on it now
            try:
                if time.monotonic() - lane.frame_at < LANE_IDLE_S:
                    return False
                self._drop_lane(peer, out)
                lane.broken = True  # a thread that found it before the drop writes nothing
            finally:
                lane.lock.release()
        logger.debug("closing our lane to %s: no frame for %.0fs", peer, LANE_IDLE_S)
        await lane.close()  # its watcher wakes and forgets the writer
        return True

    async def _watch(self, peer: str, out: _Writer, stream: INetStream | LaneWriter) -> None:
        """Notice at once when the peer ends a stream we write to; receivers never write back.

        Without this a sender learns of a refused frame only at its next write, and frames
        written in between are lost; with it the next send opens a fresh stream.
        """
        try:
            await stream.read(1)
        except (*NETWORK_ERRORS, EOFError):
            # py-libp2p reports a peer's RST as EOF once it dropped the stream, so a reset
            # (frame refused) and a close (idle, shutdown) look alike here: both end the stream.
            logger.debug("%s ended our stream", peer, exc_info=True)
        self._counters.stream_ended(peer)
        if out.stream is stream:
            out.stream = None
        if isinstance(stream, LaneWriter):
            self._senders.drop(peer, stream)
        await reset_quietly(stream)
        if out.stream is None and not out.lock.locked() and self._writers.get(peer) is out:
            del self._writers[peer]  # the next send opens a new stream anyway

    async def _write_lane(
        self, peer: str, out: _Writer, parts: tuple[bytes, bytes], timeout: float
    ) -> None:
        """A frame the caller could not write itself (the lane was busy, or new): written by a
        worker thread, so the event loop never blocks on the socket."""
        lane = out.stream
        assert isinstance(lane, LaneWriter)
        try:
            await trio.to_thread.run_sync(lane.write_frame, parts, timeout, abandon_on_cancel=True)
        except BaseException:
            if lane.broken:
                self._drop_lane(peer, out)
            raise

    def _drop_lane(self, peer: str, out: _Writer) -> None:
        """Forget a broken lane (its watcher closes it): the next frame opens a new one."""
        if isinstance(out.stream, LaneWriter):
            self._senders.drop(peer, out.stream)
        out.stream = None

    @staticmethod
    async def _write_or_drop(out: _Writer, data: bytes | memoryview) -> None:
        stream = out.stream
        assert stream is not None
        try:
            await stream.write(data)
        except BaseException:
            # A frame cut short leaves the stream mid-frame: nothing more may follow on it.
            if out.stream is stream:
                out.stream = None
            await reset_quietly(stream)
            raise
