"""Whether to leave the plan the swarm follows for a fresh one: both judged on one snapshot.

A fresh plan is made on this epoch's snapshot of the swarm; the plan we follow claims the
estimate it was made with, on an older one. Comparing the two mixes two views: links measured
faster since made the old claim look slow (and the swarm re-plans for nothing), links measured
slower since made it look fast (and a newcomer is kept out for good). So the incumbent is
planned again on the same snapshot, its stages and peers as they are, its codecs and shares as
the planner's rules give them now (``Retimer.recoded``: AdaTopK stops compressing a link that
is no longer the bottleneck). A fresh plan must beat that by the switch margin after paying for
the state it moves (``dag.switch_cost``), spread over the steps it is expected to run.

Link figures arrive one by one early in a run (a link's first lane figure replaces its stream
probe's, 0.02-0.71 of the cap on topology A), and each can make a different fresh plan look
better: A's OP-Fence + AdaTopK run adopted 6 plans in 20 s and ran 0.89x naive, the switches
costing it steps. ``SwitchStreak``: where the members are the same and only figures moved, a
fresh plan must win ``rounds`` planning rounds in a row with the same layout; a swarm whose
members changed switches at once (a newcomer is seated, a loss is replaced).
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

from fusionllm.dag.graph import GraphCosts
from fusionllm.dag.methods import InfeasiblePlanError
from fusionllm.dag.plan_check import PlanCheckError, Retimer
from fusionllm.dag.plan_records import Plan, PlanConfig
from fusionllm.dag.swarm import Swarm
from fusionllm.dag.switch_cost import SwitchPolicy, amortised_switch_s, state_transfer_time
from fusionllm.node.control.agreement import Candidate, keep_incumbent, serving_peers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SwitchJudgement:
    keep: bool
    incumbent_s: float  # the plan we follow, re-estimated on this snapshot
    fresh_s: float  # the fresh plan's estimate
    transfer_s: float  # moving the state to the fresh plan's holders, whole


def incumbent_now(incumbent: Candidate, retimer: Retimer) -> float:
    """The step time of the plan we follow as the planner would make it on ``retimer``'s
    snapshot; where it cannot be planned again, as it would run (its ``score``)."""
    try:
        return retimer.recoded(incumbent.plan).estimated_step_time
    except PlanCheckError as exc:
        logger.debug("the followed plan cannot be planned again here: %s", exc)
        return incumbent.score


def judge_switch(
    incumbent: Candidate,
    fresh: Plan,
    *,
    retimer: Retimer,
    costs: GraphCosts,
    switch_margin: float,
    policy: SwitchPolicy,
) -> SwitchJudgement:
    """Keep the incumbent unless ``fresh``, with its moved state amortised over the policy's
    horizon, beats the incumbent on the same snapshot by more than ``switch_margin``."""
    now = incumbent_now(incumbent, retimer)
    transfer = state_transfer_time(incumbent.plan, fresh, costs, retimer.swarm, retimer.config)
    cost = amortised_switch_s(transfer, policy)
    keep = keep_incumbent(now, fresh.estimated_step_time + cost, switch_margin)
    return SwitchJudgement(keep, now, fresh.estimated_step_time, transfer)


Layout = tuple[tuple[int, int, tuple[str, ...]], ...]


def layout_of(plan: Plan) -> Layout:
    """What a switch changes: each stage's node range and peers (not its codecs or figures)."""
    return tuple((s.start, s.stop, tuple(s.peers)) for s in plan.stages)


class SwitchStreak:
    """Whether a fresh plan that beat the plan we follow has won often enough to switch to."""

    def __init__(self, rounds: int = 2) -> None:
        if not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
        self.rounds = rounds
        self._key: tuple[str, Layout] | None = None  # (incumbent digest, fresh layout)
        self._wins = 0

    def settled(self, incumbent: str, fresh: Plan, *, wins: bool, figures_only: bool) -> bool:
        """One planning round's verdict: ``wins`` (``fresh`` beat the plan we follow,
        digest ``incumbent``, by the margin) and ``figures_only`` (the members are those of
        our last round: only link or pace figures moved). True: switch now."""
        key = (incumbent, layout_of(fresh))
        if not wins:
            self._key, self._wins = None, 0
            return False
        self._wins = self._wins + 1 if key == self._key else 1
        self._key = key
        return not figures_only or self._wins >= self.rounds


def after_a_loss(
    old: Plan,
    fresh: Plan,
    plan_over: Callable[[frozenset[str]], Plan],
    *,
    swarm: Swarm,
    costs: GraphCosts,
    config: PlanConfig,
    switch_margin: float,
    policy: SwitchPolicy,
) -> Plan:
    """The plan to propose once the one we followed broke (a member left): ``fresh``, or the
    plan of the old plan's surviving holders (``plan_over``) unless ``fresh`` beats it by the
    switch margin with its moved state paid. Seen on the testbed: after a crash the swarm
    moved the whole model to an all-new plan, minutes of state over home uplinks."""
    holders = frozenset(serving_peers(old) & set(swarm.peer_ids))
    if not holders or holders == serving_peers(fresh):
        return fresh
    try:
        kept = plan_over(holders)
    except InfeasiblePlanError:  # the holders alone cannot run it (memory, min_peers)
        return fresh

    def paid(p: Plan) -> float:
        moved = state_transfer_time(old, p, costs, swarm, config)
        return p.estimated_step_time + amortised_switch_s(moved, policy)

    return kept if keep_incumbent(paid(kept), paid(fresh), switch_margin) else fresh
