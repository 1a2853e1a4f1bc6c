"""What a plan switch costs beyond the step times: moving the stages' state to new holders.

A switch between plans applies between steps, with each stage's parameters and optimizer state
moved peer to peer (gradients are not moved: they are made again). Over a home uplink that is
minutes: GPT-2 small's 124 M parameters with AdamW's two moments are ~1.5 GB, ten minutes at
20 Mbit/s. A switch therefore pays for itself only if the new plan's faster steps win that time
back within the steps it is expected to run: ``switch_gain`` compares the two on that horizon.

``state_transfer_time`` is pure: the same plans and snapshot give the same seconds everywhere.
Receivers fetch in parallel; one receiver fetches its pieces one after another (they share its
downlink), each piece from the holder with the fastest link towards it.
"""

import math
from dataclasses import dataclass

from fusionllm.common.errors import ConfigError
from fusionllm.dag.graph import GraphCosts
from fusionllm.dag.plan_records import Plan, PlanConfig
from fusionllm.dag.swarm import Swarm


@dataclass(frozen=True, kw_only=True)
class SwitchPolicy:
    """How a node weighs a switch: the moved state's time is spread over ``horizon_steps``."""

    # Steps a new plan is expected to run before the swarm changes again. Short enough that a
    # plan moving minutes of state must save real time per step, long enough that a clearly
    # better plan still wins (checkpoints every 20 steps; runs of hundreds to thousands).
    horizon_steps: int = 200

    def __post_init__(self) -> None:
        if not isinstance(self.horizon_steps, int) or self.horizon_steps < 1:
            raise ConfigError(f"horizon_steps must be an integer >= 1, got {self.horizon_steps!r}")


def _ranges(plan: Plan) -> dict[str, tuple[int, int]]:
    """peer -> the [start, stop) of graph nodes it holds in ``plan``."""
    return {peer: (s.start, s.stop) for s in plan.stages for peer in s.peers}


def state_transfer_time(
    old: Plan, new: Plan, graph: GraphCosts, swarm: Swarm, config: PlanConfig
) -> float:
    """Seconds until every peer of ``new`` holds the state of its stage, fetched from the peers
    that hold it under ``old`` (parameters and optimizer state, ``PlanConfig`` byte factors).

    A piece no live holder has (its holders left the swarm) is not counted: every plan must
    restore it from elsewhere alike, so it does not tell two plans apart.
    """
    per_byte = 1.0 + config.optimizer_bytes_per_param_byte
    live = set(swarm.peer_ids)
    held = {peer: r for peer, r in _ranges(old).items() if peer in live}
    slowest = 0.0
    for peer, (start, stop) in _ranges(new).items():
        if peer not in live:
            raise ConfigError(f"plan seats {peer[:16]}..., who is not in the swarm")
        dst = swarm.index(peer)
        mine = held.get(peer, (0, 0))
        seconds = 0.0
        for node in range(start, stop):
            if mine[0] <= node < mine[1]:
                continue
            nbytes = graph.nodes[node].param_bytes * per_byte
            if nbytes <= 0:
                continue
            sources = [swarm.index(p) for p, (a, b) in held.items() if a <= node < b]
            if sources:
                seconds += min(nbytes / swarm.link(src, dst).bandwidth for src in sources)
        slowest = max(slowest, seconds)
    return slowest


def amortised_switch_s(transfer_s: float, policy: SwitchPolicy) -> float:
    """The moved state's seconds as a per-step cost over the policy's horizon."""
    if not (math.isfinite(transfer_s) and transfer_s >= 0):
        raise ConfigError(f"transfer time must be finite and >= 0, got {transfer_s}")
    return transfer_s / policy.horizon_steps
