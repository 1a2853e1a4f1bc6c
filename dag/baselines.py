"""Plans to compare OP-Fence against, all built by planner.build_plan and timed by the simulator.

- naive_plan: peers in random order (or in peer-id order, as a swarm setting wants: every node
  must make the same plan), dealt into S = min(peers, layers, max_stages) stages, an even
  layer split, no compression.
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


def _groups(swarm: Swarm, stages: int, rng: np.random.Generator | None) -> list[list[str]]:
    """Peers dealt into ``stages`` consecutive groups: in random order, or with no ``rng`` in
    peer-id order (deterministic, so every node of a swarm makes the same plan)."""
    if rng is None:
        order = sorted(swarm.peer_ids)
    else:
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


def _stage_count(graph: GraphCosts, swarm: Swarm, config: PlanConfig) -> int:
    most = min(swarm.n, len(layer_boundaries(graph)) + 1, len(graph.nodes), config.max_stages)
    return max(1, most)


def naive_plan(
    graph: GraphCosts, swarm: Swarm, config: PlanConfig, rng: np.random.Generator | None = None
) -> Plan:
    """Random (no ``rng``: peer-id) order, even layer split, dense tensors. May raise
    InfeasiblePlanError."""
    config = _without_compression(config)
    stages = _stage_count(graph, swarm, config)
    groups = _groups(swarm, stages, rng)
    return build_plan(graph, swarm, config, groups, _even_cuts(graph, stages), method="naive")


def compute_balanced_plan(
    graph: GraphCosts, swarm: Swarm, config: PlanConfig, rng: np.random.Generator | None = None
) -> Plan:
    """The naive groups, cut so that stage compute (not communication) is balanced."""
    config = _without_compression(config)
    model = _Model(graph, swarm, config)
    stages = _stage_count(graph, swarm, config)
    groups = _groups(swarm, stages, rng)
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
    search = _BruteForce(graph, swarm, config, incumbent)
    # Big groups first: good incumbents early make the pruning bite.
    full = (1 << swarm.n) - 1
    for sub in sorted(range(1, full + 1), key=lambda x: (-bin(x).count("1"), x)):
        search.extend((sub,), sub, search.stage_matrix(sub, 1)[:, search.nodes].copy())
    if search.best is None:
        raise _infeasible(search.model, 0)
    return search.best


class _BruteForce:
    """The branch and bound of ``brute_force_plan``: sequences of peer-group bit masks (stage
    order), cached stage and link costs, and the best plan so far."""

    def __init__(
        self, graph: GraphCosts, swarm: Swarm, config: PlanConfig, incumbent: Plan | None
    ) -> None:
        self.graph, self.swarm, self.config = graph, swarm, config
        self.model = _Model(graph, swarm, config)
        self.n, self.nodes, self.m = swarm.n, self.model.n, config.micro_batches
        self.a_idx, self.b_idx = np.triu_indices(self.nodes + 1, k=1)
        self._stage_cache: dict[tuple[int, int], np.ndarray] = {}
        self._link_cache: dict[tuple[int, int], np.ndarray] = {}
        self.best: Plan | None = incumbent

    @property
    def bar(self) -> float:
        return self.best.estimated_step_time if self.best is not None else math.inf

    def members(self, mask: int) -> np.ndarray:
        return np.array([i for i in range(self.n) if mask >> i & 1], dtype=np.int64)

    def stage_matrix(self, mask: int, inflight: int) -> np.ndarray:
        """cost[a, b]: the occupancy of group ``mask`` on nodes[a:b] with ``inflight``
        micro-batches in flight (inf where it does not fit)."""
        key = (mask, min(inflight, self.m))
        if key not in self._stage_cache:
            model, nodes = self.model, self.nodes
            units = [_make_unit(model, self.members(mask), 0)] * key[1]
            chain = _Chain(model, units, _no_links(key[1]))
            occ, ok = chain.stage(0, self.a_idx, self.b_idx)
            cost = np.full((nodes + 1, nodes + 1), np.inf)
            cost[self.a_idx, self.b_idx] = np.where(ok, occ, np.inf)
            self._stage_cache[key] = cost
        return self._stage_cache[key]

    def link_vector(self, src: int, dst: int) -> np.ndarray:
        """occ[b]: the link from group ``src`` to ``dst`` carrying cut b, per step."""
        if (src, dst) not in self._link_cache:
            _, _, fwd, bwd = self.model.best_pair(self.members(src), self.members(dst))
            occ = self.m * self.model.wire / min(fwd.bandwidth, bwd.bandwidth)
            occ[0] = occ[self.nodes] = np.inf  # every stage gets at least one node
            self._link_cache[(src, dst)] = occ
        return self._link_cache[(src, dst)]

    def latency_floor(self, seq: tuple[int, ...]) -> float:
        """1F1B keeps at most S micro-batches in flight at stage 0, and each must go down the
        chain and back before the next round starts: ceil(M/S) round trips of latency."""
        trip = 0.0
        for src, dst in itertools.pairwise(seq):
            _, _, fwd, bwd = self.model.best_pair(self.members(src), self.members(dst))
            trip += (fwd.rtt + bwd.rtt) / 2
        return math.ceil(self.m / len(seq)) * trip

    def evaluate(self, seq: tuple[int, ...]) -> None:
        model, swarm, ids = self.model, self.swarm, self.swarm.peer_ids
        units = [_make_unit(model, self.members(mask), i) for i, mask in enumerate(seq)]
        cuts = _solve_chain(_Chain(model, units, group_links(swarm, [u.members for u in units])))
        if cuts is None:
            return
        groups = [[ids[i] for i in u.members] for u in units]
        plan = build_plan(
            self.graph, swarm, self.config, groups, cuts, method="brute-force", _model=model
        )
        step = plan.estimated_step_time
        # Digests (canonical JSON of the whole plan) only break exact ties: they are costly.
        if (
            self.best is None
            or step < self.bar
            or (step == self.bar and plan.digest() < self.best.digest())
        ):
            self.best = plan

    def extend(self, seq: tuple[int, ...], used: int, value: np.ndarray) -> None:
        # The simulated step is never below the bottleneck nor the latency floor: prune on both.
        if np.isfinite(value[0]) and max(float(value[0]), self.latency_floor(seq)) < self.bar:
            self.evaluate(seq)
        if value.min() >= self.bar:
            return
        free = ((1 << self.n) - 1) & ~used
        sub = free
        while sub:
            cost = self.stage_matrix(sub, len(seq) + 1)
            through = np.maximum(self.link_vector(sub, seq[0]), value)  # indexed by b
            new = np.maximum(cost, through[None, :]).min(axis=1)
            if new.min() < self.bar:
                self.extend((sub, *seq), used | sub, new)
            sub = (sub - 1) & free


def _no_links(stages: int) -> tuple[np.ndarray, np.ndarray]:
    free = np.full((stages, stages), np.inf)
    return free, free
