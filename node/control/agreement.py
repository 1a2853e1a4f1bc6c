"""Leaderless plan agreement: pure rules every node applies to the same DHT contents.

Time is cut into epochs of ``epoch_s`` seconds (wall clock; nodes are assumed NTP-close, as
hivemind's DHT itself assumes). In each epoch every node proposes one plan; after a settle
delay every node reads all proposals of the epoch, keeps those valid *in its own view*
(``check_proposal``: the proposer is a fresh member, the plan covers our model, every peer in
it is a fresh member, the rules and figures survive ``audit.audit`` against our own
recomputation) and adopts the best: lowest estimated step time, ties broken by the lowest
digest (``choose``). Equal inputs give equal choices, so no coordinator is needed; where views
differ, convergence.py brings the odd nodes to the plan most members follow.

A node re-proposes the plan it follows (its bytes unchanged, hence its digest) unless that plan
became invalid or its own fresh plan is better by more than ``switch_margin``: plans do not
flap with measurement noise, yet a crash or a clearly better swarm re-plans at once.
"""

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from fusionllm.common.errors import ConfigError
from fusionllm.dag.plan_check import PlanCheckError, Retimer
from fusionllm.dag.plan_records import PLANNERS
from fusionllm.dag.plan_wire import plan_from_json
from fusionllm.dag.planner import Plan, PlanConfig
from fusionllm.dht.records import NodeInfo, NodeState, PlanProposal, RecordError
from fusionllm.node.control.audit import Audit, AuditLimits, audit
from fusionllm.node.control.quiet import MAX_BEAT


def epoch_at(now: float, epoch_s: float) -> int:
    return math.floor(now / epoch_s)


def epoch_start(epoch: int, epoch_s: float) -> float:
    return epoch * epoch_s


def next_step(
    now: float, *, proposed: int, adopted_for: int, epoch_s: float, settle_fraction: float
) -> tuple[str | None, int, float]:
    """(action, its epoch, when to look again): "adopt" the epoch we proposed in once its
    settle time has come (even late: skipping it would stall us a whole epoch), else
    "propose" in a new epoch, else nothing until the next of those moments."""
    epoch = epoch_at(now, epoch_s)
    settle = epoch_start(proposed, epoch_s) + settle_fraction * epoch_s
    if adopted_for < proposed:
        return ("adopt", proposed, now) if now >= settle else (None, proposed, settle)
    if proposed < epoch:
        return "propose", epoch, now
    return None, proposed, epoch_start(proposed + 1, epoch_s)


def fresh_members(
    records: Mapping[str, NodeInfo],
    *,
    digest: str,
    now: float,
    suspect_after_s: float,
    max_skew_s: float,
) -> dict[str, NodeInfo]:
    """The records that count as members: our settings, not leaving, written within
    ``suspect_after_s`` (a node that missed several heartbeats is treated as gone before its
    record expires; a quiet node's record says it beats less often, and is believed up to
    quiet.MAX_BEAT times), and not dated ahead of ``now`` by more than ``max_skew_s`` (such a
    record would look fresh for as long as it lives)."""
    return {
        pid: info
        for pid, info in records.items()
        if info.config_digest == digest
        and info.state is not NodeState.LEAVING
        and now - suspect_after_s * min(info.beat, MAX_BEAT) <= info.time <= now + max_skew_s
    }


@dataclass(frozen=True)
class Candidate:
    proposal: PlanProposal
    plan: Plan
    audit: Audit = field(default_factory=Audit)
    retimed_estimate: float = 0.0  # its step time in our view of the swarm (0: not retimed)

    @property
    def digest(self) -> str:
        return self.proposal.digest

    @property
    def estimate(self) -> float:
        return self.proposal.estimate

    @property
    def score(self) -> float:
        """Its step time as it would run now: what it claims, or what our own figures give if
        that is slower (a followed plan is re-proposed with the figures it was made with)."""
        return max(self.estimate, self.retimed_estimate)

    def believable(self, limits: AuditLimits) -> bool:
        """Whether no figure is understated beyond ``limits`` of our own (the bar for a plan
        the swarm does not follow yet)."""
        return self.audit.believable(limits)

    def consistent(self, limits: AuditLimits) -> bool:
        """Whether no figure that our bandwidth view does not enter is understated (the bar
        for a plan the swarm follows: see audit.py)."""
        return self.audit.consistent(limits)


@dataclass(frozen=True, kw_only=True)
class EpochView:
    """What a node judges one epoch's proposals against: its own snapshot of the swarm."""

    swarm: str
    epoch: int
    members: Mapping[str, NodeInfo]  # fresh members on our settings, ourselves included
    node_ids: Sequence[str]  # our model's graph nodes
    config: PlanConfig  # from the swarm settings: micro-batches, compression, memory fraction
    retimer: Retimer  # graph costs + members' devices + our quantized bandwidth book
    limits: AuditLimits = field(default_factory=AuditLimits)
    seatable: frozenset[str] | None = None  # members a plan may seat (seating.py); None: all


class NotAMemberError(RecordError):
    """A proposal from a key that is not a fresh member of the swarm in our view."""


# check_proposal's memo for one view: (plan bytes, estimate) -> the Candidate it made of them.
CheckedPlans = dict[tuple[bytes, float], "Candidate"]


def check_proposal(
    proposal: PlanProposal, view: EpochView, *, checked: CheckedPlans | None = None
) -> Candidate:
    """The proposal as a Candidate if it is valid in ``view``; RecordError says why not.

    The Candidate carries its audit; which bar it must clear is the caller's call: every
    figure (``believable``) for a plan the swarm does not follow yet, the figures no bandwidth
    view changes (``consistent``) for the one it follows. ``checked``: a memo shared by the
    proposals of one view. A stable swarm's members all propose the same plan, and auditing
    it once per proposer was the largest part of an epoch's CPU after planning.
    """
    if proposal.swarm != view.swarm or proposal.epoch != view.epoch:
        raise RecordError(f"proposal is for {proposal.swarm!r} epoch {proposal.epoch}")
    if proposal.proposer not in view.members:
        raise NotAMemberError(f"proposal from {proposal.proposer[:16]}..., not a fresh member")
    # Everything below depends on the plan and its claimed estimate only, not on who sent them.
    key = (proposal.plan, proposal.estimate)
    if checked is not None and key in checked:
        return dataclasses.replace(checked[key], proposal=proposal)
    candidate = _check_plan_of(proposal, view)
    if checked is not None:
        checked[key] = candidate
    return candidate


def _check_plan_of(proposal: PlanProposal, view: EpochView) -> Candidate:
    try:
        plan = plan_from_json(proposal.plan)
    except ConfigError as exc:
        raise RecordError(f"proposal from {proposal.proposer[:16]}: {exc}") from exc
    if not math.isclose(plan.estimated_step_time, proposal.estimate, rel_tol=1e-9):
        raise RecordError("proposal's estimate is not its plan's estimated step time")
    if plan.method != PLANNERS[view.config.planner]:  # a swarm runs one planning method
        raise RecordError(f"a {plan.method} plan, but the swarm plans {view.config.planner}")
    check_plan(
        plan,
        members=view.members,
        node_ids=view.node_ids,
        memory_fraction=view.config.memory_fraction,
        seatable=view.seatable,
    )
    try:
        retimed = view.retimer.retime(plan)
    except PlanCheckError as exc:
        raise RecordError(f"proposal from {proposal.proposer[:16]}: {exc}") from exc
    return Candidate(
        proposal,
        plan,
        audit(plan, retimed, view.config, view.limits),
        retimed_estimate=retimed.plan.estimated_step_time,
    )


def check_plan(
    plan: Plan,
    *,
    members: Mapping[str, NodeInfo],
    node_ids: Sequence[str],
    memory_fraction: float,
    seatable: frozenset[str] | None = None,
) -> None:
    """RecordError unless ``plan`` runs our model on live members that can hold it and that
    a plan may seat (``seatable``; None: every member)."""
    if not plan.stages:
        raise RecordError("plan has no stages")
    position = 0
    seen: set[str] = set()
    for k, stage in enumerate(plan.stages):
        if stage.index != k or stage.start != position or not stage.start < stage.stop:
            raise RecordError(f"stage {k} does not continue the previous one")
        if tuple(stage.node_ids) != tuple(node_ids[stage.start : stage.stop]):
            raise RecordError(f"stage {k} names nodes that are not our model's")
        position = stage.stop
        if not stage.peers or not len(stage.peers) == len(stage.shares) == len(stage.memory_bytes):
            raise RecordError(f"stage {k} has mismatched peers/shares/memory")
        if not math.isclose(sum(stage.shares), 1.0, abs_tol=1e-6) or min(stage.shares) <= 0:
            raise RecordError(f"stage {k} shares do not split the micro-batch")
        for peer, need in zip(stage.peers, stage.memory_bytes, strict=True):
            info = members.get(peer)
            if info is None:
                raise RecordError(f"stage {k} peer {peer[:16]}... is not alive in our view")
            if seatable is not None and peer not in seatable:
                raise RecordError(f"stage {k} seats {peer[:16]}..., an observer or suspect")
            if peer in seen:
                raise RecordError(f"peer {peer[:16]}... serves two stages")
            seen.add(peer)
            if need > info.device.memory_bytes * memory_fraction:
                raise RecordError(
                    f"stage {k} needs {need} bytes on {peer[:16]}..., which has "
                    f"{info.device.memory_bytes} x {memory_fraction}"
                )
    if position != len(node_ids):
        raise RecordError(f"plan covers {position} of {len(node_ids)} nodes")
    if len(plan.links) != len(plan.stages) - 1:
        raise RecordError("plan needs one link per cut")
    for link in plan.links:
        stage = link.src_stage
        if not 0 <= stage < len(plan.stages) - 1:
            raise RecordError(f"link after stage {stage} is outside the pipeline")
        if link.src_peer not in plan.stages[stage].peers:
            raise RecordError(f"link after stage {stage} starts outside the stage")
        if link.dst_peer not in plan.stages[stage + 1].peers:
            raise RecordError(f"link after stage {stage} ends outside the next stage")


def choose(candidates: Iterable[Candidate]) -> Candidate | None:
    """The best valid candidate: lowest estimate, then lowest digest."""
    return min(candidates, key=lambda c: (c.estimate, c.digest), default=None)


def keep_incumbent(incumbent_estimate: float, fresh_estimate: float, switch_margin: float) -> bool:
    """Whether a node should re-propose the plan it follows rather than its fresh one."""
    return fresh_estimate >= incumbent_estimate * (1.0 - switch_margin)


def serving_peers(plan: Plan) -> set[str]:
    return {peer for stage in plan.stages for peer in stage.peers}


def backup_pool(plan: Plan, members: Iterable[str]) -> list[str]:
    """Live members the plan does not use: the backup pool."""
    used = serving_peers(plan)
    return sorted(set(members) - used)
