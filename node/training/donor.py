"""A node's answers to requests for state (WANT): who gets one, and what it sends.

When a plan's members together hold less than the swarm reached, the plan's first member asks
the nodes outside the plan for copies (session.py). ``Donor`` answers such a request, off the
router's thread: only as answers.py allows (the plan's first member, once per plan, within a
byte budget), after giving our own view a moment to adopt the asker's plan, and one request
per peer at a time, so a flood queues nothing. The answer is every stage state we hold after
the asker's floor, newest first, then DONE.
"""

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor

from fusionllm.common.errors import ConfigError, FusionError
from fusionllm.common.logs import get_logger
from fusionllm.common.run_spec import RunSpec
from fusionllm.dag.planner import Plan
from fusionllm.node.training.answers import ANSWERED, Answers
from fusionllm.node.training.assignment import assign
from fusionllm.node.training.board import Board
from fusionllm.node.training.checkpoints import StageState
from fusionllm.node.training.copies import delivered, send_copy, send_done
from fusionllm.node.training.holdings import SEED_STEP, Holding
from fusionllm.node.training.transfer import MOVES

logger = get_logger(__name__)

_POLL_S = 0.2
# A donor mid-step gives its live stage once the step ends: a step rarely takes longer.
_LIVE_COPY_WAIT_S = 5.0
# How long a request for state waits for our view to adopt the asker's plan (it adopted it a
# moment earlier); the asker waits at least 5 s for answers (transfer.DONORS).
_VIEW_LAG_S = 3.0
_PLANS_REMEMBERED = 8


class Donor:
    def __init__(
        self,
        *,
        run: RunSpec,
        peer_id: str,
        view,  # trainer_config.SwarmView: adopted()
        vault,  # vault.Vault
        board: Board,
        transport,
        connect: Callable[[str], None],
        emit: Callable[[dict], None],
        keeper: Executor,  # one thread: disk and sends off the router
        stop: threading.Event,
    ) -> None:
        self.run, self.peer_id, self.view, self.vault = run, peer_id, view, vault
        self.board, self.transport, self.connect, self._emit = board, transport, connect, emit
        self._keeper, self._stop = keeper, stop
        self.answers = Answers(full_state_bytes=board.state_bytes(board.names))
        self._lock = threading.Lock()
        self._donated: set[tuple[str, Holding]] = set()
        self._members_of: dict[str, tuple[tuple[str, ...], bool]] = {}  # digest -> (who, us?)
        self._wanting: set[str] = set()  # peers whose request is being answered

    def on_want(self, peer: str, floor: int) -> None:
        """A request for state (the router's thread): queued unless one from ``peer`` is."""
        with self._lock:
            if peer in self._wanting:
                return
            self._wanting.add(peer)
        self._keeper.submit(self._answer, peer, floor)

    def _answer(self, peer: str, floor: int) -> None:
        deadline = time.monotonic() + _VIEW_LAG_S
        try:
            while (why := self._refusal(peer))[0] is not None:
                if why[0] == ANSWERED or time.monotonic() >= deadline or self._stop.is_set():
                    logger.info("refused a request for state from %s: %s", peer[:16], why[0])
                    return
                self._stop.wait(_POLL_S)
            sent = self.donate(peer, floor)
            # One per answer, with the plan it was for (``donated``: one per copy sent).
            self._emit({"event": "answered", "to": peer, "plan": why[1], "floor": floor,
                        "sent": sent, "t": time.time()})  # fmt: skip
        finally:
            with self._lock:
                self._wanting.discard(peer)

    def _refusal(self, peer: str) -> tuple[str | None, str | None]:
        """(why a WANT from ``peer`` goes unanswered, or None; the digest of the plan we
        follow, or None)."""
        current = self.view.adopted()
        members, serving = self._plan_members(current) if current else ((), False)
        digest = current[0] if current else None
        why = self.answers.refusal(peer, digest=digest, members=members, serving=serving)
        return why, digest

    def _plan_members(self, current: tuple[str, Plan]) -> tuple[tuple[str, ...], bool]:
        """(the plan's members in order, whether it seats us), memoized: WANTs may flood in."""
        digest = current[0]
        if digest not in self._members_of:
            try:
                plan_of = assign(self.run, current[1], digest, self.peer_id)
                found = (plan_of.members, plan_of.role is not None)
            except ConfigError:
                found = ((), False)
            while len(self._members_of) >= _PLANS_REMEMBERED:
                del self._members_of[next(iter(self._members_of))]
            self._members_of[digest] = found
        return self._members_of[digest]

    def donate(self, peer: str, floor: int) -> int:
        """A plan's member lacks state the swarm reached: send it everything we hold after
        ``floor`` (once each; the newest may be a partial stage, an older step whole), within
        its budget, then DONE, so it stops waiting for us. The copies delivered."""
        self.connect(peer)
        sent = 0
        for stage in self._donations(floor):
            holding = stage.holding
            if (peer, holding) in self._donated:
                continue
            nbytes = sum(t.nbytes for t in stage.state.values())
            if not self.answers.spend(peer, nbytes):
                logger.info("%s used up its state budget: no more copies", peer[:16])
                break
            self._donated.add((peer, holding))
            wait = MOVES.seconds(nbytes, self.view.send_bytes_per_s(peer))
            copy = send_copy(self.transport, peer, stage, self.board.names, wait)
            ok = delivered(copy, wait + 5.0)
            sent += ok
            self._emit({"event": "donated", "to": peer, "step": holding.step,
                        "range": [holding.start, holding.stop], "delivered": ok})  # fmt: skip
        send_done(self.transport, peer, floor, sent)
        return sent

    def _donations(self, floor: int) -> Iterator[StageState]:
        """What we hold after ``floor``, newest first: the live stage as it is between steps
        (a copy taken mid-step would hold step k's update under step k's name), then files."""
        floor = max(floor, SEED_STEP)  # step 0: every member builds it itself
        live = self.vault.live_stage(timeout=_LIVE_COPY_WAIT_S)
        if live is not None and live.holding.step > floor:
            yield live
        stored = [h for h in self.vault.stored_holdings() if h.step > floor]
        for holding in sorted(stored, key=lambda h: -h.step):
            if live is not None and holding == live.holding:
                continue
            try:
                yield self.vault.stored_stage(holding)
            except (OSError, FusionError) as exc:
                logger.warning("cannot donate %s: %s", holding, exc)
