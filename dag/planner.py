"""OP-Fence: turn a GraphCosts and a Swarm into a Plan (fences, stages, replicas, compression).

Search (every step deterministic; ties broken by peer index, which is peer-id order):
1. fences.max_spanning_forest clusters peers; for each candidate threshold we get fences.
2. Peers much slower than their fence's fastest go to the backup pool; fences are ranked by
   aggregate FLOP/s and the top ``keep`` of them are ordered into a chain (max bottleneck link).
3. A fence may host several consecutive stages (a site whose devices cannot hold the whole
   model pipelines inside itself); stages are allotted to fences in proportion to compute.
4. For each such chain of stage groups, in both directions (stage 0 holds the most micro-batches
   in flight, the ends hold the embedding and the head), ``_solve_chain`` finds the cut
   minimising the bottleneck
   max(M * stage compute + all-reduce, M * link serialisation) under the per-device memory
   constraint, by bisection on the bottleneck with a reachable-boundaries sweep (exact for a
   bottleneck objective because a stage's cost only grows when it takes more nodes).
5. Every candidate becomes a Plan through ``build_plan`` and is timed by the simulator; the
   fastest wins (ties: lowest digest). Baselines use the same ``build_plan`` and simulator.

Memory per device of a stage s of S: (params + grads + optimizer state) of the stage, plus
min(S - s, M) in-flight micro-batches of saved activations (the sum of the stage's
``peak_activation_bytes`` and its input cut, for its share of each micro-batch), plus the
stage's largest single output as a transient.

Where the parts live (this module keeps the search and re-exports the rest):

- plan_records.py: ``PlanConfig``, ``Plan``, ``StagePlan``, ``LinkPlan``, ``pipeline_times``,
  ``InfeasiblePlanError``
- chain_cuts.py:   the cost model (``_Model``, ``_Unit``, ``_Chain``) and the cut ``_solve_chain``
- plan_build.py:   ``build_plan`` (groups and cuts -> a timed Plan)
- planner.py:      ``plan``: fences, chains, stage counts, pruning
"""

import math

import numpy as np

from fusionllm.common.logs import get_logger
from fusionllm.dag.chain_cuts import _PRUNE_SAFETY, _Chain, _make_unit, _Model, _solve_chain, _Unit
from fusionllm.dag.fences import (
    candidate_thresholds,
    fences_at,
    group_links,
    max_spanning_forest,
    order_chain,
)
from fusionllm.dag.graph import GraphCosts
from fusionllm.dag.plan_build import _infeasible, build_plan
from fusionllm.dag.plan_records import (
    InfeasiblePlanError,
    LinkPlan,
    Plan,
    PlanConfig,
    StagePlan,
    pipeline_times,
)
from fusionllm.dag.swarm import Swarm

__all__ = [
    "InfeasiblePlanError",
    "LinkPlan",
    "Plan",
    "PlanConfig",
    "StagePlan",
    "build_plan",
    "pipeline_times",
    "plan",
]

logger = get_logger(__name__)


def _allot(compute: np.ndarray, sizes: np.ndarray, total: int) -> np.ndarray | None:
    """Stages per fence, proportional to compute (largest remainder), each in [1, size]."""
    k = compute.size
    if total < k or total > sizes.sum():
        return None
    alloc = np.ones(k, dtype=np.int64)
    for _ in range(total - k):
        room = alloc < sizes
        # Give the next stage to the fence with the most compute per stage.
        score = np.where(room, compute / alloc, -1.0)
        alloc[int(np.argmax(score))] += 1
    return alloc


def _split(members: np.ndarray, flops: np.ndarray, parts: int) -> list[np.ndarray]:
    """Deal members into ``parts`` groups of near-equal compute (snake order by speed)."""
    order = members[np.lexsort((members, -flops[members]))]
    groups: list[list[int]] = [[] for _ in range(parts)]
    for i, m in enumerate(order.tolist()):
        lap, pos = divmod(i, parts)
        groups[pos if lap % 2 == 0 else parts - 1 - pos].append(m)
    return [np.array(sorted(g), dtype=np.int64) for g in groups]


def _stage_counts(k: int, limit: int) -> list[int]:
    counts = []
    for factor in (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
        total = math.ceil(k * factor)
        if total > limit:
            break
        if total not in counts:
            counts.append(total)
    return counts


def plan(graph: GraphCosts, swarm: Swarm, config: PlanConfig | None = None) -> Plan:
    """The OP-Fence plan for training ``graph`` on ``swarm``; raises InfeasiblePlanError."""
    config = config or PlanConfig()
    if config.min_stages > swarm.n:
        raise InfeasiblePlanError(
            f"min_stages {config.min_stages} needs as many peers, the swarm has {swarm.n}"
        )
    search = _Search(graph, swarm, config)
    forest = max_spanning_forest(swarm)
    flops = search.flops
    thresholds = candidate_thresholds(forest, config.fence_levels)
    if swarm.n > config.max_stages:
        thresholds = thresholds[:-1]  # every peer its own fence: more fences than stages
    # Collect every (threshold, top-k fences) candidate with a lower bound on its step time,
    # then try them best-bound first so that weak candidates are pruned unopened.
    candidates: dict[tuple, tuple[float, list[np.ndarray]]] = {}
    for threshold in thresholds:
        fences = fences_at(forest, threshold)
        # Peers far slower than their fence's fastest would only add stragglers: backup.
        fences = [f[flops[f] >= config.min_relative_speed * flops[f].max()] for f in fences]
        compute = np.array([flops[f].sum() for f in fences])
        rank = sorted(range(len(fences)), key=lambda i: (-compute[i], int(fences[i][0])))
        rank = rank[: config.max_stages]
        fences = [fences[i] for i in rank]
        sym = np.minimum(*(lambda bw: (bw, bw.T))(group_links(swarm, fences)[0]))
        k_all = len(fences)
        keeps = {k for k in (1, 2, 3, 4, k_all - 1, k_all) if 1 <= k <= k_all}
        keeps |= {k for k in (6, 8, 12, 16, 24, 32, 48, 64) if k <= k_all}
        for keep in sorted(keeps, reverse=True):
            key = tuple(tuple(f.tolist()) for f in fences[:keep])
            if key not in candidates:
                bound = _lower_bound(search.model, fences[:keep], sym[:keep, :keep])
                candidates[key] = (bound, fences[:keep])
    for key in sorted(candidates, key=lambda k: (candidates[k][0], k)):
        bound, chosen = candidates[key]
        if bound >= search.best_time:
            break
        search.try_fences(chosen)
    if search.best is None:
        raise _infeasible(search.model, search.tried)
    best = search.best
    logger.debug(
        "planned %d stages, step %.4gs over %d candidate chains (%d pruned unbuilt)",
        len(best.stages),
        best.estimated_step_time,
        search.tried,
        search.pruned,
    )
    return best


class _Search:
    """Candidate chains tried so far and the best plan among them."""

    def __init__(self, graph: GraphCosts, swarm: Swarm, config: PlanConfig) -> None:
        self.graph, self.swarm, self.config = graph, swarm, config
        self.model = _Model(graph, swarm, config)
        self.flops = np.array([p.device.flops for p in swarm.peers])
        self.best: Plan | None = None
        self.tried = 0
        self.pruned = 0
        # Cuts (or None) and their floor by the chain's members: different fence sets often
        # give the same chain (62 tries, 42 chains, for topology C's five peers).
        self._solved: dict[tuple, tuple[list[int] | None, float]] = {}
        self._built: dict[tuple, float] = {}  # step times of plans built, by chain and fences

    @property
    def best_time(self) -> float:
        return self.best.estimated_step_time if self.best is not None else math.inf

    def try_fences(self, chosen: list[np.ndarray]) -> None:
        """Order fences into a chain; try growing stage counts while the step time improves."""
        bw, _ = group_links(self.swarm, chosen)
        order = order_chain(bw)
        chain_fences = [chosen[i] for i in order]
        fence_compute = np.array([self.flops[f].sum() for f in chain_fences])
        sizes = np.array([f.size for f in chain_fences])
        previous, worse = math.inf, 0
        for total in _stage_counts(len(chosen), min(self.config.max_stages, self.model.n)):
            alloc = None if total < self.config.min_stages else _allot(fence_compute, sizes, total)
            if alloc is None:
                continue
            step = None
            for groups in self._stage_groups(chain_fences, alloc):
                units = [_make_unit(self.model, g, f) for f, g in groups]
                # Both directions: stage 0 holds the most micro-batches in flight and the
                # ends hold the embedding and the head, so which unit goes first matters.
                for candidate in (units, units[::-1]):
                    result = self._try_units(candidate, chain_fences)
                    if result is not None and (step is None or result < step):
                        step = result
            if step is None:
                continue  # too few stages to fit in memory: more stages may fit
            # Step time is roughly unimodal in the stage count (more compute and memory vs
            # more links and bubbles): stop after two steps that did not improve.
            worse = worse + 1 if step >= previous else 0
            previous = min(previous, step)
            if worse >= 2:
                break

    def _stage_groups(
        self, chain_fences: list[np.ndarray], alloc: np.ndarray
    ) -> list[list[tuple[int, np.ndarray]]]:
        """Ways to deal each fence's members into its stages: all of them, speed-balanced;
        and, where replicas would be thin (fewer than two per stage), only the fastest member
        per stage, the rest left in backup: a slow replica and its gradient averaging can
        cost more than it adds (found by brute force on 6-peer swarms)."""
        cap = self.config.max_replicas
        chain_fences = [
            members[np.lexsort((members, -self.flops[members]))][: int(parts) * cap]
            for members, parts in zip(chain_fences, alloc, strict=True)
        ]
        dealt = [
            (f, group)
            for f, (members, parts) in enumerate(zip(chain_fences, alloc, strict=True))
            for group in _split(members, self.flops, int(parts))
        ]
        options = [dealt]
        if any(
            parts < members.size < 2 * parts
            for members, parts in zip(chain_fences, alloc, strict=True)
        ):
            fastest = [
                (f, np.array([m], dtype=np.int64))
                for f, (members, parts) in enumerate(zip(chain_fences, alloc, strict=True))
                for m in sorted(members[np.lexsort((members, -self.flops[members]))][:parts])
            ]
            options.append(fastest)
        return options

    def _solve(self, units: list[_Unit], key: tuple) -> tuple[list[int] | None, float]:
        """The chain's cuts (None: memory cannot be met) and the floor under its step time:
        every stage is busy at least its occupancy per step, and links carry at least their
        most compressed bytes. ``key``: the chain's members, unit by unit."""
        if key not in self._solved:
            links = group_links(self.swarm, [u.members for u in units])
            chain = _Chain(self.model, units, links)
            cuts = _solve_chain(chain)
            floor = math.inf if cuts is None else _PRUNE_SAFETY * chain.bottleneck(cuts)
            self._solved[key] = (cuts, floor)
        return self._solved[key]

    def _try_units(self, units: list[_Unit], chain_fences: list[np.ndarray]) -> float | None:
        chain_key = tuple(tuple(u.members.tolist()) for u in units)
        cuts, floor = self._solve(units, chain_key)
        self.tried += 1
        if cuts is None:
            return None
        # A chain whose bottleneck already loses is not worth a plan.
        if floor > self.best_time:
            self.pruned += 1
            return floor
        built = (chain_key, tuple(tuple(f.tolist()) for f in chain_fences))
        if built in self._built:  # the same plan again: it can change nothing
            return self._built[built]
        ids = self.swarm.peer_ids
        candidate = build_plan(
            self.graph,
            self.swarm,
            self.config,
            [[ids[i] for i in u.members] for u in units],
            cuts,
            fences=[[ids[i] for i in f] for f in chain_fences],
            _model=self.model,
        )
        step = self._built[built] = candidate.estimated_step_time
        if step < self.best_time or (
            step == self.best_time and self.best is not None
            and candidate.digest() < self.best.digest()
        ):  # fmt: skip
            self.best = candidate
        return step


def _lower_bound(model: _Model, fences: list[np.ndarray], sym: np.ndarray) -> float:
    """No plan over these fences beats perfectly balanced compute (M / sum of speeds), nor
    the slowest link its chain must use: every fence has a chain neighbour, so the chain's
    slowest link is at most min over fences of the fence's best link to the others."""
    members = np.concatenate(fences)
    speed = (1.0 / model.total[model.peer_profile[members], model.n]).sum()
    bound = model.config.micro_batches / speed
    if len(fences) > 1 and model.n > 1:
        best_link = np.where(np.isinf(sym), 0.0, sym).max(axis=1).min()
        bound = max(bound, model.config.micro_batches * model.wire[1:-1].min() / best_link)
    return _PRUNE_SAFETY * bound
