"""One plan served by one node: build its stage, meet the other members, run steps.

The barrier: a member announces READY (with the state it holds) to every other member once
its stage and mailbox exist, and starts only when it has heard READY from all of them; so
no member sends a frame a peer could not file. The first step is the newest one any member
holds state for (every member computes the same from the same READY frames); a member that
holds less waits for the parameters it lacks (``moves.py``) before it starts.

The run ends at a step boundary for one of three reasons: the run's last step; a unanimous
vote for another plan in a step's summary (every member sees the same votes, so all stop after
the same step); or an error (a peer vanished), which is left to the next plan to heal.
"""

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.compression import pack_tensor
from fusionllm.dag import OpGraph
from fusionllm.node.errors import PipelineError
from fusionllm.node.p2p.framing import FrameHeader, FrameKind
from fusionllm.node.pipeline.data import TokenDataset
from fusionllm.node.pipeline.layout import PipelineLayout
from fusionllm.node.pipeline.runner import PipelineRunner, StepReport
from fusionllm.node.pipeline.stage import StageWorker
from fusionllm.node.training.assignment import Assignment, plan_vote
from fusionllm.node.training.board import TAG_READY, Board, Inbox, Router

logger = get_logger(__name__)

_READY_RESEND_S = 2.0


@dataclass
class Held:
    """The run's state a node keeps between plans: its stage's worker, valid up to a step."""

    assignment: Assignment
    layout: PipelineLayout
    worker: StageWorker
    next_step: int


class Outcome(Enum):
    FINISHED = "finished"  # the run's last step is done
    SWITCH = "switch"  # the members voted for another plan
    FAILED = "failed"  # a step failed (a peer vanished, a frame never came)
    STOPPED = "stopped"  # this node stops
    ABANDONED = "abandoned"  # the plan changed before every member was ready


@dataclass
class Ending:
    outcome: Outcome
    held: Held | None
    detail: str = ""


class PlanSession:
    def __init__(
        self,
        *,
        assignment: Assignment,
        graph: OpGraph,
        dataset: TokenDataset,
        transport,
        board: Board,
        router: Router,
        vote: Callable[[], float],
        timeout_s: float,
    ) -> None:
        if assignment.role is None:
            raise ValueError("a session needs a role in the plan")
        self.assignment = assignment
        self.role = assignment.role
        self.layout = PipelineLayout(graph, assignment.config.cuts or ())
        self.runner = PipelineRunner(
            config=assignment.config,
            layout=self.layout,
            role=self.role,
            dataset=dataset,
            transport=transport,
            peers=assignment.others(),
            timeout_s=timeout_s,
            vote=vote,
            own_pump=False,
        )
        self.transport = transport
        self.board = board
        self.router = router
        self.vote = plan_vote(assignment.digest)
        self.inbox = Inbox(self.runner.mailbox.put)
        router.route_to(self.inbox)

    def close(self) -> None:
        self.router.route_to(None)
        self.runner.close()

    # ----- the barrier ------------------------------------------------------------------------

    def meet(self, held: Held | None, *, current: Callable[[], bool], stop: threading.Event):
        """READY to all, wait for everyone's READY and the state we lack; the first step or None
        (the plan changed, or we stop, before the members met)."""
        own_next = held.next_step if held is not None else -1
        others = list(self.assignment.others().values())
        ready: dict = {}
        next_send = 0.0
        while len(ready) < len(others):
            if stop.is_set() or not current():
                return None
            if time.monotonic() >= next_send:
                self._announce(others, own_next)
                next_send = time.monotonic() + _READY_RESEND_S
            self.board.wait(
                lambda: len(self.board.ready_of(others, self.vote)) == len(others), timeout=0.5
            )
            ready = self.board.ready_of(others, self.vote)
        start = max([own_next, *(r.next_step for r in ready.values())])
        if start < 0:
            start = 0  # nobody holds state: the run starts here, from the seeded weights
        elif not self._take_state(held, start, current=current, stop=stop):
            return None
        self.board.forget(self.vote)
        self.runner.mailbox.advance(start)
        self.inbox.open()
        return start

    def _announce(self, others: list[str], own_next: int) -> None:
        body = pack_tensor(torch.tensor([self.vote, float(own_next)], dtype=torch.float64))
        header = FrameHeader(
            step=0, micro_batch=TAG_READY, kind=FrameKind.CONTROL, stage=self.role.stage
        )
        for peer in others:
            try:
                self.transport.send_async(peer, header, body, timeout=5.0)
            except FusionError as exc:
                logger.debug("READY to %s not sent (will resend): %s", peer[:16], exc)

    def _take_state(self, held: Held | None, start: int, *, current, stop) -> bool:
        worker = self.runner.worker
        mine = set(worker.parameters)
        kept = set()
        if held is not None and held.next_step == start:
            kept = mine & set(held.worker.parameters)
            for name in sorted(kept):
                worker.import_state(name, held.worker.export_state(name))
        lacking = sorted(mine - kept)
        if lacking:
            logger.info("waiting for %d parameters of step %d from peers", len(lacking), start)
        while lacking:
            state = self.board.take_state(start, lacking)
            if state is not None:
                for name, flat in state.items():
                    worker.import_state(name, flat)
                break
            if stop.is_set() or not current():
                return False
            self.board.wait(lambda: not self.board.missing_state(start, lacking), timeout=0.5)
        return True

    # ----- steps ------------------------------------------------------------------------------

    def run(
        self,
        start: int,
        *,
        last_step: int,  # 0: no end
        stop: threading.Event,
        on_step: Callable[[StepReport], None],
    ) -> Ending:
        for step in itertools.count(start):
            if last_step and step >= last_step:
                return Ending(Outcome.FINISHED, self._held(step))
            if stop.is_set():
                return Ending(Outcome.STOPPED, self._held(step))
            try:
                report = self.runner.run_step(step)
            except (PipelineError, FusionError) as exc:
                self.runner.worker.drop(step)
                self.runner.worker.optimizer.zero_grad(set_to_none=True)
                done = self.runner.completed_steps
                logger.warning(
                    "step %d of plan %s failed: %s", step, self.assignment.digest[:12], exc
                )
                return Ending(
                    Outcome.FAILED, self._held(done if done is not None else step), str(exc)
                )
            on_step(report)
            votes = set(report.votes)
            if len(votes) == 1 and 0.0 not in votes and votes != {self.vote}:
                return Ending(Outcome.SWITCH, self._held(step + 1))
        raise AssertionError("unreachable")

    def _held(self, next_step: int) -> Held:
        return Held(self.assignment, self.layout, self.runner.worker, next_step)
