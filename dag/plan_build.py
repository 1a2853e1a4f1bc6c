"""``build_plan``: stage groups and stage boundaries -> a Plan; every planning method ends here.

Memory decides the replicas (a member that cannot hold its stage goes to backup), the cost
model the stage times, the slowest stage the AdaTopK budget of each link, and the simulator the
step time, so that the OP-Fence search and the baselines follow the same rules.
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fusionllm.common.errors import ConfigError
from fusionllm.dag.chain_cuts import _Model
from fusionllm.dag.cost import allreduce_time, compressed_wire, stage_frames, topk_charge
from fusionllm.dag.graph import GraphCosts
from fusionllm.dag.plan_records import (
    InfeasiblePlanError,
    LinkPlan,
    Plan,
    PlanConfig,
    StagePlan,
    pipeline_times,
)
from fusionllm.dag.replica_links import replica_link
from fusionllm.dag.simulate import SimResult, simulate
from fusionllm.dag.swarm import Swarm
from fusionllm.dag.tied_exchange import tied_tails

GIB = 2**30


@dataclass(frozen=True)
class TopkWork:
    """The top-k frames a stage codes per micro-batch in one pass, and their dense bytes."""

    frames: int = 0
    dense_bytes: float = 0.0


NO_TOPK = (TopkWork(), TopkWork())


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
    used: list[np.ndarray] = []
    stage_records = []
    for k, group in enumerate(groups):
        replicas, record = _stage_record(graph, swarm, config, model, cuts, k, group)
        used.append(replicas)
        stage_records.append(record)
    # AdaTopK budget: the slowest stage's compute per micro-batch; each link direction carries
    # one tensor per forward+backward period of that stage in steady state.
    budget = max(r["forward_time"] + r["backward_time"] for r in stage_records)
    links = _link_plans(swarm, config, model, cuts, used, budget)
    if model.charges_topk and any(f.frames or b.frames for f, b in topk_frames(links, s)):
        # Top-k frames cost their ends CPU (by their dense bytes): charged, the stages
        # grow, so does the budget, and AdaTopK may compress less. One more round, then the
        # stages are charged for the codecs that stay.
        stage_records = _charged(graph, swarm, config, model, cuts, groups, links)
        budget = max(r["forward_time"] + r["backward_time"] for r in stage_records)
        links = _link_plans(swarm, config, model, cuts, used, budget)
        stage_records = _charged(graph, swarm, config, model, cuts, groups, links)
    tails = tied_tails(graph, cuts, [int(u[0]) for u in used], swarm.link)
    return _assemble(swarm, config, fences, stage_records, links, method, tails)


def topk_frames(links: "Sequence[LinkPlan]", stages: int) -> list[tuple[TopkWork, TopkWork]]:
    """Per stage, the top-k frames it encodes or decodes per micro-batch: (forward, backward).
    A link's forward tensor is encoded by stage k and decoded by k+1; its gradient the other
    way round, in the backward pass. Both are the cut's size dense (an activation and its
    gradient have one shape)."""
    frames = [[0, 0] for _ in range(stages)]
    nbytes = [[0.0, 0.0] for _ in range(stages)]
    for link in links:
        k = link.src_stage
        for codec, side in ((link.forward_codec, 0), (link.backward_codec, 1)):
            if codec == "topk":
                for end in (k, k + 1):
                    frames[end][side] += 1
                    nbytes[end][side] += link.dense_bytes
    return [
        (TopkWork(f[0], b[0]), TopkWork(f[1], b[1])) for f, b in zip(frames, nbytes, strict=True)
    ]


def _charged(graph, swarm, config, model, cuts, groups, links) -> list[dict]:
    """The stage records again, each charged for the top-k frames ``links`` give it."""
    extra = topk_frames(links, len(groups))
    return [
        _stage_record(graph, swarm, config, model, cuts, k, group, topk=extra[k])[1]
        for k, group in enumerate(groups)
    ]


def _stage_record(
    graph: GraphCosts,
    swarm: Swarm,
    cfg: PlanConfig,
    model: _Model,
    cuts: list[int],
    k: int,
    group: list[str],
    topk: tuple[TopkWork, TopkWork] = NO_TOPK,
) -> tuple[np.ndarray, dict]:
    """Stage k's replicas (peer indices) and its StagePlan fields but the fence; ``topk``:
    the top-k frames it codes per micro-batch (forward, backward), charged beyond a dense
    frame's cost by their dense bytes (cost.topk_charge)."""
    s = len(cuts) - 1
    members = np.array(sorted(swarm.index(p) for p in group), dtype=np.int64)
    a, b = cuts[k], cuts[k + 1]
    inflight = min(s - k, cfg.micro_batches)
    static = (model.params[b] - model.params[a]) * cfg.static_factor
    stored = (model.acts[b] - model.acts[a] + model.cut[a]) * inflight + float(
        model.peak(np.array([a]), np.array([b]))[0]
    )
    fit = _fitting(model, members, static, stored)
    if not fit.any():
        largest = max(model.memory[model.peer_profile[members]])
        raise InfeasiblePlanError(
            f"stage {k} (nodes {a}:{b}) needs {static / GIB:.2f} GiB of params+grads+"
            f"optimizer state and {stored / GIB:.2f} GiB of activations for {inflight} "
            f"micro-batches, but its {members.size} peers have at most "
            f"{largest / GIB:.2f} GiB usable"
        )
    replicas = members[fit][: cfg.micro_batches]  # more would have no micro-batch to run
    share = micro_batch_shares(replicas.size, cfg.micro_batches)
    prof = model.peer_profile[replicas]
    per_frame = model.frame_cost[prof]  # (R,)
    frames = stage_frames(k, s) * per_frame
    fwd_frames, bwd_frames = (
        frames + _topk_extra(model, prof, per_frame, work, cfg.topk_frame_factor) for work in topk
    )
    forward = float(np.max(share * (model.fwd[prof, b] - model.fwd[prof, a] + fwd_frames)))
    backward = float(np.max(share * (model.bwd[prof, b] - model.bwd[prof, a] + bwd_frames)))
    link = model.allreduce_link(replicas)
    grads = (model.params[b] - model.params[a]) * cfg.grad_bytes_per_param_byte
    reduce = allreduce_time(grads, replicas.size, link)
    return replicas, dict(
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


def _topk_extra(
    model: _Model, prof: np.ndarray, per_frame: np.ndarray, work: TopkWork, factor: float
) -> np.ndarray:
    """What each replica (profiles ``prof``) pays for ``work`` beyond its dense frames."""
    if not work.frames:
        return np.zeros_like(per_frame)
    return topk_charge(
        work.frames,
        work.dense_bytes,
        dense_s=per_frame,
        per_frame=model.topk_frame[prof],
        per_byte=model.topk_byte[prof],
        factor=factor,
    )


def micro_batch_shares(replicas: int, micro_batches: int) -> np.ndarray:
    """Each replica's fraction of a step's micro-batches as the runtime deals them: micro-batch
    i to replica i mod R (node/pipeline/schedule.py), whatever the replicas' speeds. Planned by
    speed, a stage of 3 replicas and 4 micro-batches was estimated at a third of a micro-batch
    each and ran 2, 1 and 1: on topology A (issue 25) such a plan stepped in 0.110 s against an
    estimate of 0.052. (R,), zeros past the micro-batches."""
    counts = [len(range(r, micro_batches, replicas)) for r in range(replicas)]
    return np.array(counts, dtype=np.float64) / micro_batches


def _fitting(model: _Model, members: np.ndarray, static: float, stored: float) -> np.ndarray:
    """Which members can hold a stage of ``static`` bytes, plus ``stored`` activations times
    their share of the micro-batches; a member that cannot drops out and the rest share more."""
    fit = model.memory[model.peer_profile[members]] >= static
    for _ in range(members.size):
        if not fit.any():
            break
        share = micro_batch_shares(int(fit.sum()), model.config.micro_batches)
        need = static + stored * share
        ok = need <= model.memory[model.peer_profile[members[fit]]]
        if ok.all():
            break
        fit[np.flatnonzero(fit)[~ok]] = False
    return fit


def _link_plans(
    swarm: Swarm,
    cfg: PlanConfig,
    model: _Model,
    cuts: list[int],
    used: list[np.ndarray],
    budget: float,
) -> list[LinkPlan]:
    """The cut after each stage, named by the best pair of the two stages' replicas and timed
    over every pair its micro-batches cross (replica_links.py)."""
    links = []
    for k in range(len(used) - 1):
        dense = round(model.cut[cuts[k + 1]])
        src, dst, fwd_link, bwd_link = model.best_pair(used[k], used[k + 1])
        if used[k].size > 1 or used[k + 1].size > 1:
            a, b, m = used[k].tolist(), used[k + 1].tolist(), cfg.micro_batches
            fwd_link = replica_link(swarm.link, a, b, m)
            bwd_link = replica_link(swarm.link, b, a, m)
        pair = (swarm.peers[src].peer_id, swarm.peers[dst].peer_id)
        links.append(link_plan(k, pair, dense, (fwd_link, bwd_link), budget, cfg))
    return links


def link_plan(
    k: int, pair: tuple[str, str], dense: int, links: tuple, budget: float, cfg: PlanConfig
) -> LinkPlan:
    """The cut after stage ``k`` from ``pair[0]`` to ``pair[1]`` over ``links`` (forward,
    backward), each direction compressed as AdaTopK's rule gives for its bandwidth."""
    fwd_link, bwd_link = links
    f = _wire(dense, fwd_link.bandwidth, budget, cfg)
    bk = _wire(dense, bwd_link.bandwidth, budget, cfg)
    return LinkPlan(
        src_stage=k,
        src_peer=pair[0],
        dst_peer=pair[1],
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


def _assemble(
    swarm: Swarm,
    cfg: PlanConfig,
    fences: list[list[str]],
    stage_records: list[dict],
    links: list[LinkPlan],
    method: str,
    tails: tuple[float, ...],
) -> Plan:
    """The Plan: fences renumbered to those in use, the rest in backup, timed by the simulator."""
    fence_of = {pid: f for f, members in enumerate(fences) for pid in members}
    in_use = {pid for r in stage_records for pid in r["peers"]}
    fence_ids = sorted({fence_of.get(p, -1) for r in stage_records for p in r["peers"]})
    fence_index = {f: i for i, f in enumerate(fence_ids)}
    stages = tuple(
        StagePlan(fence=fence_index[fence_of.get(r["peers"][0], -1)], **r) for r in stage_records
    )
    plan_fences = tuple(
        tuple(sorted(p for p in fences[f] if p in in_use)) if f >= 0 else () for f in fence_ids
    )
    times = pipeline_times(stages, tuple(links), cfg.micro_batches, tails)
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
