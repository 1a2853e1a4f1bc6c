"""What a plan's session and its node say to each other: the state kept between plans
(``Held``), how a session ended (``Ending``, ``Outcome``) and what it needs from its node
(``SessionHooks``). Apart from session.py so the vault and the trainer can name them without
the session's machinery."""

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from fusionllm.node.pipeline.layout import PipelineLayout
from fusionllm.node.pipeline.loss_scale import ScaleState
from fusionllm.node.pipeline.stage import StageWorker
from fusionllm.node.training.assignment import Assignment
from fusionllm.node.training.holdings import ParamsOf


@dataclass
class Held:
    """The run's state a node keeps between plans: its stage's worker, valid before a step."""

    assignment: Assignment
    layout: PipelineLayout
    worker: StageWorker
    next_step: int
    scale: ScaleState | None = None  # fp16's loss scale before next_step


class Outcome(Enum):
    FINISHED = "finished"  # the run's last step is done
    SWITCH = "switch"  # the members voted for another plan
    PARTED = "parted"  # members left (politely) after a step; their state stayed behind
    FAILED = "failed"  # a step failed (a peer vanished, a frame never came)
    STOPPED = "stopped"  # this node stops
    ABANDONED = "abandoned"  # the plan changed before every member was ready


@dataclass
class Ending:
    outcome: Outcome
    held: Held | None
    detail: str = ""
    leavers: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class SessionHooks:
    """What a session needs from its node beyond the data plane."""

    vault: object  # vault.Vault (not imported: it imports this module)
    params_of: ParamsOf
    is_member: Callable[[str], bool]
    vote: Callable[[], float]
    followed: Callable[[], str | None]  # the digest of the plan our control plane follows now
    next_plan: Callable[[float], Assignment | None]  # the plan a vote names, as we'd serve it
    checkpoint_every: int  # 0: never
    emit: Callable[[dict], None]
    progress: Callable[[], int]  # the newest step the swarm's records show reached
    donors: Callable[[], list[str]]  # nodes that may hold state outside the plan
    connect: Callable[[str], None]  # dial a peer (by id) on the data plane
    suspect: Callable[[str, str], None] = lambda peer, reason: None  # (peer, why): keep it out
    cleared: Callable[[str], None] = lambda peer: None  # it met us at the barrier
    link_bytes_per_s: Callable[[str], float] = lambda peer: 12.5e6  # measured, from the peer
    send_bytes_per_s: Callable[[str], float] = lambda peer: 12.5e6  # measured, to the peer
    barrier_grace_s: float = 30.0  # the READY wait for a member beyond its state's transfer
    # Test hook (--fault-stall-after): after this many steps of one plan, stop sending frames
    # and stepping until the node is killed, while its heartbeat goes on. 0: never.
    fault_stall_after: int = 0
    # Test hook (--fault-abandon-after): after this many steps of a plan, abandon the next
    # step as the member watcher does when our view drops a member (once a process). 0: never.
    fault_abandon_after: int = 0
    # Test hook (--fault-under-report): report this many times less compute than we measured.
    fault_under_report: float = 1.0
