"""Received pipeline frames, kept until the stage asks for them; checked before they are kept.

The transport's thread files each frame as soon as it is decoded (``Transport.deliver_to``),
under (kind, step, micro-batch, sender rank): the compute thread must not be the one reading
(a yamux writer waits only a few seconds for window space), and a receive thread in between
would cost two more thread wake-ups per frame. ``pump`` is left with frames received before
that and with the transport's end. The compute thread then ``take``s exactly
the frame its schedule needs next, in whatever order they arrived.

Every frame is checked against what the run allows from that sender: its role (an unknown
peer, or a header claiming another stage, is refused), the kind and tag, a step no further
than one ahead of ours, no duplicates. Shapes and dtypes are checked earlier, by the
transport's ``expect`` hook (``Expectations.spec``), before the tensor reaches us.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusionllm.common.logs import get_logger
from fusionllm.node.errors import (
    DeadlineError,
    PeerProtocolError,
    PipelineError,
    StepAbortedError,
    TransportClosedError,
)
from fusionllm.node.p2p.framing import FrameHeader
from fusionllm.node.p2p.transport import Received, Transport

logger = get_logger(__name__)

_POLL_S = 0.2

MailKey = tuple[str, int, int, int]  # (kind, step, micro-batch or tag, sender rank)

# Is this frame from this sender acceptable at all? Returns why not, or None.
Admission = Callable[[int, FrameHeader], str | None]


@dataclass(frozen=True, order=True)
class Role:
    """One process of the run: a stage and which of its replicas."""

    stage: int
    replica: int


class Mailbox:
    """Frames by key; ``take`` waits for one, the receive thread ``put``s them."""

    def __init__(self, *, ranks: dict[str, int], admit: Admission, max_frames: int) -> None:
        self._ranks = dict(ranks)  # peer id -> rank
        self._admit = admit
        self._max_frames = max_frames
        self._frames: dict[MailKey, torch.Tensor] = {}
        self._cond = threading.Condition()
        self._step = 0
        self._closed: BaseException | None = None
        self.refused = 0

    def advance(self, step: int) -> None:
        """The stage moved to ``step``: frames for earlier steps are refused from now on.

        Frames of earlier steps still here were never asked for (a peer sent more than the
        schedule needs); they are dropped so they cannot fill the mailbox.
        """
        with self._cond:
            self._step = step
            stale = [key for key in self._frames if key[1] < step]
            for key in stale:
                del self._frames[key]
            self.refused += len(stale)
        if stale:
            logger.debug("dropped %d frames nobody asked for: %s", len(stale), stale[:4])

    def put(self, item: Received) -> None:
        """File one received frame, or refuse it (logged, counted) if the sender broke the rules."""
        try:
            rank = self._ranks.get(item.peer)
            if rank is None:
                raise PeerProtocolError(f"frame from unknown peer {item.peer}")
            header = item.header
            problem = self._admit(rank, header)
            if problem is not None:
                raise PeerProtocolError(f"rank {rank}: {problem}")
            key = (header.kind.value, header.step, header.micro_batch, rank)
            with self._cond:
                if not self._step <= header.step <= self._step + 1:
                    raise PeerProtocolError(
                        f"rank {rank} sent step {header.step} while we are at {self._step}"
                    )
                if key in self._frames:
                    raise PeerProtocolError(f"rank {rank} sent {key} twice")
                if len(self._frames) >= self._max_frames:
                    raise PeerProtocolError(f"more than {self._max_frames} frames waiting")
                self._frames[key] = item.tensor
                self._cond.notify_all()
        except PeerProtocolError:
            self.refused += 1
            logger.debug("refused a frame from %s", item.peer, exc_info=True)

    def take(self, key: MailKey, *, timeout: float) -> torch.Tensor:
        """The frame filed under ``key``; PipelineError if it does not come within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._frames:
                if self._closed is not None:
                    raise StepAbortedError(
                        f"no more frames ({self._closed!r}) while waiting for {key}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PipelineError(f"frame {key} did not arrive within {timeout}s")
                self._cond.wait(min(left, _POLL_S))
            return self._frames.pop(key)

    def close(self, reason: BaseException) -> None:
        with self._cond:
            self._closed = reason
            self._cond.notify_all()

    def pending(self) -> list[MailKey]:
        with self._cond:
            return sorted(self._frames)


def pump(transport: Transport, mailbox: Mailbox, stop: threading.Event) -> None:
    """The receive thread: transport -> mailbox until ``stop`` or the transport closes."""
    while not stop.is_set():
        try:
            item = transport.recv(timeout=_POLL_S)
        except DeadlineError:
            continue
        except TransportClosedError as exc:
            mailbox.close(exc)
            return
        mailbox.put(item)
