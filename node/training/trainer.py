"""A node's training: follow the plan the swarm adopted, serve this node's stage of it.

No launcher hands out roles: each node reads the plan its own daemon adopted, computes its
part (``assign``), meets the other members (``PlanSession.meet``: all start from the newest
step whose state they hold, live or checkpointed) and trains until the run ends, the members
vote for another plan, a member leaves or fails. The daemon side is a narrow ``SwarmView``, so
this package never imports the control plane. ``stop()`` leaves politely: this node votes to
leave, finishes the step and hands its stage's state to a member that stays.
"""

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from fusionllm.common.errors import ConfigError, FusionError
from fusionllm.common.logs import get_logger
from fusionllm.dag import OpGraph
from fusionllm.dag.planner import Plan
from fusionllm.node.p2p.framing import FrameHeader
from fusionllm.node.p2p.transport import TensorSpec
from fusionllm.node.pipeline.compute import Compute
from fusionllm.node.pipeline.data import TokenDataset
from fusionllm.node.pipeline.runner import StepReport
from fusionllm.node.training.assignment import Assignment, assign, plan_vote
from fusionllm.node.training.board import Board, Copy
from fusionllm.node.training.checkpoints import CheckpointError
from fusionllm.node.training.donor import Donor
from fusionllm.node.training.idle_plan import IdlePlanWatch, idle_patience_s
from fusionllm.node.training.placement import CorePlacement
from fusionllm.node.training.router import Router
from fusionllm.node.training.session import LEAVE_VOTE, PlanSession
from fusionllm.node.training.session_terms import Ending, Held, Outcome, SessionHooks
from fusionllm.node.training.trainer_config import SwarmView, TrainerConfig
from fusionllm.node.training.trainer_events import plan_event, save_final_params, step_event
from fusionllm.node.training.vault import Vault

logger = get_logger(__name__)

FINAL_PARAMS = "final-params.pt"
_NEVER = TensorSpec(dtype=torch.float32, shape=(-1,))  # matches nothing: the frame is refused
_IDLE_POLL_S = 0.2
_PLANS_REMEMBERED = 8


class SwarmTrainer:
    def __init__(
        self,
        config: TrainerConfig,
        *,
        peer_id: str,
        transport,
        workload: Callable[[], tuple[OpGraph, TokenDataset]],  # built on first need, once
        shapes: dict[str, tuple[int, ...]],  # every canonical parameter of the model
        view: SwarmView,
        on_event: Callable[[dict], None],
    ) -> None:
        self.config = config
        self.run_spec = config.run
        self.peer_id = peer_id
        self.transport = transport
        self._workload = workload
        self._built: tuple[OpGraph, TokenDataset] | None = None
        self._build_lock = threading.Lock()
        self._ranges: dict[tuple[int, int], frozenset[str]] = {}
        self.view = view
        self._emit = on_event
        self._session: PlanSession | None = None
        self._abandoned = False  # the --fault-abandon-after hook fired (it fires once)
        self._role: int | None = None  # our replica in the plan we serve
        self._plans: dict[float, tuple[str, Plan]] = {}  # recent votes -> the plans they name
        own, custody = config.stores()
        self.vault = Vault(own=own, custody=custody, params_of=self.params_of)
        self._keeper = ThreadPoolExecutor(1, thread_name_prefix="node-keep")  # disk off the router
        self.board = self._new_board(shapes)
        self._last_members: frozenset[str] = frozenset()  # of the plan we served last
        self._came_late = False  # the --fault-late-barrier test hook was applied
        self._stop = threading.Event()  # hard stop: at the next step boundary, no hand-over
        self.donor = self._new_donor()
        self._placement = CorePlacement(enabled=config.pin_cores)
        self.router = Router(transport, self.board)
        self._leaving = threading.Event()  # polite: vote to leave, hand the state over
        self._leave_asked = 0.0  # time.monotonic() of stop()
        self.finished = threading.Event()
        self.failed = False  # training stopped on an unexpected error (a bug)
        self.step = 0  # steps the swarm completed, as far as this node knows
        self.loss: float | None = None
        self.evaluation: tuple[int, float] | None = None  # newest validation (step, loss)
        self._thread = threading.Thread(target=self._main, name="node-train", daemon=True)

    def _new_board(self, shapes: dict[str, tuple[int, ...]]) -> Board:
        # The board hears whom the transport admits: a peer of the plan we serve still counts
        # after it left the member list, or the state it handed over on its way out (frames
        # still queued when its record goes) would be refused while we wait for it.
        return Board(
            shapes=shapes,
            is_member=self.admits,
            on_copy=self._on_copy,
            on_want=lambda peer, reached, floor: self.donor.on_want(peer, floor),
            on_ready=self._on_ready,
            on_answer=self._on_answer,
            on_abort=self._on_abort,
            moves_from=self._meets,
            copies_from=self._keeps_for,
        )

    def _new_donor(self) -> Donor:
        return Donor(
            run=self.run_spec,
            peer_id=self.peer_id,
            view=self.view,
            vault=self.vault,
            board=self.board,
            transport=self.transport,
            connect=self.connect,
            emit=self._emit,
            keeper=self._keeper,
            stop=self._stop,
        )

    @property
    def graph(self) -> OpGraph:
        return self._build()[0]

    def _build(self) -> tuple[OpGraph, TokenDataset]:
        # A node in the backup pool never pays for the model, its trace or the corpus.
        with self._build_lock:
            if self._built is None:
                self._built = self._workload()
            return self._built

    def params_of(self, start: int, stop: int) -> frozenset[str]:
        """The canonical parameters graph nodes [start, stop) train (a fine-tune: adapters)."""
        key = (start, stop)
        if key not in self._ranges:
            graph = self.graph
            if not 0 <= start < stop <= len(graph.node_ids):
                raise CheckpointError(f"node range [{start}, {stop}) is outside the model")
            canonical = graph.canonical_parameter_names()
            module = graph.stage_module(graph.node_ids[start:stop])
            self._ranges[key] = frozenset(
                canonical[n] for n, p in module.named_parameters() if p.requires_grad
            )
        return self._ranges[key]

    def expect(self, header: FrameHeader) -> TensorSpec:
        """The transport's hook: what a frame must hold, by header, before it is kept."""
        spec = self.board.expect(header)
        if spec is not None:
            return spec
        session = self._session
        return session.runner.expectations.expect(header) if session is not None else _NEVER

    def admits(self, peer: str) -> bool:
        """The transport's and the board's admission: only the plan we serve and the swarm's
        members (ready announcements, state transfers) may send this node tensors."""
        session = self._session
        if session is not None and peer in session.runner.peer_of.values():
            return True
        return self.view.is_member(peer)

    def _on_ready(self, peer: str, ready) -> None:
        session = self._session
        if session is not None:
            session.answer(peer, ready)

    def _on_answer(self, peer: str, ready) -> None:
        session = self._session
        if session is not None:
            session.answered(peer, ready)

    def _on_abort(self, peer: str, abort) -> None:
        session = self._session
        if session is not None:
            session.aborted(peer, abort)

    def _meets(self, peer: str) -> bool:
        """Whether ``peer`` is a member of the plan we meet or serve (it may move state)."""
        session = self._session
        return session is not None and peer in session.assignment.members

    def _keeps_for(self, peer: str) -> bool:
        """Whether ``peer`` may give us copies to keep: a member of the plan we serve (its
        checkpoints, its hand-over) or of the one we served last (frames still on their way
        as it ended). Nodes we asked for state may too (the board knows them)."""
        return self._meets(peer) or peer in self._last_members

    def start(self) -> "SwarmTrainer":
        self.router.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Leave politely: finish the step, hand our stage over, then stop."""
        if not self._leaving.is_set():
            self._leave_asked = time.monotonic()
        self._leaving.set()

    def wait_gone(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        self._leaving.set()
        if self._thread.is_alive():
            self._thread.join(2 * self.config.step_timeout_s + 35.0)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        self.router.close()
        self._keeper.shutdown(wait=True)

    def _on_copy(self, copy: Copy) -> None:
        self._keeper.submit(self._keep, copy)

    def _keep(self, copy: Copy) -> None:
        try:
            if self.vault.keep_copy(copy):
                self._emit({"event": "kept", "from": copy.peer, "step": copy.holding.step,
                            "range": [copy.holding.start, copy.holding.stop],
                            "t": time.time()})  # fmt: skip
        except (OSError, FusionError) as exc:
            logger.warning("could not keep a copy from %s: %s", copy.peer[:16], exc)
        finally:
            self.board.filed(copy.peer)

    # ----- the loop ---------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._follow_plans()
        except Exception:  # a bug: say so loudly, and let the node leave instead of hanging
            logger.error("training stopped on an unexpected error", exc_info=True)
            self._emit({"event": "train_error"})
            self.failed = True
            self.finished.set()

    def _follow_plans(self) -> None:
        parted_from = None  # a plan some member left: wait for the one without it
        # A leave asked for after our vote of a step went out, a step the members then ended
        # with a switch to a plan we are in, or while we waited at a plan's barrier that the
        # swarm then replaced: the members count on our stage in the plan they follow now. We
        # serve that plan to its first step boundary, where our vote to leave hands the stage
        # over (once).
        switched_away = False
        while not self._stop.is_set() and (switched_away or not self._leaving.is_set()):
            if self.view.run_finished():  # the members reached the end without us
                return self._finish(None)
            current = self.view.adopted()
            if current is None:
                self._stop.wait(_IDLE_POLL_S)
                continue
            try:
                plan_of = assign(self.run_spec, current[1], current[0], self.peer_id)
            except ConfigError as exc:
                logger.error("cannot run plan %s: %s", current[0][:12], exc)
                plan_of = None
            if switched_away and (plan_of is None or plan_of.role is None):
                return  # the switch left us out: it handed our stage over (Parting.hand_over)
            if plan_of is None or plan_of.role is None or plan_of.digest == parted_from:
                left_out = plan_of is not None and plan_of.role is None
                if left_out:
                    self.view.publish(None, self.step, self.loss, False, self.evaluation)
                self._wait_for_other_plan(current[0], watched=current[1] if left_out else None)
                continue
            ending = self._serve(plan_of)
            if ending.outcome is Outcome.FINISHED:
                return self._finish(ending.held)
            if ending.outcome is Outcome.PARTED:
                parted_from = plan_of.digest
            moved_on = ending.outcome in (Outcome.SWITCH, Outcome.ABANDONED)
            switched_away = moved_on and self._leaving.is_set() and not switched_away

    def _serve(self, plan_of: Assignment) -> Ending:
        digest = plan_of.digest
        session = PlanSession(
            assignment=plan_of,
            graph=self.graph,
            dataset=self._build()[1],
            transport=self.transport,
            board=self.board,
            router=self.router,
            hooks=self._hooks(),
            timeout_s=self.config.step_timeout_s,
            compute=Compute.of(self.config.device, self.run_spec.precision),
        )
        self._session = session
        try:
            with self._placement.serving(plan_of, torch.get_num_threads()):
                ending = self._run_session(session, plan_of)
        finally:
            self._last_members = frozenset(plan_of.members)
            self._session = None
            session.close()
        self._abandoned = self._abandoned or session.fault_abandoned  # the test hook: once
        self._emit({"event": "plan_end", "digest": digest, "outcome": ending.outcome.value,
                    "next_step": ending.held.next_step if ending.held else None,
                    "detail": ending.detail, "t": time.time()})  # fmt: skip
        return ending

    def _run_session(self, session: PlanSession, plan_of: Assignment) -> Ending:
        """A leave asked for at the barrier does not end it at once: the members wait there
        for our stage, which may be its only copy, so we meet them, serve the first step and
        part at its boundary (our vote to leave), handing the stage over. Members that do not
        come within the barrier's grace are not waited for any longer: we leave then, or at
        once when none of them is alive in our view (nobody waits for our stage)."""
        digest = plan_of.digest
        others = tuple(plan_of.others().values())
        self._connect(plan_of)
        # A plan whose members never all meet (one of them followed another plan, which then
        # ran to the end and left) is given up once the members' records say the run is over.
        current = lambda: (  # noqa: E731
            (self.view.adopted() or ("",))[0] == digest
            and not self.view.run_finished()
            and not self._left_long_ago()
            and not (self._leaving.is_set() and not any(map(self.view.is_member, others)))
        )
        if self.config.fault_late_barrier_s > 0 and not self._came_late:
            self._came_late = True
            self._emit({"event": "fault_late_barrier", "s": self.config.fault_late_barrier_s})
            self._stop.wait(self.config.fault_late_barrier_s)
        start = session.meet(current=current, stop=self._stop)
        if start is None:
            return Ending(Outcome.ABANDONED, None)
        self._emit_plan(plan_of, start, session.moved)
        return session.run(
            start, last_step=self.run_spec.steps, stop=self._stop, on_step=self._on_step
        )

    def _left_long_ago(self) -> bool:
        """A leave asked for more than the barrier's grace ago (a barrier it must not hold)."""
        waited = time.monotonic() - self._leave_asked
        return self._leaving.is_set() and waited > self.config.barrier_grace_s

    def _hooks(self) -> SessionHooks:
        return SessionHooks(
            vault=self.vault,
            params_of=self.params_of,
            is_member=self.view.is_member,
            vote=self._vote,
            followed=self._followed,
            next_plan=self._next_plan,
            checkpoint_every=self.config.checkpoint_every,
            emit=self._emit,
            progress=self._reached,
            donors=self.view.members,
            connect=self.connect,
            suspect=self.view.suspect,
            cleared=self.view.cleared,
            link_bytes_per_s=self.view.link_bytes_per_s,
            send_bytes_per_s=self.view.send_bytes_per_s,
            barrier_grace_s=self.config.barrier_grace_s,
            fault_stall_after=self.config.fault_stall_after,
            fault_abandon_after=0 if self._abandoned else self.config.fault_abandon_after,
            fault_under_report=self.config.fault_under_report,
        )

    def _followed(self) -> str | None:
        current = self.view.adopted()
        return current[0] if current is not None else None

    def _reached(self) -> int:
        """The newest step the swarm reached, as far as we know: records lag a heartbeat
        behind, our own last step does not."""
        return max(self.view.progress(), self.step)

    def _vote(self) -> float:
        if self._leaving.is_set():
            return LEAVE_VOTE
        current = self.view.adopted()
        if current is None:
            return 0.0
        vote = plan_vote(current[0])
        self._plans[vote] = current
        while len(self._plans) > _PLANS_REMEMBERED:
            del self._plans[next(iter(self._plans))]
        return vote

    def _next_plan(self, vote: float) -> Assignment | None:
        known = self._plans.get(vote)
        if known is None:
            return None
        try:
            return assign(self.run_spec, known[1], known[0], self.peer_id)
        except ConfigError:
            return None

    def _wait_for_other_plan(self, digest: str, *, watched: Plan | None = None) -> None:
        """Idle until the adopted plan changes or the run finished (``_follow_plans`` ends).
        ``watched``: the plan that left us out; if the swarm makes no progress under it, its
        members are suspected (idle_plan.py: nobody at its barrier would)."""
        watch = self._idle_watch(watched) if watched is not None else None
        while not (self._stop.is_set() or self._leaving.is_set() or self.view.run_finished()):
            current = self.view.adopted()
            if current is None or current[0] != digest:
                return
            idle = watch.check(progress=self._reached(), now=time.monotonic()) if watch else ()
            if idle:
                logger.warning("no step under plan %s for %.0f s: suspecting its %d members",
                               digest[:12], watch.patience_s, len(idle))  # fmt: skip
            for peer in idle:
                self.view.suspect(peer, "idle")
            self._stop.wait(_IDLE_POLL_S)

    def _idle_watch(self, plan: Plan) -> IdlePlanWatch:
        members = {p for stage in plan.stages for p in stage.peers} - {self.peer_id}
        slowest = min((self.view.link_bytes_per_s(p) for p in members), default=1.0)
        patience = idle_patience_s(barrier_grace_s=self.config.barrier_grace_s,
                                   step_timeout_s=self.config.step_timeout_s,
                                   state_bytes=self.board.state_bytes(self.board.names),
                                   bytes_per_s=slowest)  # fmt: skip
        return IdlePlanWatch(members, progress=self._reached(), now=time.monotonic(),
                             patience_s=patience)  # fmt: skip

    # ----- peers ------------------------------------------------------------------------------

    def _connect(self, plan_of: Assignment) -> None:
        for peer in plan_of.others().values():
            self.connect(peer)

    def connect(self, peer: str) -> None:
        for addr in self.view.addrs(peer)[:2]:
            try:
                self.transport.connect(addr)
                return
            except FusionError as exc:
                logger.debug("could not dial %s at %s: %s", peer[:16], addr, exc)

    # ----- reporting --------------------------------------------------------------------------

    def _on_step(self, report: StepReport) -> None:
        self.step, self.loss = report.step + 1, report.loss
        if report.eval_loss is not None:
            self.evaluation = (report.step, report.eval_loss)
        role = self._role
        self.view.publish(role, self.step, self.loss, False, self.evaluation)
        session = self._session
        if session is not None:
            # Named by the plan it ran in: the daemon may have adopted the next one already.
            digest, runner = session.assignment.digest, session.runner
            self.view.measured(digest, report.busy_s, report.own_s)
            if report.timings:
                ranks = [(runner.peer_of.get(r, self.peer_id), r.stage) for r in runner.roles]
                self.view.witnessed(digest, ranks, list(report.timings))
        self._emit(step_event(report, self.run_spec.tokens_per_step, self._bytes_out()))

    def _emit_plan(self, plan_of: Assignment, start: int, moved: tuple[int, int]) -> None:
        self._role = plan_of.role.replica if plan_of.role else None
        self._emit(plan_event(plan_of, start, moved))

    def _bytes_out(self) -> int:
        try:
            return sum(s.bytes_out for s in self.transport.stats().values())
        except FusionError:
            return 0

    def _finish(self, held: Held | None) -> None:
        if held is not None:
            path = self.config.work_dir / FINAL_PARAMS
            save_final_params(path, held)
            self._emit({"event": "saved", "path": str(path), "step": held.next_step})
        self.view.publish(self._role, self.step, self.loss, True, self.evaluation)
        self._emit({"event": "finished", "step": self.step, "loss": self.loss,
                    "t": time.time()})  # fmt: skip
        self.finished.set()
