"""``plan_for``: the plan a swarm's planning method (``PlanConfig.planner``) makes.

A swarm runs one method on every node (it is in the settings digest), so every method here is
deterministic: the same snapshot gives the same plan everywhere.

- "opfence":  ``planner.plan`` (fences, bottleneck cuts; AdaTopK unless compression is off)
- "balanced": ``baselines.compute_balanced_plan`` in peer-id order (links ignored, dense)
- "naive":    ``baselines.naive_plan`` in peer-id order (even layer split, dense)
"""

from fusionllm.dag.baselines import compute_balanced_plan, naive_plan
from fusionllm.dag.graph import GraphCosts
from fusionllm.dag.plan_records import PLANNERS, InfeasiblePlanError, Plan, PlanConfig
from fusionllm.dag.planner import plan
from fusionllm.dag.swarm import Swarm

# What a caller that plans by the swarm's method needs, from one place.
__all__ = ["PLANNERS", "InfeasiblePlanError", "Plan", "plan_for"]


def plan_for(graph: GraphCosts, swarm: Swarm, config: PlanConfig) -> Plan:
    """The plan of ``config.planner`` for ``swarm``; InfeasiblePlanError if none fits, or if
    the swarm has fewer than ``config.min_peers`` peers."""
    if swarm.n < config.min_peers:
        raise InfeasiblePlanError(f"{swarm.n} peers, the swarm waits for {config.min_peers}")
    if config.planner == "naive":
        return naive_plan(graph, swarm, config)
    if config.planner == "balanced":
        return compute_balanced_plan(graph, swarm, config)
    return plan(graph, swarm, config)
