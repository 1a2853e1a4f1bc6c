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

import contextlib
import logging
import queue
import socket
import threading
from collections.abc import Callable
from typing import Protocol

import torch
import trio
from libp2p.abc import INetStream

from fusionllm.common.errors import FrameError, PeerError
from fusionllm.common.logs import get_logger
from fusionllm.compression import ParsedFrame, decode_frame, parse_frame
from fusionllm.node.errors import TransportClosedError, TransportError
from fusionllm.node.p2p.framing import (
    FrameHeader,
    FrameKind,
    Reader,
    keep_warm,
    read_exactly,
    read_head,
)
from fusionllm.node.p2p.lane.serve import LaneFrames
from fusionllm.node.p2p.lane.stream import BlockingLaneReader
from fusionllm.node.p2p.limits import ByteBudget, Refusals, Slots
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

# Pause between short reads of a large body, to batch yamux window updates (framing.read_exactly).
# 2 ms: ~400 KB per read at the ~200 MB/s py-libp2p manages here, ~5x fewer updates; 1 ms and
# 0.5 ms saved less CPU on both ends.
_BODY_READ_BATCH_S = 0.002

# Large decodes at once: each is CPU-bound copying, and each holds its result's memory.
_CONCURRENT_DECODES = 2

# How often a lane's thread waiting for an inbox slot looks whether the transport stopped.
_SLOT_WAIT_S = 0.5

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
        # Slots, not trio semaphores: lanes' threads take them, recv's callers give them back.
        self._inbox_slots = Slots(config.inbox_size)
        self._peer_slots: dict[str, Slots] = {}
        self._slots_lock = threading.Lock()  # the dict: the trio thread and lanes' threads
        self._stopping = threading.Event()  # lanes' threads waiting for a slot give up
        self._decoders = trio.CapacityLimiter(_CONCURRENT_DECODES)
        self.thread_decoders = threading.Semaphore(_CONCURRENT_DECODES)  # lanes' threads
        self._lane_threads = trio.CapacityLimiter(config.max_inbound_streams)
        self._streams = 0  # inbound streams and lanes open, all peers

    @property
    def budget(self) -> ByteBudget:
        return self._budget

    @property
    def counters(self) -> PeerCounters:
        return self._counters

    def tracked_peers(self) -> int:
        """Peers with per-peer state here (slots): pruned when their last stream ends."""
        return len(self._peer_slots)

    async def handle_stream(self, stream: INetStream) -> None:
        """TENSOR_PROTOCOL's handler: frames from the Noise-authenticated peer."""
        peer = stream.muxed_conn.peer_id.to_base58()
        await self._handle(peer, stream, StreamReader(stream), _BODY_READ_BATCH_S)

    async def handle_lane(self, peer: str, sock: trio.socket.SocketType, key: bytes) -> None:
        """Frames on a lane the peer redeemed a ticket for (lane/): the same admission,
        limits and checks as a stream, read in a thread of the lane's own (lane/serve.py)."""
        if not self._admitted(peer):
            sock.close()
            return
        blocking = socket.socket(fileno=sock.detach())
        reader = BlockingLaneReader(blocking, key)
        try:
            await trio.to_thread.run_sync(
                self._serve_lane,
                peer,
                reader,
                abandon_on_cancel=True,
                limiter=self._lane_threads,
            )
        finally:
            with contextlib.suppress(OSError):
                blocking.shutdown(socket.SHUT_RDWR)  # wakes a thread we stopped waiting for
            self._closed(peer)

    def _serve_lane(self, peer: str, reader: BlockingLaneReader) -> None:
        """In the lane's thread: its frames until it ends; one peer's lane failing costs only it."""
        try:
            LaneFrames(self, peer, reader).serve()
        except (PeerError, OSError) as exc:
            if self._stopping.is_set():  # our own shutdown cut it: not the peer's fault
                logger.debug("a lane from %s ended with the transport", peer)
            else:
                self._counters.error(peer, exc)
                logger.debug("closing a lane from %s", peer, exc_info=True)
        except Exception as exc:
            self._counters.error(peer, exc)
            logger.warning("unexpected error on a lane from %s", peer, exc_info=True)
        finally:
            reader.close()

    async def _handle(self, peer: str, stream: _Closable, reader: Reader, batch_s: float) -> None:
        if not self._admitted(peer):
            await reset_quietly(stream)
            return
        try:
            await self._serve(peer, stream, reader, batch_s)
        finally:
            self._closed(peer)

    def _admitted(self, peer: str) -> bool:
        """Admission at open (counted as open if so; ``_closed`` undoes it), or a refusal."""
        refusal = self._refusal(peer)
        if refusal is not None:
            self.refuse(refusal, peer)
            return False
        self._streams += 1
        return True

    def _closed(self, peer: str) -> None:
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

    def stop(self) -> None:
        """The transport is stopping: lanes' threads waiting for an inbox slot give up."""
        self._stopping.set()

    def _slots_of(self, peer: str) -> Slots:
        with self._slots_lock:
            slots = self._peer_slots.get(peer)
            if slots is None:
                slots = self._peer_slots[peer] = Slots(self.config.max_in_flight)
            return slots

    def _prune(self, peer: str) -> None:
        """Forget a peer's slots once it has no stream and no frame waiting in the inbox."""
        with self._slots_lock:
            slots = self._peer_slots.get(peer)
            if (
                slots is not None
                and slots.value == self.config.max_in_flight
                and self._counters.inbound_of(peer) == 0
            ):
                del self._peer_slots[peer]

    async def _read_frames(self, peer: str, reader: Reader, batch_s: float) -> None:
        scratch = bytearray()  # reused for every body on this stream (warm pages)
        while True:
            head = await read_head(reader, **self.head_limits())
            if head is None:
                return
            header, body_len = head
            spec = self.spec_for(header, body_len)
            # Backpressure: do not read the body until the compute side has room for this
            # peer's frame; meanwhile its window fills and its writes wait.
            peer_slots = self._slots_of(peer)
            await peer_slots.acquire_async()
            try:
                tensor, scratch = await self._receive_body(
                    peer, reader, body_len, spec, scratch, batch_s
                )
                received = Received(peer, header, tensor)
                if self.delivered(received):
                    self._counters.received(peer, body_len)
                    peer_slots.release()
                    continue
                await self._inbox_slots.acquire_async()  # only whole frames hold a shared slot
            except BaseException:
                peer_slots.release()
                raise
            self._counters.received(peer, body_len)
            release = _releaser(peer_slots, self._inbox_slots)
            self._inbox.put((received, release))

    def queue_from_thread(self, received: Received, body_len: int) -> None:
        """From a lane's thread: into the inbox once the peer and the inbox have a slot free
        (counted as received then, as a stream's frame is); TransportClosedError if the
        transport stops first."""
        peer_slots = self._slots_of(received.peer)
        self._wait_for(peer_slots)
        try:
            self._wait_for(self._inbox_slots)
        except BaseException:
            peer_slots.release()
            raise
        self._counters.received(received.peer, body_len)
        self._inbox.put((received, _releaser(peer_slots, self._inbox_slots)))

    def _wait_for(self, slots: Slots) -> None:
        while not slots.acquire(timeout=_SLOT_WAIT_S):
            if self._stopping.is_set():
                raise TransportClosedError("the transport stopped while a frame waited")

    def delivered(self, received: Received) -> bool:
        """Whether the deliver hook took the frame (then it skips the inbox and its thread hops)."""
        if self._deliver is None:
            return False
        try:
            return self._deliver(received)
        except Exception:  # a broken hook drops this frame, never the peer's stream
            logger.warning("deliver failed on a frame from %s", received.peer, exc_info=True)
            return True

    def head_limits(self) -> dict[str, float]:
        """What bounds reading a frame's head, on a stream and on a lane alike."""
        config = self.config
        return {
            "max_body_bytes": config.max_body_bytes,
            "stall_timeout_s": config.read_timeout_s,
            "idle_timeout_s": config.idle_timeout_s,
        }

    def spec_for(self, header: FrameHeader, body_len: int) -> TensorSpec | None:
        """What the frame must hold; FrameError if its length already says it does not."""
        if header.kind is FrameKind.FILLER:  # a lane's probe bytes: never a stream's
            raise FrameError("a filler frame on a stream (only lanes carry them)")
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
        self.reserve(peer, body_len)
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
            scratch = keep_warm(body, scratch)
            # decode_frame copies each payload once into the new tensor and keeps no view of
            # the body, so the scratch buffer is free for the next frame once it returns.
            tensor = await self._decode(body, spec)
        finally:
            self._budget.release(peer, body_len)
        if spec is not None:
            spec.check(tensor)
        return tensor, scratch

    def reserve(self, peer: str, body_len: int) -> None:
        """Reserve a body's bytes in the budgets; FrameError (counted) if it is over them."""
        if not self._budget.reserve(peer, body_len):
            self._refusals.add(OVER_BUDGET)  # the peer's FrameError is logged by its reader
            raise FrameError(
                f"a body of {body_len} bytes is over the budget (peer holds "
                f"{self._budget.held_by(peer)}, all peers {self._budget.used})"
            )

    async def _decode(self, body: bytearray | memoryview, spec: TensorSpec | None) -> torch.Tensor:
        threshold, pin = self.config.decode_in_thread_bytes, self.config.pin_decoded
        if len(body) >= threshold:
            # A large body may take the slow parse (msgpack copies its payloads): all of it
            # in a worker thread, so the loop keeps serving other streams meanwhile.
            return await trio.to_thread.run_sync(
                lambda: decode_frame(self.parse(body, spec), pin_memory=pin),
                abandon_on_cancel=True,
                limiter=self._decoders,
            )
        parsed = self.parse(body, spec)
        if parsed.decoded_bytes < threshold:
            return decode_frame(parsed, pin_memory=pin)
        # A small body that expands to a large tensor: allocated and filled off the loop.
        return await trio.to_thread.run_sync(
            lambda: decode_frame(parsed, pin_memory=pin),
            abandon_on_cancel=True,
            limiter=self._decoders,
        )

    def parse(self, body: bytearray | memoryview, spec: TensorSpec | None) -> ParsedFrame:
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


def _releaser(*semaphores: Slots) -> Callable[[], None]:
    done = False

    def release() -> None:
        nonlocal done
        if not done:
            done = True
            for semaphore in semaphores:
                semaphore.release()

    return release
