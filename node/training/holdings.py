"""Where the run's state lives, and which step a plan starts from (pure rules).

Every member of a new plan announces what it holds (``Holding``): the live state of the stage it
served (step = its next step), its own checkpoints, and the checkpoints and parting copies other
members handed it (custody). A holding names a step and a node range [start, stop) of the
model's graph: the state of every parameter those nodes use, as it was before that step.

``choose_start`` picks the newest step at which the members' holdings cover every parameter
of the model, and who sends which parameter to whom. Every member computes it from the same
announcements, so all start from the same step with no leader; a crash therefore rolls the
swarm back to the newest step that survived somewhere, and no further. Step 0 needs no
holding: every node builds the seeded initial weights itself.

``custodian`` says who keeps a copy of a stage's checkpoint (or of a leaving member's state)
when the stage has no other replica.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fusionllm.common.errors import ConfigError
from fusionllm.node.pipeline.loss_scale import ScaleState
from fusionllm.node.pipeline.mailbox import Role

MAX_HOLDINGS = 8  # per READY announcement: live state, 2 own checkpoints, custody copies
SEED_STEP = 0

ParamsOf = Callable[[int, int], frozenset[str]]  # node range -> its canonical parameters


@dataclass(frozen=True, order=True)
class Holding:
    step: int  # the state as it was before this step
    start: int  # node range [start, stop) of the graph
    stop: int

    def __post_init__(self) -> None:
        if self.step < 0 or not 0 <= self.start < self.stop:
            raise ConfigError(f"not a holding: {self}")


@dataclass(frozen=True, order=True)
class Move:
    name: str  # canonical parameter name
    src: str  # peer id
    dst: str


@dataclass(frozen=True)
class Start:
    step: int
    moves: tuple[Move, ...]  # state each member receives from another, sorted
    local: dict[str, tuple[Holding, ...]]  # member -> its own holdings at ``step`` (may be ())


def choose_start(
    members: Sequence[str],  # the new plan's members, in plan order
    holdings: dict[str, Sequence[Holding]],
    needs: dict[str, frozenset[str]],  # member -> the parameters its new stage uses
    params_of: ParamsOf,
) -> Start:
    """The newest step whose state the members hold in full, and the moves that gather it."""
    wanted = frozenset().union(*needs.values()) if needs else frozenset()
    steps = sorted({h.step for m in members for h in holdings.get(m, ())}, reverse=True)
    for step in steps:
        if step == SEED_STEP:
            break
        holder = _holders_at(step, members, holdings, params_of)
        if wanted <= holder.keys():
            return _start_at(step, members, holdings, needs, holder, params_of)
    return Start(SEED_STEP, (), {m: () for m in members})


def _holders_at(step, members, holdings, params_of) -> dict[str, str]:
    """Parameter -> its first holder at ``step`` (plan order, then announcement order)."""
    holder: dict[str, str] = {}
    for member in members:
        for held in holdings.get(member, ()):
            if held.step == step:
                for name in params_of(held.start, held.stop):
                    holder.setdefault(name, member)
    return holder


def _start_at(step, members, holdings, needs, holder, params_of) -> Start:
    moves, local = [], {}
    for member in members:
        own = tuple(h for h in holdings.get(member, ()) if h.step == step)
        mine = frozenset().union(*(params_of(h.start, h.stop) for h in own)) if own else frozenset()
        local[member] = own
        for name in sorted(needs.get(member, frozenset()) - mine):
            moves.append(Move(name, holder[name], member))
    return Start(step, tuple(sorted(moves)), local)


def start_scale(
    step: int,
    members: Sequence[str],
    announced: dict[str, Sequence[tuple[Holding, ScaleState | None]]],
) -> ScaleState | None:
    """fp16's loss scale every member of a plan starting at ``step`` restores: the first one
    announced for a holding at that step (plan order, then announcement order), the same on
    every member; None (keep the initial scale) at the seed step or where none was given."""
    if step == SEED_STEP:
        return None
    for member in members:
        for holding, scale in announced.get(member, ()):
            if holding.step == step and scale is not None:
                return scale
    return None


def checkpoint_custodian(stage: int, peers: dict[Role, str]) -> str | None:
    """Who keeps a copy of ``stage``'s checkpoints: None if the stage has replicas (each writes
    its own) or the plan has one process; else the next stage's first replica (wrapping)."""
    if sum(1 for r in peers if r.stage == stage) > 1:
        return None
    return _next_stage_peer(stage, peers, frozenset())


def parting_custodian(
    stage: int,
    peers: dict[Role, str],  # the plan being left
    leaving: frozenset[str],
    preferred: Sequence[str] = (),  # tried first, in order (the next plan's members)
) -> str | None:
    """Who receives ``stage``'s live state when every holder of it leaves the plan: the first
    staying member among ``preferred``, else the next stage's first staying replica; None if a
    holder stays (it keeps the state) or nobody stays."""
    holders = {p for r, p in peers.items() if r.stage == stage}
    if holders - leaving:
        return None
    staying = set(peers.values()) - leaving
    for peer in preferred:
        if peer in staying:
            return peer
    return _next_stage_peer(stage, peers, leaving)


def _next_stage_peer(stage: int, peers: dict[Role, str], leaving: frozenset[str]) -> str | None:
    stages = 1 + max(r.stage for r in peers)
    for offset in range(1, stages):
        for role in sorted(r for r in peers if r.stage == (stage + offset) % stages):
            if peers[role] not in leaving:
                return peers[role]
    return None
