"""Frames between plans: ready announcements and moved state, and the router that files them.

A node's transport outlives every plan it serves, so one receive thread (``Router``) reads
it and files each frame: READY and STATE frames on the ``Board`` (kept across plans, from
members only), everything else in the current session's mailbox. A session's mailbox may
not exist yet, or not know its first step yet, when a peer's first frames arrive: those wait
in a bounded queue until the session opens.

READY (control tag ``TAG_READY``): float64 ``[vote, next_step]``: the sender built its stage
of the plan with that vote and holds the run's state up to ``next_step`` (-1: none).
STATE (control tag ``TAG_STATE + i``, i the parameter's index in sorted canonical names):
one parameter and its AdamW state (``StageWorker.export_state``), for the step in the header.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fusionllm.common.logs import get_logger
from fusionllm.node.errors import DeadlineError, TransportClosedError
from fusionllm.node.p2p.framing import FrameHeader, FrameKind
from fusionllm.node.p2p.transport import Received, TensorSpec

logger = get_logger(__name__)

TAG_READY = 1 << 24
TAG_STATE = 1 << 25  # + parameter index
READY_LEN = 2
_NEVER = TensorSpec(dtype=torch.float32, shape=(-1,))  # matches nothing: the frame is refused
_POLL_S = 0.2
_MAX_EARLY_FRAMES = 4096


@dataclass(frozen=True)
class Ready:
    vote: float
    next_step: int  # -1: the sender holds no state of the run


def is_ready(header: FrameHeader) -> bool:
    return header.kind is FrameKind.CONTROL and header.micro_batch == TAG_READY


def state_index(header: FrameHeader) -> int | None:
    if header.kind is FrameKind.CONTROL and header.micro_batch >= TAG_STATE:
        return header.micro_batch - TAG_STATE
    return None


class Board:
    """READY and STATE frames from members, waited on by the trainer."""

    def __init__(self, *, shapes: dict[str, tuple[int, ...]], is_member: Callable[[str], bool]):
        self.names = sorted(shapes)
        self._numel = {n: int(torch.Size(shapes[n]).numel()) for n in self.names}
        self._is_member = is_member
        self._cond = threading.Condition()
        self._ready: dict[str, Ready] = {}
        self._state: dict[tuple[int, str], torch.Tensor] = {}  # (step, name) -> flat state
        self.refused = 0

    def expect(self, header: FrameHeader) -> TensorSpec | None:
        """dtype and shape of a READY/STATE frame; None if the header is neither."""
        if is_ready(header):
            return TensorSpec(torch.float64, (READY_LEN,))
        index = state_index(header)
        if index is None:
            return None
        if index >= len(self.names):
            return _NEVER
        return TensorSpec(torch.float32, (3 * self._numel[self.names[index]] + 1,))

    def put(self, item: Received) -> None:
        if not self._is_member(item.peer):
            self.refused += 1
            logger.debug("refused a %s frame from non-member %s", item.header, item.peer[:16])
            return
        with self._cond:
            if is_ready(item.header):
                vote, next_step = item.tensor.tolist()
                self._ready[item.peer] = Ready(vote, int(next_step))
            else:
                name = self.names[state_index(item.header)]  # type: ignore[index]
                self._state[(item.header.step, name)] = item.tensor
            self._cond.notify_all()

    def ready_of(self, peers: list[str], vote: float) -> dict[str, Ready]:
        with self._cond:
            return {p: r for p in peers if (r := self._ready.get(p)) and r.vote == vote}

    def wait(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Wait until ``condition()`` holds (re-checked on every filed frame) or ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not condition():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, _POLL_S))
            return True

    def take_state(self, step: int, names: list[str]) -> dict[str, torch.Tensor] | None:
        """Every named parameter's state for ``step`` (removed from the board), or None."""
        with self._cond:
            if any((step, n) not in self._state for n in names):
                return None
            return {n: self._state.pop((step, n)) for n in names}

    def missing_state(self, step: int, names: list[str]) -> list[str]:
        with self._cond:
            return [n for n in names if (step, n) not in self._state]

    def forget(self, vote: float) -> None:
        """A plan started: its READY frames are used up (a later plan with the same vote
        must hear its members again); state frames of older steps are dropped."""
        with self._cond:
            self._ready = {p: r for p, r in self._ready.items() if r.vote != vote}


class Inbox:
    """Where the router files one session's frames: early ones wait until it opens."""

    def __init__(self, put: Callable[[Received], None]) -> None:
        self._put = put
        self._lock = threading.Lock()
        self._early: list[Received] | None = []
        self.dropped = 0

    def deliver(self, item: Received) -> None:
        with self._lock:
            if self._early is not None:
                if len(self._early) < _MAX_EARLY_FRAMES:
                    self._early.append(item)
                else:
                    self.dropped += 1
                return
        self._put(item)

    def open(self) -> None:
        with self._lock:
            early, self._early = self._early or [], None
        for item in early:
            self._put(item)


class Router:
    """The node's one receive thread for tensor frames."""

    def __init__(self, transport, board: Board) -> None:
        self._transport = transport
        self._board = board
        self._inbox: Inbox | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.unrouted = 0
        self._thread = threading.Thread(target=self._run, name="node-router", daemon=True)

    def start(self) -> "Router":
        self._thread.start()
        return self

    def route_to(self, inbox: Inbox | None) -> None:
        with self._lock:
            self._inbox = inbox

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._transport.recv(timeout=_POLL_S)
            except DeadlineError:
                continue
            except TransportClosedError:
                return
            header = item.header
            if is_ready(header) or state_index(header) is not None:
                self._board.put(item)
                continue
            with self._lock:
                inbox = self._inbox
            if inbox is None:
                self.unrouted += 1  # a frame for a plan we no longer (or do not yet) serve
            else:
                inbox.deliver(item)
