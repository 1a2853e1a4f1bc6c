"""The receiving half of the data plane: who may open a tensor stream, and what a frame may cost.

A public node is dialled by strangers, so every step is bounded before it is paid for:

1. at stream open: the peer must be one we expect (``admit``: the plan's members, a state
   transfer's), and under the per-peer and total stream limits; refusals are counted by
   reason (``Refusals``), never in a per-peer table;
2. at the frame's length: the body may be no longer than the longest frame of what we expect
   for its header (``TensorSpec.max_body_bytes``), and fits the peer's and the node's byte
   budgets (``ByteBudget``);
3. while the body arrives: memory grows with the bytes received, which must keep a minimum
   rate (``RateFloor``), not just a byte per read deadline;
4. before the tensor is allocated: its declared dtype, shape and size are checked against the
   spec (``parse_frame``); large results are decoded off the trio thread, a few at a time;
5. only a decoded frame takes one of the inbox's shared slots, so a peer that trickles holds
   none; a peer holds at most ``max_in_flight`` of them.
"""

import logging
import queue
from collections.abc import Callable
from typing import Protocol

import torch
import trio
from libp2p.abc import INetStream

from fusionllm.common.errors import FrameError, PeerError
from fusionllm.common.logs import get_logger
from fusionllm.compression import ParsedFrame, decode_frame, parse_frame
from fusionllm.node.errors import TransportError
from fusionllm.node.p2p.framing import FrameHeader, Reader, read_exactly, read_head
from fusionllm.node.p2p.lane.stream import LaneReader
from fusionllm.node.p2p.limits import ByteBudget, Refusals
from fusionllm.node.p2p.peer_host import NETWORK_ERRORS, reset_quietly
from fusionllm.node.p2p.stream_reader import StreamReader
from fusionllm.node.p2p.transport_types import (
    AdmitPeer,
    Deliver,
    PeerCounters,
    Received,
    SpecFor,
    TensorSpec,
    TransportConfig,
)

logger = get_logger(__name__)

# A stream keeps its largest body buffer up to this size for the next frame.
_MAX_SCRATCH_BYTES = 128 << 20

# Pause between short reads of a large body, to batch yamux window updates (framing.read_exactly).
# 2 ms: ~400 KB per read at the ~200 MB/s py-libp2p manages here, ~5x fewer updates; 1 ms and
# 0.5 ms saved less CPU on both ends.
_BODY_READ_BATCH_S = 0.002

# Large decodes at once: each is CPU-bound copying, and each holds its result's memory.
_CONCURRENT_DECODES = 2

# Refusal reasons (keys of ``Transport.refusals()``).
NOT_ADMITTED = "stream_not_admitted"
TOO_MANY_STREAMS = "too_many_streams"
TOO_MANY_PEER_STREAMS = "too_many_streams_per_peer"
OVER_BUDGET = "body_over_budget"
BODY_TOO_LONG = "body_longer_than_expected"


class _Closable(Protocol):
    """What _serve ends a stream or lane with."""

    async def close(self) -> None: ...

    async def reset(self) -> None: ...


class Inbound:
    """Serves inbound tensor streams into ``inbox``; lives in the host's trio thread."""

    def __init__(
        self,
        config: TransportConfig,
        *,
        inbox: queue.Queue,
        counters: PeerCounters,
        refusals: Refusals,
        expect: SpecFor | None,
        admit: AdmitPeer | None,
        deliver: Deliver | None = None,
    ) -> None:
        self.config = config
        self._inbox = inbox
        self._deliver = deliver
        self._counters = counters
        self._refusals = refusals
        self._expect = expect
        self._admit = admit
        self._budget = ByteBudget(
            per_peer=config.max_peer_pending_bytes, total=config.max_pending_bytes
        )
        self._inbox_slots = trio.Semaphore(config.inbox_size)
        self._peer_slots: dict[str, trio.Semaphore] = {}
        self._decoders = trio.CapacityLimiter(_CONCURRENT_DECODES)
        self._streams = 0  # inbound streams open, all peers

    @property
    def budget(self) -> ByteBudget:
        return self._budget

    def tracked_peers(self) -> int:
        """Peers with per-peer state here (slots): pruned when their last stream ends."""
        return len(self._peer_slots)

    async def handle_stream(self, stream: INetStream) -> None:
        """TENSOR_PROTOCOL's handler: frames from the Noise-authenticated peer."""
        peer = stream.muxed_conn.peer_id.to_base58()
        await self._handle(peer, stream, StreamReader(stream), _BODY_READ_BATCH_S)

    async def handle_lane(self, peer: str, lane: LaneReader) -> None:
        """Frames on a lane the peer redeemed a ticket for (lane/): the same admission,
        limits and checks as a stream, without yamux's window updates to batch."""
        await self._handle(peer, lane, lane, 0.0)

    async def _handle(self, peer: str, stream: _Closable, reader: Reader, batch_s: float) -> None:
        refusal = self._refusal(peer)
        if refusal is not None:
            self.refuse(refusal, peer)
            await reset_quietly(stream)
            return
        self._streams += 1
        try:
            await self._serve(peer, stream, reader, batch_s)
        finally:
            self._streams -= 1
            self._counters.close_inbound(peer)
            self._prune(peer)

    def refuse(self, reason: str, peer: str) -> None:
        count = self._refusals.add(reason)
        # Visible in the node's log without letting a flood flood it: the 1st, 2nd, 4th, ...
        level = logging.INFO if count & (count - 1) == 0 else logging.DEBUG
        logger.log(level, "refused %s from %s (%d so far)", reason, peer, count)

    def admits(self, peer: str) -> bool:
        """Whether the admission hook lets ``peer`` send us frames (a stream, or a lane)."""
        try:
            return self._admit is None or bool(self._admit(peer))
        except Exception:  # a broken hook refuses; it must never take a handler down
            logger.warning("the admission hook failed for %s", peer, exc_info=True)
            return False

    def _refusal(self, peer: str) -> str | None:
        """Why ``peer`` may not open a stream now, or None (then it is counted as open)."""
        if not self.admits(peer):
            return NOT_ADMITTED
        if self._streams >= self.config.max_inbound_streams:
            return TOO_MANY_STREAMS
        if not self._counters.open_inbound(peer, self.config.max_streams_per_peer):
            self._counters.error(peer, TransportError())
            return TOO_MANY_PEER_STREAMS
        return None

    async def _serve(self, peer: str, stream: _Closable, reader: Reader, batch_s: float) -> None:
        try:
            await self._read_frames(peer, reader, batch_s)
        except (PeerError, *NETWORK_ERRORS) as exc:
            # The peer's fault (or its network's): drop this stream, keep everything else.
            self._counters.error(peer, exc)
            logger.debug("closing a stream from %s", peer, exc_info=True)
            await reset_quietly(stream)
        except Exception as exc:
            # A failure we did not foresee still costs only this stream, never the node.
            self._counters.error(peer, exc)
            logger.warning("unexpected error on a stream from %s", peer, exc_info=True)
            await reset_quietly(stream)
        else:
            try:
                await stream.close()
            except NETWORK_ERRORS:
                logger.debug("closing a finished stream from %s failed", peer, exc_info=True)

    def forget(self, peer: str) -> None:
        """The peer disconnected: drop its slots (kept while a frame of it still waits)."""
        self._prune(peer)

    def _prune(self, peer: str) -> None:
        """Forget a peer's slots once it has no stream and no frame waiting in the inbox."""
        slots = self._peer_slots.get(peer)
        if (
            slots is not None
            and slots.value == self.config.max_in_flight
            and self._counters.inbound_of(peer) == 0
        ):
            del self._peer_slots[peer]

    async def _read_frames(self, peer: str, reader: Reader, batch_s: float) -> None:
        config = self.config
        scratch = bytearray()  # reused for every body on this stream (warm pages)
        while True:
            head = await read_head(
                reader,
                max_body_bytes=config.max_body_bytes,
                stall_timeout_s=config.read_timeout_s,
                idle_timeout_s=config.idle_timeout_s,
            )
            if head is None:
                return
            header, body_len = head
            spec = self._spec_for(header, body_len)
            # Backpressure: do not read the body until the compute side has room for this
            # peer's frame; meanwhile its window fills and its writes wait.
            peer_slots = self._peer_slots.setdefault(peer, trio.Semaphore(config.max_in_flight))
            await peer_slots.acquire()
            try:
                tensor, scratch = await self._receive_body(
                    peer, reader, body_len, spec, scratch, batch_s
                )
                self._counters.received(peer, body_len)
                received = Received(peer, header, tensor)
                if self._delivered(received):
                    peer_slots.release()
                    continue
                await self._inbox_slots.acquire()  # only whole frames hold a shared slot
            except BaseException:
                peer_slots.release()
                raise
            release = _releaser(peer_slots, self._inbox_slots)
            self._inbox.put((received, release))

    def _delivered(self, received: Received) -> bool:
        """Whether the deliver hook took the frame (then it skips the inbox and its thread hops)."""
        if self._deliver is None:
            return False
        try:
            return self._deliver(received)
        except Exception:  # a broken hook drops this frame, never the peer's stream
            logger.warning("deliver failed on a frame from %s", received.peer, exc_info=True)
            return True

    def _spec_for(self, header: FrameHeader, body_len: int) -> TensorSpec | None:
        """What the frame must hold; FrameError if its length already says it does not."""
        spec = self._expect(header) if self._expect is not None else None
        if spec is not None and body_len > spec.max_body_bytes:
            self._refusals.add(BODY_TOO_LONG)  # the peer's FrameError is logged by _serve
            raise FrameError(
                f"a body of {body_len} bytes for {header}: no frame of the expected "
                f"{spec.dtype} {list(spec.shape)} is longer than {spec.max_body_bytes}"
            )
        return spec

    async def _receive_body(
        self,
        peer: str,
        reader: Reader,
        body_len: int,
        spec: TensorSpec | None,
        scratch: bytearray,
        batch_s: float,
    ) -> tuple[torch.Tensor, bytearray]:
        """The body read (within the budgets and the rate floor) and decoded."""
        if not self._budget.reserve(peer, body_len):
            self._refusals.add(OVER_BUDGET)  # the peer's FrameError is logged by _serve
            raise FrameError(
                f"a body of {body_len} bytes is over the budget (peer holds "
                f"{self._budget.held_by(peer)}, all peers {self._budget.used})"
            )
        try:
            body = await read_exactly(
                reader,
                body_len,
                stall_timeout_s=self.config.read_timeout_s,
                what="body",
                into=scratch,
                batch_s=batch_s,
                floor=self.config.rate_floor(),
            )
            if isinstance(body, bytearray) and len(body) <= _MAX_SCRATCH_BYTES:
                scratch = body  # grown for this frame: warm for the next one
            # decode_frame copies each payload once into the new tensor and keeps no view of
            # the body, so the scratch buffer is free for the next frame once it returns.
            tensor = await self._decode(body, spec)
        finally:
            self._budget.release(peer, body_len)
        if spec is not None:
            spec.check(tensor)
        return tensor, scratch

    async def _decode(self, body: bytearray | memoryview, spec: TensorSpec | None) -> torch.Tensor:
        threshold = self.config.decode_in_thread_bytes
        if len(body) >= threshold:
            # A large body may take the slow parse (msgpack copies its payloads): all of it
            # in a worker thread, so the loop keeps serving other streams meanwhile.
            return await trio.to_thread.run_sync(
                lambda: decode_frame(self._parse(body, spec)),
                abandon_on_cancel=True,
                limiter=self._decoders,
            )
        parsed = self._parse(body, spec)
        if parsed.decoded_bytes < threshold:
            return decode_frame(parsed)
        # A small body that expands to a large tensor: allocated and filled off the loop.
        return await trio.to_thread.run_sync(
            decode_frame, parsed, abandon_on_cancel=True, limiter=self._decoders
        )

    def _parse(self, body: bytearray | memoryview, spec: TensorSpec | None) -> ParsedFrame:
        parsed = parse_frame(
            body,
            limits=self.config.limits,
            expect_dtype=spec.dtype if spec is not None else None,
            expect_shape=spec.shape if spec is not None else None,
        )
        # With a spec, the run's layout bounds the tensor; without one, this limit does.
        if spec is None and parsed.decoded_bytes > self.config.max_decoded_bytes:
            raise FrameError(
                f"frame expands to {parsed.decoded_bytes} bytes, over the limit of "
                f"{self.config.max_decoded_bytes}"
            )
        return parsed


def _releaser(*semaphores: trio.Semaphore) -> Callable[[], None]:
    done = False

    def release() -> None:
        nonlocal done
        if not done:
            done = True
            for semaphore in semaphores:
                semaphore.release()

    return release
