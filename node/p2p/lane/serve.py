"""A redeemed lane, served in a thread of its own: no event loop between its socket and a frame.

Through trio a frame cost ~7 scheduler rounds (a wake-up per chunk that arrived, cancel
scopes, checkpoints): ~0.4 ms of Python per frame in the transport thread, which on a busy
core is taken from compute. Here a blocking read waits for whole chunks (MSG_WAITALL).

The checks and limits are inbound.py's, in its order: the head within the stall deadline, the
spec's longest body, the byte budgets, the rate floor, dtype/shape/finiteness before the tensor
is allocated, then the spec's check of the tensor. A frame goes to the deliver hook from here;
one the hook does not take waits for the inbox's slots in the event loop (the slots are the
streams' too), after it is decoded: a lane holds at most that one decoded frame outside them.
"""

import threading
from typing import Protocol

import torch

from fusionllm.common.errors import FrameError
from fusionllm.compression import ParsedFrame, decode_frame
from fusionllm.node.p2p.blocking_framing import read_exactly_blocking, read_head_blocking
from fusionllm.node.p2p.framing import MAX_FILLER_BYTES, FrameHeader, FrameKind, keep_warm
from fusionllm.node.p2p.lane.stream import BlockingLaneReader
from fusionllm.node.p2p.limits import ByteBudget
from fusionllm.node.p2p.transport_types import PeerCounters, Received, TensorSpec, TransportConfig


class LaneInbox(Protocol):
    """What a lane's thread needs of the node's inbound side (``inbound.Inbound`` has it): a
    protocol, so that inbound.py can serve lanes with this class without an import circle."""

    config: TransportConfig
    thread_decoders: threading.Semaphore

    @property
    def budget(self) -> ByteBudget: ...

    @property
    def counters(self) -> PeerCounters: ...

    def head_limits(self) -> dict[str, float]: ...

    def spec_for(self, header: FrameHeader, body_len: int) -> TensorSpec | None: ...

    def reserve(self, peer: str, body_len: int) -> None: ...

    def parse(self, body: bytearray | memoryview, spec: TensorSpec | None) -> ParsedFrame: ...

    def delivered(self, received: Received) -> bool: ...

    def queue_from_thread(self, received: Received, body_len: int) -> None: ...


class LaneFrames:
    """Reads one lane's frames for ``inbound`` until the lane ends (call ``serve`` in a thread)."""

    def __init__(self, inbound: LaneInbox, peer: str, reader: BlockingLaneReader) -> None:
        self.inbound = inbound
        self.peer = peer
        self.reader = reader

    def serve(self) -> None:
        """Until a clean end (the sender closed, or idle); raises what else ended the lane."""
        inbound = self.inbound
        scratch = bytearray()  # reused for every body on this lane (warm pages)
        while True:
            head = read_head_blocking(self.reader, **inbound.head_limits())
            if head is None:
                return
            header, body_len = head
            if header.kind is FrameKind.FILLER:
                scratch = self._drop_filler(body_len, scratch)
                continue
            spec = inbound.spec_for(header, body_len)
            tensor, scratch = self._receive_body(body_len, spec, scratch)
            received = Received(self.peer, header, tensor)
            if inbound.delivered(received):
                inbound.counters.received(self.peer, body_len)
            else:
                inbound.queue_from_thread(received, body_len)

    def _drop_filler(self, body_len: int, scratch: bytearray) -> bytearray:
        """Read a bulk probe's frame (lane/bulk.py) and throw it away, within the same budget
        and rate floor as a tensor's body; FrameError past MAX_FILLER_BYTES."""
        if body_len > MAX_FILLER_BYTES:
            raise FrameError(f"a filler frame of {body_len} bytes, over {MAX_FILLER_BYTES}")
        self.inbound.reserve(self.peer, body_len)
        try:
            body = self._read(body_len, scratch, "filler")
        finally:
            self.inbound.budget.release(self.peer, body_len)
        self.inbound.counters.received(self.peer, body_len)
        return keep_warm(body, scratch)

    def _read(self, body_len: int, scratch: bytearray, what: str) -> bytearray | memoryview:
        config = self.inbound.config
        return read_exactly_blocking(
            self.reader,
            body_len,
            stall_timeout_s=config.read_timeout_s,
            what=what,
            into=scratch,
            floor=config.rate_floor(),
        )

    def _receive_body(
        self, body_len: int, spec: TensorSpec | None, scratch: bytearray
    ) -> tuple[torch.Tensor, bytearray]:
        inbound = self.inbound
        inbound.reserve(self.peer, body_len)
        try:
            body = self._read(body_len, scratch, "body")
            scratch = keep_warm(body, scratch)
            parsed = inbound.parse(body, spec)
            large = parsed.decoded_bytes >= inbound.config.decode_in_thread_bytes
            if large:  # as many large tensors at once as the event loop allows itself
                inbound.thread_decoders.acquire()
            try:
                tensor = decode_frame(parsed, pin_memory=inbound.config.pin_decoded)
            finally:
                if large:
                    inbound.thread_decoders.release()
        finally:
            inbound.budget.release(self.peer, body_len)
        if spec is not None:
            spec.check(tensor)
        return tensor, scratch
