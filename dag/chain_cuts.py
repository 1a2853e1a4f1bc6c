"""The planner's cost model of a chain of stage groups, and the cut that balances it.

- ``_Model``: prefix sums of the graph's costs per distinct device profile, scaled to a
  micro-batch (compute, parameters, saved activations, cut bytes, peak outputs), and cached
  group links (all-reduce trees, best pairs)
- ``_Unit``, ``_make_unit``: a group of peers that runs one stage as data-parallel replicas
- ``_Chain``: a fixed chain of units; a stage's per-step occupancy (compute and its dense
  frames' CPU, as build_plan charges them) and memory feasibility for many boundaries at
  once, reachable boundaries under a bottleneck limit
- ``_solve_chain``: stage boundaries minimising the bottleneck (bisection on the bottleneck with
  a reachable-boundaries sweep)
- ``_best_pair``: the peer pair that carries a link between two groups

The names stay private to ``fusionllm.dag``: the planner and the baselines share them.
"""

import math
from dataclasses import dataclass

import numpy as np

from fusionllm.common.errors import ConfigError
from fusionllm.dag.cost import (
    DeviceProfile,
    LinkProfile,
    min_wire_bytes,
    node_time,
    stage_frames,
)
from fusionllm.dag.fences import group_allreduce_link
from fusionllm.dag.graph import GraphCosts
from fusionllm.dag.plan_records import PlanConfig
from fusionllm.dag.swarm import Swarm

_BALANCE_BAND = math.log(1.25)  # a stage within 25% of its fair share counts as balanced
_PRUNE_SAFETY = 0.98  # bounds are compared with this slack against float noise


def _range_max_table(values: np.ndarray) -> np.ndarray:
    """Sparse table for range max: row j holds max(values[i : i + 2**j]), padded with 0."""
    rows = [values]
    width = 1
    while 2 * width <= values.size:
        prev = rows[-1]
        rows.append(np.maximum(prev[:-width], prev[width:]))
        width *= 2
    table = np.zeros((len(rows), values.size))
    for j, row in enumerate(rows):
        table[j, : row.size] = row
    return table


class _Model:
    """Prefix sums of the graph's costs per distinct device profile, scaled to a micro-batch."""

    def __init__(self, graph: GraphCosts, swarm: Swarm, config: PlanConfig) -> None:
        if not graph.nodes:
            raise ConfigError("the graph has no nodes")
        self.graph, self.swarm, self.config = graph, swarm, config
        self.n = len(graph.nodes)
        # Spanning trees and best pairs of peer groups, reused across candidate chains.
        self._allreduce_links: dict[tuple[int, ...], LinkProfile] = {}
        self._pairs: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple] = {}
        scale = config.scale
        profiles: dict[DeviceProfile, int] = {}
        for peer in swarm.peers:
            profiles.setdefault(peer.device, len(profiles))
        self.profiles = list(profiles)
        self.peer_profile = np.array([profiles[p.device] for p in swarm.peers], dtype=np.int64)
        p_count = len(self.profiles)
        fwd = np.zeros((p_count, self.n + 1))
        bwd = np.zeros((p_count, self.n + 1))
        for p, device in enumerate(self.profiles):
            times = [node_time(node, device, scale=scale) for node in graph.nodes]
            fwd[p, 1:] = np.cumsum([t.forward for t in times])
            bwd[p, 1:] = np.cumsum([t.backward for t in times])
        self.fwd, self.bwd = fwd, bwd
        self.total = fwd + bwd
        self.memory = np.array([d.memory_bytes * config.memory_fraction for d in self.profiles])
        self._frame_terms(config)
        self.params = np.concatenate([[0.0], np.cumsum([n.param_bytes for n in graph.nodes])])
        # Saved for backward, per micro-batch (see OpNode.peak_activation_bytes).
        self.acts = np.concatenate(
            [[0.0], np.cumsum([n.peak_activation_bytes * scale for n in graph.nodes])]
        )
        self.cut = np.array(graph.cut_bytes(), dtype=np.float64) * scale
        if config.compression:
            self.wire = np.array(
                [
                    min_wire_bytes(
                        int(c), min_ratio=config.min_ratio, element_size=config.element_size
                    )
                    for c in self.cut
                ],
                dtype=np.float64,
            )
        else:
            self.wire = self.cut.copy()
        # A cut the runtime cannot ship costs infinite bytes: no feasible chain uses it.
        forbidden = sorted(graph.uncuttable)
        self.cut[forbidden] = np.inf
        self.wire[forbidden] = np.inf
        # The largest single output a stage makes is live on top of what is saved.
        self._peak_table = _range_max_table(
            np.array([n.output_bytes * scale for n in graph.nodes], dtype=np.float64)
        )

    def _frame_terms(self, config: PlanConfig) -> None:
        """Per profile, the CPU one side of a link pays per frame (0: not measured): a dense
        frame, and a top-k frame's constant and rate per dense byte (cost.topk_charge)."""
        self.frame_cost = np.array([d.frame_overhead for d in self.profiles])
        self.topk_frame = np.array([d.topk_frame_overhead for d in self.profiles])
        self.topk_byte = np.array([d.topk_byte_cost for d in self.profiles])
        # Top-k frames cost more than dense ones only where some device measured a frame.
        self.charges_topk = bool(
            (self.frame_cost.any() and config.topk_frame_factor > 1.0)
            or self.topk_frame.any()
            or self.topk_byte.any()
        )

    def peak(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """max output_bytes over nodes[a:b] (b > a), vectorised sparse-table query."""
        length = np.maximum(b - a, 1)
        level = np.frexp(length)[1] - 1  # floor(log2(length)), exact for integers
        table = self._peak_table
        return np.maximum(table[level, a], table[level, b - (1 << level)])

    def allreduce_link(self, members: np.ndarray) -> LinkProfile:
        key = tuple(members.tolist())
        if key not in self._allreduce_links:
            self._allreduce_links[key] = group_allreduce_link(self.swarm, members)
        return self._allreduce_links[key]

    def best_pair(self, a: np.ndarray, b: np.ndarray) -> tuple:
        key = (tuple(a.tolist()), tuple(b.tolist()))
        if key not in self._pairs:
            self._pairs[key] = _best_pair(self.swarm, a, b)
        return self._pairs[key]


@dataclass(frozen=True)
class _Unit:
    """A group of peers that will run one stage as data-parallel replicas."""

    members: np.ndarray
    fence: int
    profiles: np.ndarray  # distinct profile ids present
    counts: np.ndarray  # members per profile
    allreduce: LinkProfile
    total: np.ndarray  # (P, N + 1) prefix sums of fwd+bwd time per present profile
    memory: np.ndarray  # (P, 1) usable bytes per present profile
    frame_cost: np.ndarray  # (P,) CPU seconds per tensor frame per present profile


def _make_unit(model: _Model, members: np.ndarray, fence: int) -> _Unit:
    profiles, counts = np.unique(model.peer_profile[members], return_counts=True)
    return _Unit(
        members,
        fence,
        profiles,
        counts.astype(np.float64),
        model.allreduce_link(members),
        model.total[profiles],
        model.memory[profiles][:, None],
        model.frame_cost[profiles],
    )


# ----------------------------------------------------------------------------- the cut DP


# A chain's stage costs for every (a, b) pair at once, where the model has few enough nodes:
# the bisection then looks them up. Each ``stage_full`` call costs ~0.1 ms of numpy calls on
# small arrays, and a tiny model's plan made ~2000 of them (0.25 of its 0.5 s of CPU, which a
# 0.2-core home pays at five times the wall time: docs/testbed.md, session 13).
_TABLE_MAX_PAIRS = 1 << 16


class _Chain:
    """Costs of a fixed chain of units; evaluates stage k on many (a, b) pairs at once."""

    def __init__(self, model: _Model, units: list[_Unit], links: tuple[np.ndarray, np.ndarray]):
        self.model, self.units = model, units
        bw, _ = links
        s = len(units)
        self.s = s
        m = model.config.micro_batches
        # Per-step serialisation time of cut b on link k, the slower direction.
        self.link_occupancy = [
            m * model.wire / min(bw[k, k + 1], bw[k + 1, k]) for k in range(s - 1)
        ]
        self._tabulate = (model.n + 1) ** 2 <= _TABLE_MAX_PAIRS
        self._tables: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def stage(self, k: int, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(per-step occupancy, feasible) of unit k running nodes[a:b] (arrays, b > a)."""
        occupancy, ok, _ = self.stage_full(k, a, b)
        return occupancy, ok

    def stage_full(
        self, k: int, a: np.ndarray, b: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(per-step occupancy, feasible, per-micro-batch compute) of unit k on nodes[a:b]."""
        if not self._tabulate:
            return self._stage_costs(k, a, b)
        if k not in self._tables:
            self._tables[k] = self._table(k)
        occupancy, ok, per_mb = self._tables[k]
        return occupancy[a, b], ok[a, b], per_mb[a, b]

    def _table(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``_stage_costs`` of unit k for every a < b, as (N + 1, N + 1) matrices. Each pair's
        figures are computed elementwise, so a lookup equals the direct computation."""
        size = self.model.n + 1
        a, b = np.triu_indices(size, 1)
        occupancy, ok, per_mb = self._stage_costs(k, a, b)
        tables = (np.full((size, size), np.inf), np.zeros((size, size), dtype=bool),
                  np.full((size, size), np.inf))  # fmt: skip
        for table, values in zip(tables, (occupancy, ok, per_mb), strict=True):
            table[a, b] = values
        return tables

    def _stage_costs(
        self, k: int, a: np.ndarray, b: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        model, unit, cfg = self.model, self.units[k], self.model.config
        inflight = min(self.s - k, cfg.micro_batches)
        t = np.maximum(unit.total[:, b] - unit.total[:, a], 1e-300)  # (P, L)
        static = (model.params[b] - model.params[a]) * cfg.static_factor
        stored = (model.acts[b] - model.acts[a] + model.cut[a]) * inflight + model.peak(a, b)
        mem = unit.memory
        fit = static[None, :] <= mem
        counts = unit.counts[:, None]
        for _ in range(len(unit.profiles)):
            speed = np.where(fit, counts / t, 0.0)
            total = speed.sum(axis=0)
            share = np.where(total > 0, (1.0 / t) / np.where(total > 0, total, 1.0), 1.0)
            new_fit = fit & (static[None, :] + stored[None, :] * share <= mem)
            if np.array_equal(new_fit, fit):
                break
            fit = new_fit
        speed = np.where(fit, counts / t, 0.0).sum(axis=0)
        replicas = np.where(fit, counts, 0.0).sum(axis=0)
        ok = speed > 0
        per_mb = np.where(ok, 1.0 / np.where(ok, speed, 1.0), np.inf)
        paced = per_mb * self._frame_slowdown(k, fit, t)
        grads = (model.params[b] - model.params[a]) * cfg.grad_bytes_per_param_byte
        link = unit.allreduce
        with np.errstate(divide="ignore", invalid="ignore"):
            ring = np.where(
                replicas > 1, 2 * (replicas - 1) / replicas * grads / link.bandwidth, 0.0
            )
            hops = np.where(replicas > 1, np.ceil(np.log2(np.maximum(replicas, 1))), 0.0)
        occupancy = cfg.micro_batches * paced + ring + hops * link.rtt
        return occupancy, ok, per_mb

    def _frame_slowdown(self, k: int, fit: np.ndarray, t: np.ndarray) -> np.ndarray | float:
        """How much longer unit k's micro-batch takes with its dense frames' CPU, as build_plan
        charges it: each replica's share (by compute speed) of compute plus frames, both
        passes; the slowest fitting replica paces the stage."""
        unit = self.units[k]
        frames = 2 * stage_frames(k, self.s) * unit.frame_cost  # (P,)
        if not frames.any():
            return 1.0
        return np.where(fit, 1.0 + frames[:, None] / t, 1.0).max(axis=0)  # (L,)

    def reachable(self, limit: float) -> list[np.ndarray] | None:
        """Boundaries reachable after each stage with every cost <= limit; None if N is not."""
        n = self.model.n
        idx = np.arange(n + 1)
        reach = np.zeros(n + 1, dtype=bool)
        reach[0] = True
        sets = []
        for k in range(self.s):
            # Largest reachable a < b: the cheapest way to end stage k at b.
            prev = np.maximum.accumulate(np.where(reach, idx, -1))
            a = np.concatenate([[-1], prev[:-1]])
            b = idx
            if k == self.s - 1:
                a, b = a[n : n + 1], b[n : n + 1]
            valid = a >= 0
            a_safe = np.where(valid, a, 0)
            b_safe = np.where(valid, b, 1)
            occ, ok = self.stage(k, a_safe, b_safe)
            good = valid & ok & (occ <= limit)
            new = np.zeros(n + 1, dtype=bool)
            if k == self.s - 1:
                new[n] = bool(good[0])
            else:
                new = good & (self.link_occupancy[k] <= limit)
                new[n] = False  # later stages must get nodes
            reach = new
            sets.append(reach)
            if not reach.any():
                return None
        return sets if reach[n] else None

    def boundaries(self, limit: float, sets: list[np.ndarray]) -> list[int]:
        """Walk back from N choosing each stage's start among those that keep every cost
        <= limit: near the stage's fair share of the remaining work (so fill and drain stay
        short), and within that band at the cheapest cut (so links carry little)."""
        n, model = self.model.n, self.model
        prefix_speed = np.array([self._prefix_speed(j) for j in range(self.s)])
        cuts = [n]
        b = n
        for k in range(self.s - 1, 0, -1):
            a = np.flatnonzero(sets[k - 1][:b])
            occ, ok, per_mb = self.stage_full(k, a, np.full(a.shape, b))
            keep = ok & (occ <= limit)
            a, per_mb = a[keep], per_mb[keep]
            # Fair share: the prefix nodes[:b] spread over units 0..k by their speed on it.
            fair = 1.0 / float(prefix_speed[: k + 1, b].sum())
            miss = np.abs(np.log(np.maximum(per_mb, 1e-300) / fair))
            near = miss <= max(_BALANCE_BAND, float(miss.min()))
            order = np.lexsort((miss, np.where(near, model.cut[a], np.inf)))
            b = int(a[order[0]])
            cuts.append(b)
        cuts.append(0)
        return cuts[::-1]

    def _prefix_speed(self, k: int) -> np.ndarray:
        """Micro-batches per second unit k would do on nodes[:b], for every b."""
        unit = self.units[k]
        t = unit.total - unit.total[:, :1]
        with np.errstate(divide="ignore"):
            return (unit.counts[:, None] / t).sum(axis=0)

    def bottleneck(self, cuts: list[int]) -> float:
        worst = 0.0
        for k in range(self.s):
            occ, ok = self.stage(k, np.array([cuts[k]]), np.array([cuts[k + 1]]))
            worst = max(worst, float(occ[0]) if ok[0] else math.inf)
            if k < self.s - 1:
                worst = max(worst, float(self.link_occupancy[k][cuts[k + 1]]))
        return worst


def _solve_chain(chain: _Chain, tolerance: float = 1e-2) -> list[int] | None:
    """Stage boundaries minimising the bottleneck, or None when memory cannot be met."""
    if chain.s > chain.model.n:
        return None
    sets = chain.reachable(math.inf)
    if sets is None:
        return None
    hi_cuts = chain.boundaries(math.inf, sets)
    hi = chain.bottleneck(hi_cuts)
    speed = sum(float(chain._prefix_speed(k)[-1]) for k in range(chain.s))
    lo = max(hi * 1e-4, _PRUNE_SAFETY * chain.model.config.micro_batches / speed)
    if lo >= hi:
        return hi_cuts
    while hi > lo * (1 + tolerance):
        mid = math.sqrt(lo * hi)
        sets_mid = chain.reachable(mid)
        if sets_mid is None:
            lo = mid
        else:
            hi, sets = mid, sets_mid
    return chain.boundaries(hi, sets)


def _best_pair(
    swarm: Swarm, a: np.ndarray, b: np.ndarray
) -> tuple[int, int, LinkProfile, LinkProfile]:
    """The pair (i in a, j in b) with the best min(bw i->j, bw j->i), and its two directions.

    Consistent with fences.group_links on measured pairs; large groups only look at their
    measured links (and the best estimate if none was measured)."""
    if a.size * b.size <= 65536:
        # Sorted so that the first maximum in row-major order is the (i, j) tie-break winner.
        a, b = np.sort(a), np.sort(b)
        score = np.minimum(swarm.bandwidth_block(a, b), swarm.bandwidth_block(b, a).T)
        row, col = divmod(int(np.argmax(score)), b.size)
        i, j = a[row : row + 1], b[col : col + 1]
    else:
        inside_a = np.zeros(swarm.n, dtype=bool)
        inside_b = np.zeros(swarm.n, dtype=bool)
        inside_a[a], inside_b[b] = True, True
        mask = (inside_a[swarm.src] & inside_b[swarm.dst]) | (
            inside_b[swarm.src] & inside_a[swarm.dst]
        )
        src, dst = swarm.src[mask], swarm.dst[mask]
        ii = np.append(np.where(inside_a[src], src, dst), a[np.argmax(swarm.uplink[a])])
        jj = np.append(np.where(inside_a[src], dst, src), b[np.argmax(swarm.downlink[b])])
        estimate_pair = (ii[-1:], jj[-1:])
        estimate = min(
            swarm.link_arrays(*estimate_pair)[0][0], swarm.link_arrays(*estimate_pair[::-1])[0][0]
        )
        score = np.append(swarm.symmetric_bandwidth[mask], estimate)
        best = int(np.lexsort((jj, ii, -score))[0])
        i, j = ii[best : best + 1], jj[best : best + 1]
    fwd_bw, fwd_rtt = swarm.link_arrays(i, j)
    back_bw, back_rtt = swarm.link_arrays(j, i)
    return (
        int(i[0]),
        int(j[0]),
        LinkProfile(bandwidth=float(fwd_bw[0]), rtt=float(fwd_rtt[0])),
        LinkProfile(bandwidth=float(back_bw[0]), rtt=float(back_rtt[0])),
    )
