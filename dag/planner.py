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
"""

import hashlib
import itertools
import json
import math
from dataclasses import asdict, dataclass

import numpy as np

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.dag.cost import (
    DeviceProfile,
    LinkProfile,
    allreduce_time,
    compressed_wire,
    min_wire_bytes,
    node_time,
)
from fusionllm.dag.fences import (
    candidate_thresholds,
    fences_at,
    group_allreduce_link,
    group_links,
    max_spanning_forest,
    order_chain,
)
from fusionllm.dag.graph import GraphCosts
from fusionllm.dag.simulate import PipelineTimes, SimResult, simulate
from fusionllm.dag.swarm import Swarm

logger = get_logger(__name__)

_BALANCE_BAND = math.log(1.25)  # a stage within 25% of its fair share counts as balanced
_PRUNE_SAFETY = 0.98  # bounds are compared with this slack against float noise
GIB = 2**30


class InfeasiblePlanError(ConfigError):
    """No assignment of the graph to the swarm fits in memory; the message gives the numbers."""


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """Training-step and search settings.

    The global batch (batch_size samples) is fixed: data-parallel replicas split each
    micro-batch, so every plan does the same work per step and step times compare directly.
    The graph's costs are for graph_batch_size samples and are scaled to a micro-batch.
    """

    micro_batches: int = 8
    batch_size: int = 8
    graph_batch_size: int = 1
    compression: bool = True  # AdaTopK on inter-stage links
    min_ratio: float = 0.01  # never keep fewer than 1% of elements (convergence)
    element_size: int = 4  # activations/gradients are fp32 in the graph's byte counts
    allow_fp16: bool = True
    grad_bytes_per_param_byte: float = 1.0  # fp32 grads for fp32 params
    optimizer_bytes_per_param_byte: float = 2.0  # AdamW: two fp32 moments per fp32 param
    memory_fraction: float = 0.9  # leave room for the CUDA context and allocator slack
    max_stages: int = 64
    # At least this many pipeline stages (a swarm that must exercise its pipeline, or whose
    # devices the operator knows better than the probe): fewer-stage chains are not tried.
    min_stages: int = 1
    # Data-parallel width cap per stage (each replica needs whole samples of a micro-batch,
    # and adds gradient averaging); the slowest members beyond it wait in backup.
    max_replicas: int = 64
    min_relative_speed: float = 0.05  # slower than this x the fence's fastest -> backup
    fence_levels: int = 6  # clustering thresholds tried (widest log-bandwidth gaps)

    def __post_init__(self) -> None:
        if self.micro_batches < 1:
            raise ConfigError(f"micro_batches must be >= 1, got {self.micro_batches}")
        if self.batch_size < self.micro_batches:
            raise ConfigError(
                f"batch_size {self.batch_size} must be >= micro_batches {self.micro_batches}"
            )
        if self.graph_batch_size < 1:
            raise ConfigError(f"graph_batch_size must be >= 1, got {self.graph_batch_size}")
        if not 0.0 < self.min_ratio <= 1.0:
            raise ConfigError(f"min_ratio must be in (0, 1], got {self.min_ratio}")
        if self.element_size not in (1, 2, 4, 8):
            raise ConfigError(f"element_size must be 1, 2, 4 or 8, got {self.element_size}")
        if self.grad_bytes_per_param_byte < 0 or self.optimizer_bytes_per_param_byte < 0:
            raise ConfigError(
                "bytes per param byte must be >= 0, got grads "
                f"{self.grad_bytes_per_param_byte}, optimizer {self.optimizer_bytes_per_param_byte}"
            )
        if not 0.0 < self.memory_fraction <= 1.0:
            raise ConfigError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if not 1 <= self.min_stages <= self.max_stages:
            raise ConfigError(
                f"need 1 <= min_stages <= max_stages, got {self.min_stages}, {self.max_stages}"
            )
        if self.max_replicas < 1:
            raise ConfigError(f"max_replicas must be >= 1, got {self.max_replicas}")
        if not 0.0 <= self.min_relative_speed < 1.0:
            raise ConfigError(
                f"min_relative_speed must be in [0, 1), got {self.min_relative_speed}"
            )
        if self.fence_levels < 1:
            raise ConfigError(f"fence_levels must be >= 1, got {self.fence_levels}")

    @property
    def scale(self) -> float:
        """Graph costs -> one micro-batch."""
        return self.batch_size / self.micro_batches / self.graph_batch_size

    @property
    def static_factor(self) -> float:
        """Bytes held per parameter byte: the parameter, its gradient, the optimizer state."""
        return 1.0 + self.grad_bytes_per_param_byte + self.optimizer_bytes_per_param_byte


# ----------------------------------------------------------------------------- plan records


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    index: int
    start: int  # first node (index into GraphCosts.nodes)
    stop: int  # one past the last node
    node_ids: tuple[str, ...]
    fence: int  # index into Plan.fences
    peers: tuple[str, ...]  # data-parallel replicas
    shares: tuple[float, ...]  # fraction of each micro-batch each replica computes
    memory_bytes: tuple[int, ...]  # peak per replica
    forward_time: float  # per micro-batch, the fence as a whole
    backward_time: float
    allreduce_time: float  # per step


@dataclass(frozen=True, kw_only=True)
class LinkPlan:
    """The cut after stage ``src_stage``: what crosses it each micro-batch, each way."""

    src_stage: int
    src_peer: str  # the pair of peers that carries it (best measured pair)
    dst_peer: str
    dense_bytes: int
    forward_codec: str
    forward_ratio: float
    forward_wire_bytes: int
    forward_bandwidth: float
    forward_rtt: float
    backward_codec: str
    backward_ratio: float
    backward_wire_bytes: int
    backward_bandwidth: float
    backward_rtt: float


@dataclass(frozen=True, kw_only=True)
class Plan:
    method: str
    fences: tuple[tuple[str, ...], ...]
    stages: tuple[StagePlan, ...]
    links: tuple[LinkPlan, ...]
    backup: tuple[str, ...]
    micro_batches: int
    estimated_step_time: float
    bubble_fraction: float

    def pipeline_times(self) -> PipelineTimes:
        return pipeline_times(self.stages, self.links, self.micro_batches)

    def to_dict(self) -> dict:
        return _canonical(asdict(self))

    def digest(self) -> str:
        """sha256 of the canonical JSON: identical on every peer that planned the same inputs."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def _canonical(value):
    """Floats to 12 significant digits so harmless last-bit noise cannot change a digest."""
    if isinstance(value, float):
        return float(f"{value:.12g}") if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value


def pipeline_times(
    stages: tuple[StagePlan, ...], links: tuple[LinkPlan, ...], micro_batches: int
) -> PipelineTimes:
    return PipelineTimes(
        forward=tuple(s.forward_time for s in stages),
        backward=tuple(s.backward_time for s in stages),
        send_forward=tuple(x.forward_wire_bytes / x.forward_bandwidth for x in links),
        send_backward=tuple(x.backward_wire_bytes / x.backward_bandwidth for x in links),
        latency_forward=tuple(x.forward_rtt / 2 for x in links),
        latency_backward=tuple(x.backward_rtt / 2 for x in links),
        allreduce=tuple(s.allreduce_time for s in stages),
        micro_batches=micro_batches,
    )


# ----------------------------------------------------------------------------- model context


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
        peak = np.array([n.output_bytes * scale for n in graph.nodes], dtype=np.float64)
        # Sparse table for range max: row j holds max(peak[i : i + 2**j]), padded with 0.
        rows = [peak]
        width = 1
        while 2 * width <= self.n:
            prev = rows[-1]
            rows.append(np.maximum(prev[:-width], prev[width:]))
            width *= 2
        self._peak_table = np.zeros((len(rows), self.n))
        for j, row in enumerate(rows):
            self._peak_table[j, : row.size] = row

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

    def speed_share(self, members: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Each member's fraction of a micro-batch: proportional to its speed on the stage."""
        t = (
            self.total[self.peer_profile[members], stop]
            - self.total[self.peer_profile[members], start]
        )
        speed = 1.0 / np.maximum(t, 1e-300)
        return speed / speed.sum()


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
    )


# ----------------------------------------------------------------------------- the cut DP


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

    def stage(self, k: int, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(per-step occupancy, feasible) of unit k running nodes[a:b] (arrays, b > a)."""
        occupancy, ok, _ = self.stage_full(k, a, b)
        return occupancy, ok

    def stage_full(
        self, k: int, a: np.ndarray, b: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(per-step occupancy, feasible, per-micro-batch compute) of unit k on nodes[a:b]."""
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
        grads = (model.params[b] - model.params[a]) * cfg.grad_bytes_per_param_byte
        link = unit.allreduce
        with np.errstate(divide="ignore", invalid="ignore"):
            ring = np.where(
                replicas > 1, 2 * (replicas - 1) / replicas * grads / link.bandwidth, 0.0
            )
            hops = np.where(replicas > 1, np.ceil(np.log2(np.maximum(replicas, 1))), 0.0)
        occupancy = cfg.micro_batches * per_mb + ring + hops * link.rtt
        return occupancy, ok, per_mb

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


# ----------------------------------------------------------------------------- building plans


def build_plan(
    graph: GraphCosts,
    swarm: Swarm,
    config: PlanConfig,
    groups: list[list[str]],
    cuts: list[int],
    *,
    fences: list[list[str]] | None = None,
    method: str = "op-fence",
    _model: "_Model | None" = None,
) -> Plan:
    """Make a Plan from stage groups (peer ids, in pipeline order) and stage boundaries.

    cuts[0] == 0, cuts[-1] == len(nodes), one more than groups. Members that cannot hold
    their stage in memory go to backup; a stage nobody can hold raises InfeasiblePlanError.
    ``fences`` defaults to one fence per group. Every method builds its Plan here, so that
    compression, memory and timing follow the same rules.
    """
    model = _model or _Model(graph, swarm, config)
    s = len(groups)
    if len(cuts) != s + 1 or cuts[0] != 0 or cuts[-1] != model.n:
        raise ConfigError(f"cuts {cuts} must run 0..{model.n} with {s + 1} entries")
    if any(b <= a for a, b in itertools.pairwise(cuts)):
        raise ConfigError(f"cuts {cuts} must be strictly increasing")
    fences = fences if fences is not None else groups
    fence_of = {pid: f for f, members in enumerate(fences) for pid in members}
    cfg = config
    used: list[np.ndarray] = []
    stage_records = []
    for k, group in enumerate(groups):
        members = np.array(sorted(swarm.index(p) for p in group), dtype=np.int64)
        a, b = cuts[k], cuts[k + 1]
        inflight = min(s - k, cfg.micro_batches)
        static = (model.params[b] - model.params[a]) * cfg.static_factor
        stored = (model.acts[b] - model.acts[a] + model.cut[a]) * inflight + float(
            model.peak(np.array([a]), np.array([b]))[0]
        )
        fit = model.memory[model.peer_profile[members]] >= static
        for _ in range(members.size):
            if not fit.any():
                break
            share = model.speed_share(members[fit], a, b)
            need = static + stored * share
            ok = need <= model.memory[model.peer_profile[members[fit]]]
            if ok.all():
                break
            fit[np.flatnonzero(fit)[~ok]] = False
        if not fit.any():
            largest = max(model.memory[model.peer_profile[members]])
            raise InfeasiblePlanError(
                f"stage {k} (nodes {a}:{b}) needs {static / GIB:.2f} GiB of params+grads+"
                f"optimizer state and {stored / GIB:.2f} GiB of activations for {inflight} "
                f"micro-batches, but its {members.size} peers have at most "
                f"{largest / GIB:.2f} GiB usable"
            )
        replicas = members[fit]
        share = model.speed_share(replicas, a, b)
        prof = model.peer_profile[replicas]
        forward = float(np.max(share * (model.fwd[prof, b] - model.fwd[prof, a])))
        backward = float(np.max(share * (model.bwd[prof, b] - model.bwd[prof, a])))
        link = model.allreduce_link(replicas)
        grads = (model.params[b] - model.params[a]) * cfg.grad_bytes_per_param_byte
        reduce = allreduce_time(grads, replicas.size, link)
        used.append(replicas)
        stage_records.append(
            dict(
                index=k,
                start=a,
                stop=b,
                node_ids=tuple(n.node_id for n in graph.nodes[a:b]),
                peers=tuple(swarm.peers[i].peer_id for i in replicas),
                shares=tuple(float(x) for x in share),
                memory_bytes=tuple(int(static + stored * x) for x in share),
                forward_time=forward,
                backward_time=backward,
                allreduce_time=reduce,
            )
        )
    # AdaTopK budget: the slowest stage's compute per micro-batch; each link direction carries
    # one tensor per forward+backward period of that stage in steady state.
    budget = max(r["forward_time"] + r["backward_time"] for r in stage_records)
    links = []
    for k in range(s - 1):
        dense = round(model.cut[cuts[k + 1]])
        src, dst, fwd_link, bwd_link = model.best_pair(used[k], used[k + 1])
        f = _wire(dense, fwd_link.bandwidth, budget, cfg)
        bk = _wire(dense, bwd_link.bandwidth, budget, cfg)
        links.append(
            LinkPlan(
                src_stage=k,
                src_peer=swarm.peers[src].peer_id,
                dst_peer=swarm.peers[dst].peer_id,
                dense_bytes=dense,
                forward_codec=f[0],
                forward_ratio=f[1],
                forward_wire_bytes=f[2],
                forward_bandwidth=fwd_link.bandwidth,
                forward_rtt=fwd_link.rtt,
                backward_codec=bk[0],
                backward_ratio=bk[1],
                backward_wire_bytes=bk[2],
                backward_bandwidth=bwd_link.bandwidth,
                backward_rtt=bwd_link.rtt,
            )
        )
    in_use = {pid for r in stage_records for pid in r["peers"]}
    fence_ids = sorted({fence_of.get(p, -1) for r in stage_records for p in r["peers"]})
    fence_index = {f: i for i, f in enumerate(fence_ids)}
    stages = tuple(
        StagePlan(fence=fence_index[fence_of.get(r["peers"][0], -1)], **r) for r in stage_records
    )
    plan_fences = tuple(
        tuple(sorted(p for p in fences[f] if p in in_use)) if f >= 0 else () for f in fence_ids
    )
    times = pipeline_times(stages, tuple(links), cfg.micro_batches)
    result: SimResult = simulate(times)
    return Plan(
        method=method,
        fences=plan_fences,
        stages=stages,
        links=tuple(links),
        backup=tuple(p for p in swarm.peer_ids if p not in in_use),
        micro_batches=cfg.micro_batches,
        estimated_step_time=result.step_time,
        bubble_fraction=result.bubble_fraction,
    )


def _wire(dense: int, bandwidth: float, budget: float, cfg: PlanConfig) -> tuple[str, float, int]:
    if not cfg.compression:
        return ("dense", 1.0, dense)
    choice = compressed_wire(
        dense,
        bandwidth,
        budget,
        min_ratio=cfg.min_ratio,
        element_size=cfg.element_size,
        allow_fp16=cfg.allow_fp16,
    )
    return (choice.codec, choice.ratio, choice.wire_bytes)


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


# ----------------------------------------------------------------------------- the search


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

    def _try_units(self, units: list[_Unit], chain_fences: list[np.ndarray]) -> float | None:
        links = group_links(self.swarm, [u.members for u in units])
        chain = _Chain(self.model, units, links)
        cuts = _solve_chain(chain)
        self.tried += 1
        if cuts is None:
            return None
        # Every stage is busy at least its occupancy per step, and links carry at least their
        # most compressed bytes: a chain whose bottleneck already loses is not worth a plan.
        floor = _PRUNE_SAFETY * chain.bottleneck(cuts)
        if floor > self.best_time:
            self.pruned += 1
            return floor
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
        step = candidate.estimated_step_time
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


def _infeasible(model: _Model, tried: int) -> InfeasiblePlanError:
    cfg = model.config
    static = model.params[-1] * cfg.static_factor
    acts = model.acts[-1]
    usable = model.memory[model.peer_profile]
    return InfeasiblePlanError(
        f"no plan fits in memory ({tried} candidate chains tried): the model needs "
        f"{static / GIB:.2f} GiB of params+grads+optimizer state plus {acts / GIB:.2f} GiB of "
        f"activations per micro-batch; the swarm's {model.swarm.n} peers have "
        f"{usable.sum() / GIB:.2f} GiB usable in total, at most {usable.max() / GIB:.2f} GiB on "
        f"one device (memory_fraction={cfg.memory_fraction}, min_stages={cfg.min_stages}, "
        f"max_stages={cfg.max_stages})"
    )
