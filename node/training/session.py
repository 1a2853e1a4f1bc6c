"""One plan served by one node: build its stage, meet the other members, run steps.

The barrier: a member announces READY with what it holds (``holdings.Holding``: its live
stage, its checkpoints, copies it keeps for others) to every other member once its stage and
mailbox exist, and starts only when it has heard READY from all of them; so no member sends a
frame a peer could not file. Every member then computes the same start (``choose_start``: the
newest step whose state the members hold in full) and the same moves; each sends what it must,
loads what it holds itself and waits for the rest.

The run ends at a step boundary, the same one on every member, for one of four reasons: the
run's last step; a unanimous vote for another plan in a step's summary; a member's vote to
leave (SIGTERM); or an error (a peer vanished), which is left to the next plan to heal. Before
members leave the plan (a switch that drops them, or a polite leave), a stage whose holders all
go hands a copy of its state to a member that stays, so the next plan starts where this ended.
Every ``checkpoint_every`` steps each member writes its stage and, unless the stage has another
replica, gives a copy to the next stage's first replica."""

import itertools
import secrets
import threading
import time
from collections.abc import Callable

import torch

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.compression import pack_tensor
from fusionllm.dag import OpGraph
from fusionllm.node.errors import FrameTimeoutError, PipelineError
from fusionllm.node.p2p.framing import FrameHeader, FrameKind
from fusionllm.node.pipeline.compute import Compute
from fusionllm.node.pipeline.data import TokenDataset
from fusionllm.node.pipeline.layout import PipelineLayout
from fusionllm.node.pipeline.runner import PipelineRunner, StepReport
from fusionllm.node.training.assignment import Assignment, plan_vote
from fusionllm.node.training.blame import blame_stall
from fusionllm.node.training.board import (
    NONCE_LIMIT,
    READY_ANSWER,
    TAG_ABORT,
    TAG_READY,
    TAG_WANT,
    Abort,
    Board,
    Ready,
    encode_abort,
    encode_ready,
    with_echo,
)
from fusionllm.node.training.copies import delivered, send_state
from fusionllm.node.training.holdings import (
    SEED_STEP,
    Holding,
    choose_start,
)
from fusionllm.node.training.latecomers import Latecomers
from fusionllm.node.training.parting import Parting
from fusionllm.node.training.resume import restore_residuals, restore_scale
from fusionllm.node.training.router import Inbox, Router
from fusionllm.node.training.session_terms import Ending, Held, Outcome, SessionHooks
from fusionllm.node.training.transfer import DONORS, MOVES

logger = get_logger(__name__)

_READY_RESEND_S = 2.0
MAX_ROUNDS = 2
_WATCH_S = 0.5
# A plan whose first step is still blocked this long after the swarm adopted another one was
# skipped by a member that started late (it went straight to the newer plan): no vote at a
# step boundary can end it, so the step is abandoned. Members that did start it abandon it too.
_SUPERSEDED_S = 5.0
LEAVE_VOTE = -1.0  # a summary vote: this member leaves after this step


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
        hooks: SessionHooks,
        timeout_s: float,
        compute: Compute | None = None,
    ) -> None:
        if assignment.role is None:
            raise ValueError("a session needs a role in the plan")
        self.assignment = assignment
        self.role = assignment.role
        self.me = assignment.peers[self.role]
        self.layout = PipelineLayout(graph, assignment.config.cuts or ())
        self.runner = PipelineRunner(
            config=assignment.config,
            layout=self.layout,
            role=self.role,
            dataset=dataset,
            transport=transport,
            peers=assignment.others(),
            timeout_s=timeout_s,
            vote=hooks.vote,
            own_pump=False,
            compute=compute,
            deferred=True,  # _gather makes the stage real: initialised, or loaded only
            fault_under_report=hooks.fault_under_report,
        )
        self.transport = transport
        self.board = board
        self.router = router
        self.hooks = hooks
        self.vault = hooks.vault
        self.timeout_s = timeout_s
        self.vote = plan_vote(assignment.digest)
        self.inbox = Inbox(self.runner.mailbox.put)
        self.parting = Parting(self)
        self.moved = (0, 0)  # parameters (sent, received) as the plan started
        self._announced: dict[int, torch.Tensor] = {}  # round -> our READY body in it
        self._answered: dict[str, float] = {}  # peer -> when we last answered its READY
        # This meeting's name: READYs count, and ABORTs stop us, only if they echo it.
        self.nonce = 1 + secrets.randbelow(NONCE_LIMIT - 1)
        self._met: dict[str, int] = {}  # member -> its meeting's nonce, once we met
        self._echoed: dict[tuple[str, int], int] = {}  # (peer, round) -> our last READY's echo
        self._told = False  # a member told us it abandoned a step: no need to tell it back
        self.fault_abandoned = False  # the test hook abandoned a step of this plan
        router.route_to(self.inbox)

    def close(self) -> None:
        self.router.route_to(None)
        self.board.forget(self.vote)
        self.runner.close()

    # ----- the barrier ------------------------------------------------------------------------

    def meet(self, *, current: Callable[[], bool], stop: threading.Event) -> int | None:
        """READY to all, wait for everyone's, gather the start's state: the first step, or None
        (the plan changed, or we stop, before the members met).

        If the members together hold less than the swarm reached (their records' hint), the
        plan's first member asks the nodes outside the plan for copies of what they hold, and
        all meet once more with what they then hold (holdings never change within a round:
        every member must decide on the same announcements)."""
        others = list(self.assignment.others().values())
        for round_ in range(MAX_ROUNDS):
            mine = self.vault.holdings()
            scales = [self.vault.scale_of(h) for h in mine]
            hint = self.hooks.progress()
            body = encode_ready(
                self.vote, mine, round=round_, hint=hint, scales=scales, nonce=self.nonce
            )
            ready = self._hear(others, body, round_, current=current, stop=stop)
            if ready is None:
                return None
            self._met = {peer: r.nonce for peer, r in ready.items()}
            start = self._decide(ready, mine)
            reached = max([hint, *(r.hint for r in ready.values())])
            if start.step >= reached or round_ == MAX_ROUNDS - 1:
                break
            logger.info("the members hold step %d, the swarm reached %d: asking the others",
                        start.step, reached)  # fmt: skip
            if self.me == self.assignment.members[0]:
                self._ask_donors(reached, start.step, current=current, stop=stop)
        self.board.forget(self.vote)
        self.vault.discard_after(start.step)
        if not self._gather(start, stop=stop, current=current):
            return None
        members, held = self.assignment.members, tuple(zip(mine, scales, strict=True))
        restore_scale(
            self.runner, step=start.step, members=members, ready=ready, me=self.me, mine=held
        )
        restore_residuals(
            self.runner, vault=self.vault, assignment=self.assignment, me=self.me, start=start
        )
        self.runner.mailbox.advance(start.step)
        self.inbox.open()
        return start.step

    def _hear(self, others, body, round_: int, *, current, stop) -> dict | None:
        ready: dict = {}
        next_send = 0.0
        late = Latecomers(others, wait_s=self.barrier_wait_s,
                          suspect=lambda peer, why: self.hooks.suspect(peer, why))  # fmt: skip
        while len(ready) < len(others):
            if stop.is_set() or not current():
                return None
            if time.monotonic() >= next_send:
                body = self._announced.setdefault(round_, body)  # what answer() resends
                for peer in others:  # each echoes the nonce we last heard from its receiver
                    self._send_ready(peer, body, round_, self.board.heard(peer, self.vote))
                next_send = time.monotonic() + _READY_RESEND_S
            self.board.wait(lambda: len(self._ready_in(others, round_)) == len(others), timeout=0.5)
            ready = self._ready_in(others, round_)
            late.check(ready)
        for peer in ready:
            self.hooks.cleared(peer)
        return ready

    def _ready_in(self, others: list[str], round_: int) -> dict[str, Ready]:
        return self.board.ready_of(others, self.vote, round_, echo=self.nonce)

    def answer(self, peer: str, ready: Ready) -> None:
        """A member's READY, heard in the router's thread. It resends READY until it has heard
        every member, and so do we; but a READY of ours it refused (it adopted the plan after
        our resend reached it) is never resent once its own READY completed our round: answer
        each of its READYs of a round we announced, at most once per resend interval."""
        body = self._answerable(peer, ready)
        if body is None:
            return
        now = time.monotonic()
        if now - self._answered.get(peer, -_READY_RESEND_S) < _READY_RESEND_S / 2:
            return
        self._answered[peer] = now
        self._send_ready(peer, body, ready.round, ready.nonce, step=READY_ANSWER)

    def answered(self, peer: str, ready: Ready) -> None:
        """A member's answer to our READY, heard in the router's thread. If our READY it saw
        did not echo its meeting (its own READY reached us only as this answer: we refused
        the first, adopting the plan late), answer once so that it counts us too; never
        twice for one nonce, so two members' answers cannot bounce for ever."""
        body = self._answerable(peer, ready)
        if (
            body is None
            or ready.echo != self.nonce
            or self._echoed.get((peer, ready.round)) == ready.nonce
        ):
            return
        self._send_ready(peer, body, ready.round, ready.nonce, step=READY_ANSWER)

    def _answerable(self, peer: str, ready: Ready) -> torch.Tensor | None:
        """Our READY body for a member's READY in a round we announced, or None. None too for
        a member we met at another of its meetings: it left ours (it serves the plan again
        after a step failed), and our body names what we held at ours, not what we hold now."""
        if ready.vote != self.vote or peer not in self.assignment.members:
            return None
        if self._met.get(peer, ready.nonce) != ready.nonce:
            return None
        return self._announced.get(ready.round)

    def _send_ready(self, peer: str, body, round_: int, echo: int, step: int = 0) -> None:
        self._echoed[(peer, round_)] = echo
        self._announce([peer], with_echo(body, echo=echo), step=step)

    def aborted(self, peer: str, abort: Abort) -> None:
        """A member's ABORT, heard in the router's thread: if it names this meeting, the step
        it abandoned cannot complete, so ours fails now instead of at the step timeout."""
        if abort.vote != self.vote or abort.echo != self.nonce or peer == self.me:
            return
        if peer not in self.assignment.members:
            return
        logger.info("member %s abandoned step %d: abandoning ours", peer[:16], abort.step)
        self._told = True
        self.runner.abort(PipelineError(f"member {peer} abandoned step {abort.step}"))

    def _tell_abandoned(self, step: int) -> None:
        """ABORT to every member we met, each naming its own meeting, so none waits for us."""
        for peer, nonce in self._met.items():
            self._announce([peer], encode_abort(self.vote, nonce, step), TAG_ABORT, step=step)

    def barrier_wait_s(self, peer: str) -> float:
        """How long the READY barrier waits for ``peer`` before suspecting it: the grace, plus
        its stage's state (parameters and AdamW moments) at the link's measured bandwidth (it
        may still be receiving a copy of that state as the plan starts)."""
        role = next(r for r, p in self.assignment.peers.items() if p == peer)
        names = self.hooks.params_of(*self.assignment.ranges[role.stage])
        return self.hooks.barrier_grace_s + self.board.state_bytes(names) / max(
            self.hooks.link_bytes_per_s(peer), 1.0
        )

    def _decide(self, ready: dict, mine: list[Holding]):
        holdings = {peer: r.holdings for peer, r in ready.items()}
        holdings[self.me] = tuple(mine)
        ranges, params_of = self.assignment.ranges, self.hooks.params_of
        needs = {p: params_of(*ranges[r.stage]) for r, p in self.assignment.peers.items()}
        return choose_start(self.assignment.members, holdings, needs, params_of)

    def _ask_donors(self, reached: int, floor: int, *, current, stop) -> None:
        """WANT to every node outside the plan; wait until each answered DONE (its copies newer
        than ``floor`` are filed), we hold the whole model at a step >= ``reached``, or
        the whole model's state at the slowest donor's link (transfer.DONORS: a donor may be
        gone)."""
        donors = [p for p in self.hooks.donors() if p not in self.assignment.members]
        self.board.reset_done(donors)
        want = torch.tensor([float(reached), float(floor)], dtype=torch.float64)  # (2,)
        self._announce(donors, want, TAG_WANT)
        everything = self.hooks.params_of(0, self.assignment.ranges[-1][1])

        def enough() -> bool:
            if stop.is_set() or not current():
                return True
            if len(self.board.done_of(donors, floor)) == len(donors):
                return True
            held = self.vault.holdings()
            for step in {h.step for h in held if h.step >= reached}:
                at = [self.hooks.params_of(h.start, h.stop) for h in held if h.step == step]
                if everything <= frozenset().union(*at):
                    return True
            return False

        slowest = min((self.hooks.link_bytes_per_s(p) for p in donors), default=0.0)
        wait = DONORS.seconds(self.board.state_bytes(everything), slowest)
        if not self.board.wait(enough, timeout=wait):
            answered = len(self.board.done_of(donors, floor))
            logger.info("%d of %d nodes outside the plan answered in time", answered, len(donors))

    def _announce(self, peers: list[str], body, tag: int = TAG_READY, step: int = 0) -> None:
        packed = pack_tensor(body)
        header = FrameHeader(
            step=step, micro_batch=tag, kind=FrameKind.CONTROL, stage=self.role.stage
        )
        for peer in peers:
            if tag == TAG_WANT:  # to nodes outside the plan; members are dialled already
                self.hooks.connect(peer)
            try:
                self.transport.send_async(peer, header, packed, timeout=5.0)
            except FusionError as exc:
                logger.debug("frame %d to %s not sent: %s", tag, peer[:16], exc)

    def _gather(self, start, *, stop, current) -> bool:
        """Send our moves, load what we hold, wait for the rest; False if the plan changed."""
        step, names = start.step, self.board.names
        index = {name: i for i, name in enumerate(names)}
        futures, waits = [], [MOVES.floor_s]
        for dst in sorted({m.dst for m in start.moves if m.src == self.me}):
            moved = [m.name for m in start.moves if m.src == self.me and m.dst == dst]
            wait = MOVES.seconds(self.board.state_bytes(moved), self.hooks.send_bytes_per_s(dst))
            waits.append(wait)
            for name in moved:
                flat = self.vault.export(self._source(start, name), name)
                futures.append(send_state(self.transport, dst, step, index[name], flat, wait))
        worker = self.runner.worker
        # Past the seed step every parameter's state is imported below: no init to overwrite.
        worker.make_real(initialise=step == SEED_STEP)
        incoming = sorted(m.name for m in start.moves if m.dst == self.me)
        for name in sorted(set(worker.parameters) - set(incoming)):
            if step > 0:
                worker.import_state(name, self.vault.export(self._source(start, name), name))
        self.moved = (len(futures), len(incoming))
        if incoming:
            logger.info("start at step %d: waiting for %d parameters", step, len(incoming))
        while incoming:
            state = self.board.take_state(step, incoming)
            if state is not None:
                for name, flat in state.items():
                    worker.import_state(name, flat)
                break
            if stop.is_set() or not current():
                return False
            self.board.wait(lambda: not self.board.missing_state(step, incoming), timeout=0.5)
        delivered(futures, max(waits) + 5.0)
        return True

    def _source(self, start, name: str) -> Holding:
        for holding in start.local[self.me]:
            if name in self.hooks.params_of(holding.start, holding.stop):
                return holding
        raise PipelineError(f"no own holding of {name!r} at step {start.step}")

    # ----- steps ------------------------------------------------------------------------------

    def run(
        self,
        start: int,
        *,
        last_step: int,  # 0: no end
        stop: threading.Event,
        on_step: Callable[[StepReport], None],
    ) -> Ending:
        self.vault.set_live(self._held(start))
        done = threading.Event()
        watcher = threading.Thread(target=self._watch_members, args=(done,), daemon=True)
        watcher.start()
        try:
            return self._steps(start, last_step=last_step, stop=stop, on_step=on_step)
        finally:
            done.set()
            watcher.join(2.0)

    def _steps(self, start, *, last_step, stop, on_step) -> Ending:
        for step in itertools.count(start):
            if last_step and step >= last_step:
                return Ending(Outcome.FINISHED, self._held(step))
            if step - start == self.hooks.fault_stall_after > 0:
                self._stall(step, stop)
            if step - start == self.hooks.fault_abandon_after > 0:
                logger.warning("fault injection: abandoning step %d", step)
                self.hooks.emit({"event": "fault_abandon", "step": step, "t": time.time()})
                self.fault_abandoned = True
                self.runner.abort(PipelineError("fault injection: step abandoned"))
            if stop.is_set():
                return Ending(Outcome.STOPPED, self._held(step))
            self.vault.begin_step()  # the live stage changes in place until set_live
            try:
                report = self.runner.run_step(step)
            except FrameTimeoutError as exc:
                self._blame(exc)
                # No ABORT: the members on the wait chain time out on their own, and an ABORT
                # would cut short their collection of stall notes, leaving the stalled unblamed.
                return self._failed(step, exc, tell=False)
            except (PipelineError, FusionError) as exc:
                return self._failed(step, exc)
            on_step(report)
            held = self._held(step + 1)
            self.vault.set_live(held)
            self.parting.checkpoint(held, resumed=step == start > 0)
            ending = self._after_votes(report.votes, held)
            if ending is not None:
                return ending
        raise AssertionError("unreachable")

    def _after_votes(self, votes: tuple[float, ...], held: Held) -> Ending | None:
        roles = self.runner.roles
        leavers = frozenset(
            self.assignment.peers[roles[i]] for i, v in enumerate(votes) if v == LEAVE_VOTE
        )
        if leavers:
            self.parting.hand_over(held, leavers, preferred=())
            return Ending(Outcome.PARTED, held, leavers=leavers)
        unanimous = set(votes)
        if len(unanimous) == 1 and 0.0 not in unanimous and unanimous != {self.vote}:
            new = self.hooks.next_plan(votes[0])
            if new is not None:
                staying = frozenset(new.members)
                leaving = frozenset(self.assignment.members) - staying
                self.parting.hand_over(held, leaving, preferred=new.members)
            return Ending(Outcome.SWITCH, held)
        return None

    def _blame(self, timeout: FrameTimeoutError) -> None:
        """Suspect the member at the end of the wait chain (blame.py), if there is one."""
        culprit = blame_stall(self.runner, timeout)
        waited = self.runner.peer_of[self.runner.roles[timeout.rank]]
        blamed = None if culprit is None else self.runner.peer_of.get(self.runner.roles[culprit])
        lost = {"refused": self.runner.mailbox.refused, "early_dropped": self.inbox.dropped,
                "unrouted": self.router.unrouted}  # frames we threw away (0: not ours)  # fmt: skip
        self.hooks.emit({"event": "stall", "step": timeout.step, "waited_on": waited,
                         "blamed": blamed, **lost, "t": time.time()})  # fmt: skip
        whom = blamed[:16] if blamed else "nobody (the members wait on each other)"
        logger.warning("step %d stalled waiting on %s: blaming %s (%s)", timeout.step, waited[:16],
                       whom, lost)  # fmt: skip
        if blamed is not None:
            self.hooks.suspect(blamed, "stalled")

    def _stall(self, step: int, stop: threading.Event) -> None:
        """The test hook's fault: this member stops mid-run, its heartbeat still up."""
        logger.warning("fault injection: stalling before step %d", step)
        self.hooks.emit({"event": "fault_stall", "step": step, "t": time.time()})
        stop.wait()

    def _failed(self, step: int, exc: Exception, *, tell: bool = True) -> Ending:
        self.runner.worker.drop(step)
        self.runner.worker.optimizer.zero_grad(set_to_none=True)
        done = self.runner.completed_steps
        logger.warning("step %d of plan %s failed: %s", step, self.assignment.digest[:12], exc)
        if tell and not self._told:
            self._tell_abandoned(step)
        held = self._held(done if done is not None else step)
        self.vault.set_live(held)
        return Ending(Outcome.FAILED, held, str(exc))

    def _watch_members(self, done: threading.Event) -> None:
        """Fail a step blocked on a peer the control plane no longer counts as a member, or
        the first step of a plan the swarm replaced before every member started it."""
        # Only peers our control plane has seen: a newcomer may not know every member yet.
        watched = [p for p in self.assignment.others().values() if self.hooks.is_member(p)]
        superseded_at: float | None = None
        while not done.wait(_WATCH_S):
            gone = [p for p in watched if not self.hooks.is_member(p)]
            if gone:
                logger.info("member %s is gone: abandoning the step", gone[0][:16])
                self.runner.abort(PipelineError(f"member {gone[0]} left the swarm"))
                return
            stepped = self.runner.completed_steps is not None  # this plan applied a step here
            if stepped or self.hooks.followed() == self.assignment.digest:
                superseded_at = None
                continue
            superseded_at = superseded_at or time.monotonic()
            if time.monotonic() - superseded_at >= _SUPERSEDED_S:
                logger.info("the swarm follows another plan and this one never completed a "
                            "step: abandoning it")  # fmt: skip
                self.runner.abort(PipelineError("plan replaced before its first step"))
                return

    def _held(self, next_step: int) -> Held:
        return Held(
            self.assignment, self.layout, self.runner.worker, next_step, self.runner.scale_state()
        )
