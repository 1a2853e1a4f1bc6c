"""Plans to compare OP-Fence against, all built by planner.build_plan and timed by the simulator.

- naive_plan: peers in random order, dealt into S = min(peers, layers) stages, an even layer
  split, no compression.
- compute_balanced_plan: the same stage groups, cut to balance compute (memory respected),
  blind to bandwidth; no compression.
- brute_force_plan: every ordered sequence of disjoint peer groups (the rest in backup), each cut
  at its bottleneck optimum; exact over the plan space for small swarms (<= 8 peers).
"""

import itertools
import math
from dataclasses import replace

import numpy as np

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.dag.chain_cuts import _Chain, _make_unit, _Model, _solve_chain, _Unit
from fusionllm.dag.cost import LinkProfile
from fusionllm.dag.fences import group_links
from fusionllm.dag.graph import GraphCosts
from fusionllm.dag.plan_build import _infeasible, build_plan
from fusionllm.dag.plan_records import Plan, PlanConfig
from fusionllm.dag.swarm import Swarm

logger = get_logger(__name__)

BRUTE_FORCE_MAX_PEERS = 8


def layer_boundaries(graph: GraphCosts) -> list[int]:
    """Cut positions between "layers": where the fewest bytes cross (the residual stream)."""
    cuts = graph.cut_bytes()[1:-1]
    if not cuts:
        return []
    smallest = min(cuts)
    return [b + 1 for b, c in enumerate(cuts) if c == smallest]


def _random_groups(swarm: Swarm, stages: int, rng: np.random.Generator) -> list[list[str]]:
    order = [swarm.peer_ids[i] for i in rng.permutation(swarm.n)]
    return [list(chunk) for chunk in np.array_split(np.array(order, dtype=object), stages)]


def _even_cuts(graph: GraphCosts, stages: int) -> list[int]:
    layers = layer_boundaries(graph)
    n = len(graph.nodes)
    if len(layers) + 1 >= stages:
        step = (len(layers) + 1) / stages
        inner = [layers[round(i * step) - 1] for i in range(1, stages)]
    else:  # fewer layers than stages: split by node count
        inner = [round(i * n / stages) for i in range(1, stages)]
    return [0, *inner, n]


def _stage_count(graph: GraphCosts, swarm: Swarm) -> int:
    return max(1, min(swarm.n, len(layer_boundaries(graph)) + 1, len(graph.nodes)))


def naive_plan(
    graph: GraphCosts, swarm: Swarm, config: PlanConfig, rng: np.random.Generator
) -> Plan:
    """Random peer order, even layer split, dense tensors. May raise InfeasiblePlanError."""
    config = _without_compression(config)
    stages = _stage_count(graph, swarm)
    groups = _random_groups(swarm, stages, rng)
    return build_plan(graph, swarm, config, groups, _even_cuts(graph, stages), method="naive")


def compute_balanced_plan(
    graph: GraphCosts, swarm: Swarm, config: PlanConfig, rng: np.random.Generator
) -> Plan:
    """The naive groups, cut so that stage compute (not communication) is balanced."""
    config = _without_compression(config)
    model = _Model(graph, swarm, config)
    stages = _stage_count(graph, swarm)
    groups = _random_groups(swarm, stages, rng)
    units = [
        _blind(_make_unit(model, np.array(sorted(swarm.index(p) for p in g)), 0)) for g in groups
    ]
    free = np.full((stages, stages), np.inf)
    cuts = _solve_chain(_Chain(model, units, (free, free)))
    if cuts is None:
        cuts = _even_cuts(graph, stages)  # memory-infeasible anyway: let build_plan say why
    return build_plan(graph, swarm, config, groups, cuts, method="compute-balanced", _model=model)


def _blind(unit: _Unit) -> _Unit:
    """The unit with free gradient averaging: the compute-balanced split ignores networks."""
    free = LinkProfile(bandwidth=math.inf, rtt=0.0)
    return replace(unit, allreduce=free)


def _without_compression(config: PlanConfig) -> PlanConfig:
    return replace(config, compression=False)


def brute_force_plan(
    graph: GraphCosts, swarm: Swarm, config: PlanConfig, *, incumbent: Plan | None = None
) -> Plan:
    """The best plan over every sequence of disjoint peer groups (branch and bound).

    Sequences are grown from the last stage backwards, so a stage's in-flight micro-batches
    (its distance from the end) are known when it is added; V[a] = best bottleneck of a suffix
    covering nodes[a:]. Every complete sequence whose bottleneck and latency floor are below
    the best simulated step so far is cut like OP-Fence cuts its chains and simulated; a
    suffix whose best value already reaches it is not extended (values only grow). Exact over
    this plan space up to the cut (bottleneck-optimal, as in OP-Fence), in simulated time.

    ``incumbent`` (any valid plan for the same inputs, e.g. OP-Fence's) only sets the bar to
    beat from the start, so pruning bites at once; it is returned if nothing beats it.
    """
    if swarm.n > BRUTE_FORCE_MAX_PEERS:
        raise ConfigError(f"brute force is for <= {BRUTE_FORCE_MAX_PEERS} peers, got {swarm.n}")
    model = _Model(graph, swarm, config)
    n, nodes, m = swarm.n, model.n, config.micro_batches
    a_idx, b_idx = np.triu_indices(nodes + 1, k=1)
    stage_cache: dict[tuple[int, int], np.ndarray] = {}
    link_cache: dict[tuple[int, int], np.ndarray] = {}

    def members(mask: int) -> np.ndarray:
        return np.array([i for i in range(n) if mask >> i & 1], dtype=np.int64)

    def stage_matrix(mask: int, inflight: int) -> np.ndarray:
        key = (mask, min(inflight, m))
        if key not in stage_cache:
            chain = _Chain(model, [_make_unit(model, members(mask), 0)] * key[1], _no_links(key[1]))
            occ, ok = chain.stage(0, a_idx, b_idx)
            cost = np.full((nodes + 1, nodes + 1), np.inf)
            cost[a_idx, b_idx] = np.where(ok, occ, np.inf)
            stage_cache[key] = cost
        return stage_cache[key]

    def link_vector(src: int, dst: int) -> np.ndarray:
        if (src, dst) not in link_cache:
            _, _, fwd, bwd = model.best_pair(members(src), members(dst))
            occ = m * model.wire / min(fwd.bandwidth, bwd.bandwidth)
            occ[0] = occ[nodes] = np.inf  # every stage gets at least one node
            link_cache[(src, dst)] = occ
        return link_cache[(src, dst)]

    ids = swarm.peer_ids
    best: list[Plan] = [incumbent] if incumbent is not None else []

    def bar() -> float:
        return best[0].estimated_step_time if best else math.inf

    def latency_floor(seq: tuple[int, ...]) -> float:
        """1F1B keeps at most S micro-batches in flight at stage 0, and each must go down the
        chain and back before the next round starts: ceil(M/S) round trips of latency."""
        trip = 0.0
        for src, dst in itertools.pairwise(seq):
            _, _, fwd, bwd = model.best_pair(members(src), members(dst))
            trip += (fwd.rtt + bwd.rtt) / 2
        return math.ceil(m / len(seq)) * trip

    def evaluate(seq: tuple[int, ...]) -> None:
        units = [_make_unit(model, members(mask), i) for i, mask in enumerate(seq)]
        cuts = _solve_chain(_Chain(model, units, group_links(swarm, [u.members for u in units])))
        if cuts is None:
            return
        groups = [[ids[i] for i in u.members] for u in units]
        plan = build_plan(graph, swarm, config, groups, cuts, method="brute-force", _model=model)
        step = plan.estimated_step_time
        # Digests (canonical JSON of the whole plan) only break exact ties: they are costly.
        if not best or step < bar() or (step == bar() and plan.digest() < best[0].digest()):
            best[:] = [plan]

    def extend(seq: tuple[int, ...], used: int, value: np.ndarray) -> None:
        # The simulated step is never below the bottleneck nor the latency floor: prune on both.
        if np.isfinite(value[0]) and max(float(value[0]), latency_floor(seq)) < bar():
            evaluate(seq)
        if value.min() >= bar():
            return
        free = ((1 << n) - 1) & ~used
        sub = free
        while sub:
            cost = stage_matrix(sub, len(seq) + 1)
            through = np.maximum(link_vector(sub, seq[0]), value)  # indexed by b
            new = np.maximum(cost, through[None, :]).min(axis=1)
            if new.min() < bar():
                extend((sub, *seq), used | sub, new)
            sub = (sub - 1) & free

    # Big groups first: good incumbents early make the pruning bite.
    full = (1 << n) - 1
    for sub in sorted(range(1, full + 1), key=lambda x: (-bin(x).count("1"), x)):
        extend((sub,), sub, stage_matrix(sub, 1)[:, nodes].copy())
    if not best:
        raise _infeasible(model, 0)
    return best[0]


def _no_links(stages: int) -> tuple[np.ndarray, np.ndarray]:
    free = np.full((stages, stages), np.inf)
    return free, free
