"""What a node's training is given: its settings (``TrainerConfig``, validated) and the narrow
view of the control plane it reads and reports to (``SwarmView``), so that the training package
never imports the control plane.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from fusionllm.common.errors import ConfigError
from fusionllm.common.run_spec import RunSpec
from fusionllm.dag.planner import Plan
from fusionllm.node.pipeline.compute import resolve_device
from fusionllm.node.training.checkpoints import CheckpointStore

DEFAULT_CHECKPOINT_EVERY = 20


class SwarmView(Protocol):
    """What training needs from the node's control plane."""

    def adopted(self) -> tuple[str, Plan] | None: ...  # (digest, plan) this node follows
    def addrs(self, peer: str) -> list[str]: ...  # a member's data-plane addresses
    def is_member(self, peer: str) -> bool: ...
    def publish(
        self,
        replica: int | None,
        step: int,
        loss: float | None,
        finished: bool,
        evaluation: tuple[int, float] | None = None,  # the newest validation (step, loss)
    ) -> None: ...
    def run_finished(self) -> bool: ...  # some member's record says the run reached its end
    def members(self) -> list[str]: ...  # every live member's peer id
    def progress(self) -> int: ...  # the newest step the members' records say was reached
    # One step of plan ``digest``: our stage's compute and all our own work (StepReport.own_s);
    # every rank's (peer, stage) and (compute, activation wait, gradient wait)
    def measured(self, digest: str, compute_s: float, own_s: float) -> None: ...
    def witnessed(self, digest: str, ranks: list[tuple[str, int]], timings: list) -> None: ...
    def suspect(self, peer: str, reason: str) -> None: ...  # keep a member out of plans a while
    def cleared(self, peer: str) -> None: ...  # a member met us at the barrier
    def link_bytes_per_s(self, peer: str) -> float: ...  # measured from ``peer`` to us
    def send_bytes_per_s(self, peer: str) -> float: ...  # measured from us to ``peer``


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    run: RunSpec
    work_dir: Path
    step_timeout_s: float = 60.0  # longest wait for one frame inside a step
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY  # steps; 0: never
    checkpoint_pause_s: float = 0.0  # fault injection: sleep between a write and its rename
    pin_cores: bool = False  # while serving a plan, compute on cores picked by our rank in it
    device: str = "cpu"  # where a stage we serve computes (compute.resolve_device)
    # The READY barrier's wait for a member before it is suspected, beyond its state's transfer.
    barrier_grace_s: float = 30.0
    fault_stall_after: int = 0  # test hook: stall after this many steps of a plan (session.py)
    fault_abandon_after: int = 0  # test hook: abandon a step after this many of a plan, once
    fault_under_report: float = 1.0  # test hook: report this many times less compute
    fault_late_barrier_s: float = 0.0  # test hook: come this late to our first plan's barrier

    def __post_init__(self) -> None:
        object.__setattr__(self, "work_dir", Path(self.work_dir))
        if not 0 <= self.fault_late_barrier_s <= 3600:
            raise ConfigError(
                f"fault_late_barrier_s must be in [0, 3600], got {self.fault_late_barrier_s!r}"
            )
        for name in ("fault_stall_after", "fault_abandon_after"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be >= 0, got {value!r}")
        if not 1.0 <= self.fault_under_report <= 1e3:
            raise ConfigError(
                f"fault_under_report must be in [1, 1000], got {self.fault_under_report!r}"
            )
        object.__setattr__(self, "device", str(resolve_device(self.device)))
        if not 0 < self.barrier_grace_s <= 3600:
            raise ConfigError(f"barrier_grace_s must be in (0, 3600], got {self.barrier_grace_s}")
        if not self.step_timeout_s > 0:
            raise ConfigError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every must be >= 0, got {self.checkpoint_every!r}")
        if not 0 <= self.checkpoint_pause_s <= 3600:
            raise ConfigError(
                f"checkpoint_pause_s must be in [0, 3600], got {self.checkpoint_pause_s}"
            )

    def stores(self) -> tuple[CheckpointStore, CheckpointStore]:
        """(own checkpoints, copies kept for others), in a directory per run lineage."""
        lineage = self.run.lineage()
        pause = self.checkpoint_pause_s
        data = (self.run.global_batch, self.run.data_digest)
        return (
            CheckpointStore(
                self.work_dir / "checkpoints" / lineage, pause_before_rename_s=pause, data=data
            ),
            CheckpointStore(self.work_dir / "custody" / lineage),
        )
