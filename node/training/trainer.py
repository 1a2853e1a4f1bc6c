"""A node's training: follow the plan the swarm adopted, serve this node's stage of it.

No launcher hands out roles: each node reads the plan its own daemon adopted, computes its
part (``assign``), hands the state the new plan moves away from it to the members that need
it (``state_moves``), meets the other members (``PlanSession.meet``) and trains until the run
ends or the members vote for another plan. The daemon side is a narrow ``SwarmView``, so this
package never imports the control plane.
"""

import io
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from fusionllm.common.atomic import write_atomic
from fusionllm.common.errors import ConfigError, FusionError
from fusionllm.common.logs import get_logger
from fusionllm.common.run_spec import RunSpec
from fusionllm.compression import pack_tensor
from fusionllm.dag import OpGraph
from fusionllm.dag.planner import Plan
from fusionllm.node.p2p.framing import FrameHeader, FrameKind
from fusionllm.node.p2p.transport import TensorSpec
from fusionllm.node.pipeline.data import TokenDataset
from fusionllm.node.pipeline.layout import PipelineLayout
from fusionllm.node.pipeline.runner import StepReport
from fusionllm.node.training.assignment import Assignment, assign, plan_vote
from fusionllm.node.training.board import TAG_STATE, Board, Router
from fusionllm.node.training.moves import state_moves
from fusionllm.node.training.session import Ending, Held, Outcome, PlanSession

logger = get_logger(__name__)

FINAL_PARAMS = "final-params.pt"
_NEVER = TensorSpec(dtype=torch.float32, shape=(-1,))  # matches nothing: the frame is refused
_IDLE_POLL_S = 0.2


class SwarmView(Protocol):
    """What training needs from the node's control plane."""

    def adopted(self) -> tuple[str, Plan] | None: ...  # (digest, plan) this node follows
    def addrs(self, peer: str) -> list[str]: ...  # a member's data-plane addresses
    def is_member(self, peer: str) -> bool: ...
    def publish(
        self, replica: int | None, step: int, loss: float | None, finished: bool
    ) -> None: ...
    def run_finished(self) -> bool: ...  # some member's record says the run reached its end


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    run: RunSpec
    work_dir: Path
    step_timeout_s: float = 60.0  # longest wait for one frame inside a step

    def __post_init__(self) -> None:
        object.__setattr__(self, "work_dir", Path(self.work_dir))
        if not self.step_timeout_s > 0:
            raise ConfigError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")


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
        self.view = view
        self._emit = on_event
        self._session: PlanSession | None = None
        self._role: int | None = None  # our replica in the plan we serve
        self.board = Board(shapes=shapes, is_member=view.is_member)
        self.router = Router(transport, self.board)
        self._stop = threading.Event()
        self.finished = threading.Event()
        self.step = 0  # steps the swarm completed, as far as this node knows
        self.loss: float | None = None
        self._thread = threading.Thread(target=self._main, name="node-train", daemon=True)

    @property
    def graph(self) -> OpGraph:
        return self._build()[0]

    def _build(self) -> tuple[OpGraph, TokenDataset]:
        # A node in the backup pool never pays for the model, its trace or the corpus.
        if self._built is None:
            self._built = self._workload()
        return self._built

    def expect(self, header: FrameHeader) -> TensorSpec:
        """The transport's hook: what a frame must hold, by header, before it is kept."""
        spec = self.board.expect(header)
        if spec is not None:
            return spec
        session = self._session
        return session.runner.expectations.expect(header) if session is not None else _NEVER

    def start(self) -> "SwarmTrainer":
        self.router.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.config.step_timeout_s + 5.0)
        self.router.close()

    # ----- the loop ---------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._follow_plans()
        except Exception:  # a bug: say so loudly, and let the node leave instead of hanging
            logger.error("training stopped on an unexpected error", exc_info=True)
            self._emit({"event": "train_error"})
            self.finished.set()

    def _follow_plans(self) -> None:
        held: Held | None = None
        handed: set[tuple[int, str]] = set()
        while not self._stop.is_set():
            current = self.view.adopted()
            if current is None:
                self._stop.wait(_IDLE_POLL_S)
                continue
            try:
                plan_of = assign(self.run_spec, current[1], current[0], self.peer_id)
            except ConfigError as exc:
                logger.error("cannot run plan %s: %s", current[0][:12], exc)
                self._wait_for_other_plan(current[0])
                continue
            if held is not None and (id(held), plan_of.digest) not in handed:
                handed.add((id(held), plan_of.digest))
                self._hand_over(held, plan_of)
            if plan_of.role is None:
                self.view.publish(None, self.step, self.loss, False)
                if self._wait_for_other_plan(plan_of.digest):
                    return self._finish(None)
                continue
            ending = self._serve(plan_of, held)
            held = ending.held or held
            if ending.outcome is Outcome.FINISHED:
                return self._finish(held)

    def _serve(self, plan_of: Assignment, held: Held | None) -> Ending:
        digest = plan_of.digest
        session = PlanSession(
            assignment=plan_of,
            graph=self.graph,
            dataset=self._build()[1],
            transport=self.transport,
            board=self.board,
            router=self.router,
            vote=self._vote,
            timeout_s=self.config.step_timeout_s,
        )
        self._session = session
        try:
            self._connect(plan_of)
            current = lambda: (self.view.adopted() or ("",))[0] == digest  # noqa: E731
            start = session.meet(held, current=current, stop=self._stop)
            if start is None:
                return Ending(Outcome.ABANDONED, None)
            self._emit_plan(plan_of, start)
            ending = session.run(
                start, last_step=self.run_spec.steps, stop=self._stop, on_step=self._on_step
            )
        finally:
            self._session = None
            session.close()
        self._emit({"event": "plan_end", "digest": digest, "outcome": ending.outcome.value,
                    "next_step": ending.held.next_step if ending.held else None,
                    "detail": ending.detail})  # fmt: skip
        return ending

    def _vote(self) -> float:
        current = self.view.adopted()
        return plan_vote(current[0]) if current is not None else 0.0

    def _wait_for_other_plan(self, digest: str) -> bool:
        """Idle until the adopted plan changes; True if the run finished meanwhile."""
        while not self._stop.is_set():
            if self.view.run_finished():
                return True
            current = self.view.adopted()
            if current is None or current[0] != digest:
                return False
            self._stop.wait(_IDLE_POLL_S)
        return False

    # ----- peers ------------------------------------------------------------------------------

    def _connect(self, plan_of: Assignment) -> None:
        for peer in plan_of.others().values():
            for addr in self.view.addrs(peer)[:2]:
                try:
                    self.transport.connect(addr)
                    break
                except FusionError as exc:
                    logger.debug("could not dial %s at %s: %s", peer[:16], addr, exc)

    def _hand_over(self, held: Held, new: Assignment) -> None:
        """Send the parameters (and optimizer state) the new plan moves away from us."""
        old = held.assignment
        new_layout = PipelineLayout(self.graph, new.config.cuts or ())
        moves = state_moves(
            old.peers,
            _params_by_stage(held.layout),
            new.peers,
            _params_by_stage(new_layout),
        )
        mine = [m for m in moves if m.src == self.peer_id and m.dst != self.peer_id]
        if not mine:
            return
        self._connect(new)
        index = {name: i for i, name in enumerate(self.board.names)}
        futures = []
        for move in mine:
            header = FrameHeader(
                step=held.next_step,
                micro_batch=TAG_STATE + index[move.name],
                kind=FrameKind.CONTROL,
                stage=0,
            )
            body = pack_tensor(held.worker.export_state(move.name))
            futures.append(self.transport.send_async(move.dst, header, body, timeout=30.0))
        sent = 0
        for future in futures:
            try:
                future.result(35.0)
                sent += 1
            except Exception as exc:
                logger.warning("a state frame was not delivered: %s", exc)
        logger.info("handed %d of %d parameters to the new plan's members", sent, len(mine))
        self._emit({"event": "handover", "digest": new.digest, "sent": sent, "moves": len(mine)})

    # ----- reporting --------------------------------------------------------------------------

    def _on_step(self, report: StepReport) -> None:
        self.step, self.loss = report.step + 1, report.loss
        role = self._role
        self.view.publish(role, self.step, self.loss, False)
        tokens = self.run_spec.tokens_per_step
        self._emit({"event": "step", "step": report.step, "loss": report.loss,
                    "grad_norm": report.grad_norm, "seconds": report.seconds,
                    "tokens_per_s": tokens / max(report.seconds, 1e-9),
                    "busy_s": report.busy_s, "wait_s": report.wait_s,
                    "bytes_out": self._bytes_out()})  # fmt: skip

    def _emit_plan(self, plan_of: Assignment, start: int) -> None:
        self._role = plan_of.role.replica if plan_of.role else None
        self._emit({"event": "train_plan", "digest": plan_of.digest, "start_step": start,
                    "stage": plan_of.role.stage, "replica": plan_of.role.replica,
                    "ranges": [list(r) for r in plan_of.ranges],
                    "stages": [[plan_of.peers[r] for r in sorted(plan_of.peers)
                                if r.stage == s] for s in range(len(plan_of.ranges))]})  # fmt: skip

    def _bytes_out(self) -> int:
        try:
            return sum(s.bytes_out for s in self.transport.stats().values())
        except FusionError:
            return 0

    def _finish(self, held: Held | None) -> None:
        if held is not None:
            role = held.assignment.role
            path = self.config.work_dir / FINAL_PARAMS
            buffer = io.BytesIO()
            torch.save(
                {
                    "params": held.worker.state_dict(),
                    "stage": role.stage if role else None,
                    "replica": role.replica if role else None,
                    "nodes": list(held.layout.stages[role.stage]) if role else [],
                    "step": held.next_step,
                    "plan": held.assignment.digest,
                },
                buffer,
            )
            write_atomic(path, buffer.getvalue())
            self._emit({"event": "saved", "path": str(path), "step": held.next_step})
        self.view.publish(self._role, self.step, self.loss, True)
        self._emit({"event": "finished", "step": self.step, "loss": self.loss,
                    "t": time.time()})  # fmt: skip
        self.finished.set()


def _params_by_stage(layout: PipelineLayout) -> dict[int, frozenset[str]]:
    return {
        s: frozenset(layout.stage_parameter_names(s).values()) for s in range(layout.num_stages)
    }
