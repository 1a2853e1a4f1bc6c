"""A session's state leaving its members: periodic checkpoints and copies, hand-over on leave.

``checkpoint``: every ``checkpoint_every`` steps, and after the first step of a plan that
began mid-run, each member writes its stage (parameters, AdamW state, error-feedback
residuals, RNG, plan, node range; the data position is the step) and, when its stage has no
other replica, first sends a copy to the next stage's first replica (``checkpoint_custodian``),
which keeps it on disk. The copy is not waited for on the critical
path: its frames must only have left this node by the end of the step after (the wait, if
any, is the ``copy_sent`` event's); a failed one is logged.

``hand_over``: at a step boundary every member agreed on (a unanimous switch, or a member's
vote to leave), a stage whose holders all leave sends its live state to a staying member
(``parting_custodian``), and the keeper waits for it, so the next plan resumes at this step.
"""

import time

from fusionllm.common.logs import get_logger
from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.training.checkpoints import CheckpointError, DataCursor
from fusionllm.node.training.copies import delivered, send_copy, stage_state
from fusionllm.node.training.holdings import Holding, checkpoint_custodian, parting_custodian
from fusionllm.node.training.transfer import HAND_OVER

logger = get_logger(__name__)


class Parting:
    def __init__(self, session) -> None:
        self.session = session
        self._copies: list = []  # futures of the last checkpoint's copy
        self._copied_at = -1  # ... the step it was taken at

    def checkpoint(self, held, *, resumed: bool = False) -> None:
        """``resumed``: the first step of a plan that began mid-run, whose state may sit on one
        node only (a leaver's stage handed to a member that also holds the only copy of its
        last checkpoint; a CI run lost 239 steps when that member crashed 5 steps later)."""
        s = self.session
        every = s.hooks.checkpoint_every
        if held.next_step == self._copied_at + 1:
            self._copy_sent(self._copied_at)
        if not every or (held.next_step % every and not resumed):
            return
        started, begun = time.perf_counter(), time.time()
        role, assignment = held.assignment.role, held.assignment
        holding = Holding(held.next_step, *assignment.ranges[role.stage])
        stage = stage_state(held.worker, holding, assignment.digest, held.scale)
        stage.residuals = s.runner.residuals()
        dataset = s.runner.dataset
        position = dataset.sampler(assignment.config.batch).position(held.next_step)
        stage.data = DataCursor(position, dataset.digest)
        keeper = checkpoint_custodian(role.stage, assignment.peers)
        if keeper is not None:
            # The copy first: until it lands, a crash of this node costs the previous interval;
            # our own file only helps if this node comes back.
            self._copies = send_copy(s.transport, keeper, stage, s.board.names, s.timeout_s)
            self._copied_at = held.next_step
        try:
            s.vault.checkpoint(stage)
        except (OSError, CheckpointError) as exc:
            logger.error("checkpoint of step %d not written: %s", held.next_step, exc)
            return
        s.hooks.emit({"event": "checkpoint", "step": held.next_step, "keeper": keeper,
                      "range": [holding.start, holding.stop],
                      "seconds": time.perf_counter() - started, "t": begun})  # fmt: skip

    def _copy_sent(self, step: int) -> None:
        """One step after a checkpoint, its copy's frames must have left this node: a crash
        before they did would cost the interval before it too (more than one interval)."""
        if not self._copies:
            return
        started = time.perf_counter()
        ok = delivered(self._copies, self.session.timeout_s)
        self._copies = []
        self.session.hooks.emit({"event": "copy_sent", "step": step, "delivered": ok,
                                 "waited": time.perf_counter() - started})  # fmt: skip

    def hand_over(self, held, leaving: frozenset[str], preferred) -> None:
        """Every stage all of whose holders leave: its first replica sends, a stayer keeps."""
        s = self.session
        peers, ranges = held.assignment.peers, held.assignment.ranges
        for stage in range(len(ranges)):
            keeper = parting_custodian(stage, peers, leaving, preferred)
            if keeper is None:
                continue
            holding = Holding(held.next_step, *ranges[stage])
            source = peers[Role(stage, 0)]
            nbytes = s.board.state_bytes(s.hooks.params_of(*ranges[stage]))
            if source == s.me:
                wait = HAND_OVER.seconds(nbytes, s.hooks.send_bytes_per_s(keeper))
                state = stage_state(held.worker, holding, scale=held.scale)
                futures = send_copy(s.transport, keeper, state, s.board.names, wait)
                ok = delivered(futures, wait + 5.0)
                s.hooks.emit({"event": "handover", "to": keeper, "step": held.next_step,
                              "stage": stage, "delivered": ok})  # fmt: skip
            if keeper == s.me:
                wait = HAND_OVER.seconds(nbytes, s.hooks.link_bytes_per_s(source))
                self._await_copy(holding, source, wait + 5.0)

    def _await_copy(self, holding: Holding, source: str, wait_s: float) -> None:
        s = self.session
        deadline = time.monotonic() + wait_s
        while holding not in s.vault.custody.holdings():
            if time.monotonic() > deadline:
                logger.warning("%s's state for %s never came: the next plan may roll back",
                               source[:16], holding)  # fmt: skip
                return
            time.sleep(0.05)
        logger.info("keeping %s handed over by %s", holding, source[:16])
