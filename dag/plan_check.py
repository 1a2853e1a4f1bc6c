"""A proposed plan's figures recomputed in our own view of the swarm.

A node must not take a proposal's numbers on trust: a member could claim a step time its plan
cannot reach, or a stage that fits in memory when it does not. ``Retimer.retime`` keeps what
the proposer chose (stage boundaries, replicas, the peer pair and the codec of each link) and
recomputes everything that follows from those choices with the planner's own rules
(``build_plan``): shares, memory, compute and all-reduce times from the graph and the members'
devices, the bytes each link's codec puts on the wire, link times at the bandwidth *we* see,
and the step time by the simulator: the plan as it would run here (a link we have not
measured yet at the figures the plan claims for it: we have no evidence against them).
Beside it, ``Retimed.rule`` holds each link as AdaTopK would compress it at the bandwidth
the plan itself claims for it (and our compute budget), so a caller can tell a plan that
compresses more than its own figures allow, and ``Retimed.ours`` at the bandwidth we see
(more than our view allows); a claimed bandwidth above what we see shows in the step time
instead.

``wire_bytes_for``: the bytes a (codec, ratio) puts on the wire, for the codecs the planner
makes and no other.
"""

import dataclasses
import math
from dataclasses import dataclass

from fusionllm.common.errors import ConfigError
from fusionllm.compression.wire_sizes import topk_wire_bytes
from fusionllm.dag.chain_cuts import _Model
from fusionllm.dag.cost import LinkProfile
from fusionllm.dag.graph import GraphCosts
from fusionllm.dag.plan_build import (
    NO_TOPK,
    TopkWork,
    _stage_record,
    _wire,
    build_plan,
    link_plan,
    topk_frames,
)
from fusionllm.dag.plan_records import (
    PLANNERS,
    LinkPlan,
    Plan,
    PlanConfig,
    StagePlan,
    pipeline_times,
)
from fusionllm.dag.replica_links import replica_link
from fusionllm.dag.simulate import simulate
from fusionllm.dag.swarm import Swarm
from fusionllm.dag.tied_exchange import tied_tails

CODECS = ("dense", "fp16", "topk")


class PlanCheckError(ConfigError):
    """A plan that cannot run as written in our view (a replica that cannot hold its stage, a
    cut the runtime cannot ship, a codec that does not exist)."""


@dataclass(frozen=True)
class Retimed:
    plan: Plan  # the proposal's plan as it would run in our view
    rule: tuple[LinkPlan, ...]  # its links as AdaTopK compresses them at their own bandwidth
    ours: tuple[LinkPlan, ...]  # ... and at the bandwidth we see


def wire_bytes_for(codec: str, ratio: float, dense_bytes: int, config: PlanConfig) -> int:
    """Bytes on the wire when ``codec`` at ``ratio`` carries ``dense_bytes`` (the planner's
    accounting, cost.compressed_wire); PlanCheckError for a combination it never makes."""
    if not config.compression and (codec, ratio) != ("dense", 1.0):
        raise PlanCheckError(f"{codec} at ratio {ratio}, but the swarm sends dense")
    if codec == "dense" and ratio == 1.0:
        return int(dense_bytes)
    if codec == "fp16" and ratio == 1.0 and config.allow_fp16 and config.element_size > 2:
        return int(dense_bytes) * 2 // config.element_size
    if codec == "topk" and config.min_ratio <= ratio < 1.0:
        return topk_wire_bytes(max(1, dense_bytes // config.element_size), ratio)
    raise PlanCheckError(f"codec {codec!r} at ratio {ratio} is not one the planner makes")


class Retimer:
    """Our view (graph costs, members' devices, our bandwidth book as a Swarm) of any plan."""

    def __init__(
        self, graph: GraphCosts, swarm: Swarm, config: PlanConfig, *, unmeasured_trust: float = 1.0
    ) -> None:
        """``unmeasured_trust``: on a link we have not measured, a plan's claimed figures are
        believed up to this factor better than our estimate from the ends' records (1: our
        estimate rules, as on a measured link)."""
        if not (math.isfinite(unmeasured_trust) and unmeasured_trust >= 1.0):
            raise ConfigError(f"unmeasured_trust must be finite and >= 1, got {unmeasured_trust}")
        self.graph, self.swarm, self.config = graph, swarm, config
        self.unmeasured_trust = unmeasured_trust
        # One cost model for every proposal of an epoch: building it is the costly part.
        self.model = _Model(graph, swarm, config)

    def retime(self, plan: Plan) -> Retimed:
        """``plan`` with every figure recomputed here; PlanCheckError if it cannot run as is.

        Expects a plan ``agreement.check_plan`` accepted (contiguous stages over our model,
        every peer one of the swarm's, link ends inside their stages).
        """
        ids = set(self.swarm.peer_ids)
        if not plan.stages or any(p not in ids for s in plan.stages for p in s.peers):
            raise PlanCheckError("plan names peers outside our view of the swarm")
        cuts = [s.start for s in plan.stages] + [plan.stages[-1].stop]
        if cuts[0] != 0 or cuts[-1] != self.model.n:
            raise PlanCheckError(f"stages run {cuts[0]}..{cuts[-1]}, our model 0..{self.model.n}")
        for k, cut in enumerate(cuts[1:-1]):
            if not math.isfinite(self.model.cut[cut]):
                raise PlanCheckError(f"the cut after stage {k} is one the runtime cannot ship")
        stages = tuple(self._stage(plan, cuts, k) for k in range(len(plan.stages)))
        budget = max(s.forward_time + s.backward_time for s in stages)
        ours = tuple(self._link(link, cuts, budget, plan.stages) for link in plan.links)
        links = tuple(map(self._as_claimed, ours, plan.links))
        extra = topk_frames(links, len(stages))
        # The claimed top-k frames' CPU, as build_plan charges it.
        if self.model.charges_topk and any(f.frames or b.frames for f, b in extra):
            stages = tuple(self._stage(plan, cuts, k, extra[k]) for k in range(len(stages)))
            budget = max(s.forward_time + s.backward_time for s in stages)
            ours = tuple(self._link(link, cuts, budget, plan.stages) for link in plan.links)
            links = tuple(map(self._as_claimed, ours, plan.links))
        rule = tuple(map(self._by_the_rule, links, plan.links, (budget,) * len(links)))
        firsts = [self.swarm.index(s.peers[0]) for s in stages]
        tails = tied_tails(self.graph, cuts, firsts, self.swarm.link)
        result = simulate(pipeline_times(stages, links, self.config.micro_batches, tails))
        return Retimed(
            Plan(
                method=plan.method,
                fences=plan.fences,
                stages=stages,
                links=links,
                backup=plan.backup,
                micro_batches=self.config.micro_batches,
                estimated_step_time=result.step_time,
                bubble_fraction=result.bubble_fraction,
            ),
            rule,
            ours,
        )

    def recoded(self, plan: Plan) -> Plan:
        """``plan``'s stages and peers planned again on our snapshot: shares, link pairs and
        AdaTopK's codecs as the planner's rules give them now. The fair bar for a plan we
        follow against a fresh plan of the same snapshot (``retime`` keeps the old codecs: a
        link compressed when it was the bottleneck stays compressed after it is not, and the
        old plan looks slower than it would run). PlanCheckError if it no longer fits."""
        gone = sorted({p for s in plan.stages for p in s.peers} - set(self.swarm.peer_ids))
        if gone:
            raise PlanCheckError(f"the plan cannot be planned again here: {gone[0][:16]}... left")
        cuts = [s.start for s in plan.stages] + [plan.stages[-1].stop]
        config = self.config
        if plan.method != PLANNERS["opfence"]:  # the baselines send dense (baselines.py)
            config = dataclasses.replace(config, compression=False)
        try:
            return build_plan(
                self.graph,
                self.swarm,
                config,
                [list(s.peers) for s in plan.stages],
                cuts,
                fences=[list(f) for f in plan.fences],
                method=plan.method,
                _model=self.model if config is self.config else None,
            )
        except ConfigError as exc:  # a peer gone, or one that cannot hold its stage now
            raise PlanCheckError(f"the plan cannot be planned again here: {exc}") from exc

    def _as_claimed(self, ours: LinkPlan, claimed: LinkPlan) -> LinkPlan:
        """Our link with the claimed codecs: what would cross it if the plan ran."""
        dense = ours.dense_bytes
        fwd = (claimed.forward_codec, claimed.forward_ratio)
        bwd = (claimed.backward_codec, claimed.backward_ratio)
        try:
            fwd_wire = wire_bytes_for(*fwd, dense, self.config)
            bwd_wire = wire_bytes_for(*bwd, dense, self.config)
        except PlanCheckError as exc:
            raise PlanCheckError(f"link {claimed.src_stage}: {exc}") from None
        return dataclasses.replace(
            ours,
            forward_codec=fwd[0], forward_ratio=fwd[1], forward_wire_bytes=fwd_wire,
            backward_codec=bwd[0], backward_ratio=bwd[1], backward_wire_bytes=bwd_wire,
        )  # fmt: skip

    def _by_the_rule(self, ours: LinkPlan, claimed: LinkPlan, budget: float) -> LinkPlan:
        """AdaTopK's choice for the link at the bandwidths the plan claims for it."""
        up, down = claimed.forward_bandwidth, claimed.backward_bandwidth
        if not (up > 0 and down > 0):
            raise PlanCheckError(f"link {claimed.src_stage} claims a bandwidth of {up}, {down}")
        f = _wire(ours.dense_bytes, up, budget, self.config)
        b = _wire(ours.dense_bytes, down, budget, self.config)
        return dataclasses.replace(
            ours,
            forward_codec=f[0], forward_ratio=f[1], forward_wire_bytes=f[2],
            backward_codec=b[0], backward_ratio=b[1], backward_wire_bytes=b[2],
        )  # fmt: skip

    def _stage(
        self, plan: Plan, cuts: list[int], k: int, topk: tuple[TopkWork, TopkWork] = NO_TOPK
    ) -> StagePlan:
        claimed = plan.stages[k]
        try:
            _, record = _stage_record(
                self.graph, self.swarm, self.config, self.model, cuts, k, list(claimed.peers),
                topk=topk,
            )  # fmt: skip
        except ConfigError as exc:  # InfeasiblePlanError: nobody can hold it
            raise PlanCheckError(str(exc)) from exc
        dropped = sorted(set(claimed.peers) - set(record["peers"]))
        if dropped:
            raise PlanCheckError(
                f"stage {k}: {dropped[0][:16]}... cannot hold nodes {cuts[k]}:{cuts[k + 1]} "
                "in our view of its device"
            )
        return StagePlan(fence=claimed.fence, **record)

    def _link(
        self, claimed: LinkPlan, cuts: list[int], budget: float, stages: tuple[StagePlan, ...]
    ) -> LinkPlan:
        k = claimed.src_stage
        dense_bytes = round(float(self.model.cut[cuts[k + 1]]))
        src, dst = self.swarm.index(claimed.src_peer), self.swarm.index(claimed.dst_peer)
        forward = self._seen(src, dst, claimed.forward_bandwidth, claimed.forward_rtt)
        backward = self._seen(dst, src, claimed.backward_bandwidth, claimed.backward_rtt)
        a, b = (list(map(self.swarm.index, s.peers)) for s in stages[k : k + 2])
        if len(a) > 1 or len(b) > 1:  # timed over every pair it crosses, as build_plan does
            m = self.config.micro_batches
            fwd_claim = (claimed.forward_bandwidth, claimed.forward_rtt)
            bwd_claim = (claimed.backward_bandwidth, claimed.backward_rtt)
            forward = replica_link(lambda i, j: self._seen(i, j, *fwd_claim), a, b, m)
            backward = replica_link(lambda i, j: self._seen(i, j, *bwd_claim), b, a, m)
        pair = (claimed.src_peer, claimed.dst_peer)
        return link_plan(k, pair, dense_bytes, (forward, backward), budget, self.config)

    def _seen(self, src: int, dst: int, bandwidth: float, rtt: float) -> LinkProfile:
        """The link src -> dst as we measured it; one we have not measured, as claimed but
        never more than ``unmeasured_trust`` times better than our estimate. That estimate
        (the ends' access links) is weak evidence against a proposer that measured the link:
        audited on it alone, a node refused plans over links it had not probed yet as ~5x
        slower (docs/testbed.md). The bound keeps what a liar gains finite."""
        ours = self.swarm.link(src, dst)
        if self.swarm.measured(src, dst) or self.unmeasured_trust == 1.0:
            return ours
        if not (bandwidth > 0 and math.isfinite(rtt) and rtt >= 0):
            raise PlanCheckError(f"a link of the plan claims {bandwidth} B/s, {rtt} s")
        trust = self.unmeasured_trust
        return LinkProfile(
            bandwidth=min(bandwidth, ours.bandwidth * trust), rtt=max(rtt, ours.rtt / trust)
        )
