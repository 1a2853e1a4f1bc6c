"""The node's one receive thread for tensor frames, and the queue a session's frames wait in.

A node's transport outlives every plan it serves: the ``Router`` reads it and files each frame,
board frames (READY, STATE, copies: board.py) on the ``Board``, everything else in the current
session's mailbox. A session's mailbox may not exist yet, or not know its first step yet, when
a peer's first frames arrive: those wait in the ``Inbox``'s bounded queue until it opens.
"""

import threading
from collections.abc import Callable

from fusionllm.node.errors import DeadlineError, TransportClosedError
from fusionllm.node.p2p.transport import Received
from fusionllm.node.training.board import Board, is_board_frame

_POLL_S = 0.2
_MAX_EARLY_FRAMES = 4096


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
        # A session's frames go from the transport's thread straight to its mailbox; board
        # frames (rare, and their handlers may send) still come through this thread.
        self._transport.deliver_to(self._deliver)
        self._thread.start()
        return self

    def route_to(self, inbox: Inbox | None) -> None:
        with self._lock:
            self._inbox = inbox

    def close(self) -> None:
        self._transport.deliver_to(None)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)

    def _deliver(self, item: Received) -> bool:
        """In the transport's thread: a session frame to its inbox; False leaves it to us."""
        if is_board_frame(item.header):
            return False
        with self._lock:
            inbox = self._inbox
        if inbox is None:
            return False  # counted by _run, in one place
        inbox.deliver(item)
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._transport.recv(timeout=_POLL_S)
            except DeadlineError:
                continue
            except TransportClosedError:
                return
            if is_board_frame(item.header):
                self._board.put(item)
            elif not self._deliver(item):
                self.unrouted += 1  # a frame for a plan we no longer (or do not yet) serve
