"""What an adopted plan asks of this node: its stage and replica, the run's layout, its peers.

Pure: every member computes the same assignment from the same (run spec, plan), which is what
lets the swarm train without anyone handing out roles.
"""

from dataclasses import dataclass

from fusionllm.common.errors import ConfigError
from fusionllm.common.run_spec import RunSpec
from fusionllm.dag.planner import Plan
from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.pipeline.train_config import TrainConfig, halves_from_plan, ratios_from_plan

VOTE_HEX_DIGITS = 12  # 48 bits of a digest: exact in a float64 summary slot


def plan_vote(digest: str) -> float:
    """A plan digest as a number that travels exactly in the runner's float64 summary."""
    try:
        return float(int(digest[:VOTE_HEX_DIGITS], 16))
    except ValueError as exc:
        raise ConfigError(f"not a hex digest: {digest!r}") from exc


@dataclass(frozen=True)
class Assignment:
    digest: str  # the plan's
    config: TrainConfig  # the run on the plan's layout
    peers: dict[Role, str]  # every process of the plan -> its peer id
    role: Role | None  # this node's; None: not in the plan (backup)
    ranges: tuple[tuple[int, int], ...]  # per stage: [start, stop) graph node positions

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(self.peers[r] for r in sorted(self.peers, key=lambda r: (r.stage, r.replica)))

    def others(self) -> dict[Role, str]:
        return {r: p for r, p in self.peers.items() if r != self.role}

    def role_of(self, peer: str) -> Role | None:
        return next((r for r, p in self.peers.items() if p == peer), None)


def assign(run: RunSpec, plan: Plan, digest: str, peer_id: str) -> Assignment:
    """This node's part of ``plan`` (raises ConfigError if the plan cannot run as asked)."""
    if not plan.stages:
        raise ConfigError("a plan without stages")
    if plan.micro_batches != run.micro_batches:
        raise ConfigError(
            f"the plan has {plan.micro_batches} micro-batches, the run {run.micro_batches}"
        )
    cuts = tuple(stage.start for stage in plan.stages[1:])
    replicas = tuple(len(stage.peers) for stage in plan.stages)
    forward, backward = ratios_from_plan(plan) if len(plan.stages) > 1 else ((), ())
    half_forward, half_backward = halves_from_plan(plan) if len(plan.stages) > 1 else ((), ())
    config = TrainConfig.for_run(
        run,
        cuts=cuts,
        replicas=replicas,
        activation_ratios=forward if any(r < 1.0 for r in forward) else (),
        gradient_ratios=backward if any(r < 1.0 for r in backward) else (),
        activation_halves=half_forward if any(half_forward) else (),
        gradient_halves=half_backward if any(half_backward) else (),
    )
    peers, role = {}, None
    for stage in plan.stages:
        for replica, peer in enumerate(stage.peers):
            peers[Role(stage.index, replica)] = peer
            if peer == peer_id:
                role = Role(stage.index, replica)
    if len(set(peers.values())) != len(peers):
        raise ConfigError("a peer serves twice in one plan")
    ranges = tuple((stage.start, stage.stop) for stage in plan.stages)
    return Assignment(digest=digest, config=config, peers=peers, role=role, ranges=ranges)
