"""dag/plan_check.py and node/control/audit.py: a proposal's claims against our own figures.

The plans here are the planner's own, made in the same view the auditor uses (a node's quantized
book): an honest plan audits clean, and each way a proposer could shade a plan to win is caught
as a rule break (RecordError) or as slack below 1 naming the figure.
"""

import dataclasses
import math

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.compression.adaptive import topk_wire_bytes
from fusionllm.dag.plan_check import PlanCheckError, Retimer, wire_bytes_for
from fusionllm.dag.plan_wire import plan_from_json, plan_to_json
from fusionllm.dag.planner import Plan, PlanConfig, plan
from fusionllm.dag.simulate import simulate
from fusionllm.dag.swarm import Swarm
from fusionllm.dag.synthetic import gpt2_costs
from fusionllm.dht.records import DeviceInfo, NodeInfo, NodeState, RecordError
from fusionllm.node.control.audit import CLEAN, Audit, AuditLimits, Finding, audit
from fusionllm.node.control.bandwidth import BandwidthBook, LinkSample

GRAPH = gpt2_costs("small", batch=1, seq=128)
NOW = 1.7e9
GIB = 1 << 30
CONFIG = PlanConfig(micro_batches=4, batch_size=8, memory_fraction=0.9, max_replicas=1)
DENSE = dataclasses.replace(CONFIG, compression=False)
LIMITS = AuditLimits()


def record(peer_id: str, *, bandwidth: float = 1e9, memory: int = 8 * GIB) -> NodeInfo:
    device = DeviceInfo(
        name="gpu",
        kind="cuda",
        memory_bytes=memory,
        flops=1e12,
        memory_bandwidth=1e11,
        op_overhead=0.0,
        cpu_cores=8,
        ram_bytes=memory,
    )
    return NodeInfo(peer_id=peer_id, swarm="demo", addrs=(), dht_addrs=(), device=device,
                    uplink=bandwidth, downlink=bandwidth, links=(), software="test",
                    config_digest="0123456789abcdef", state=NodeState.BACKUP, stage=None,
                    adopted=None, time=NOW)  # fmt: skip


def view(n: int = 4, *, book: BandwidthBook | None = None, **records: NodeInfo) -> Swarm:
    members = {f"peer{i}": record(f"peer{i}") for i in range(n)} | records
    book = book or BandwidthBook(max_age_s=60.0)
    return book.swarm(sorted(members.values(), key=lambda m: m.peer_id), now=NOW)


def plan_in(swarm: Swarm, config: PlanConfig = CONFIG, **changes) -> Plan:
    return plan(GRAPH, swarm, dataclasses.replace(config, **changes))


def audited(claimed: Plan, swarm: Swarm, config: PlanConfig = CONFIG) -> Finding:
    """Every figure against ours (RecordError for rules; PlanCheckError from retime)."""
    return full_audit(claimed, swarm, config).view


def full_audit(claimed: Plan, swarm: Swarm, config: PlanConfig = CONFIG) -> Audit:
    return audit(claimed, Retimer(GRAPH, swarm, config).retime(claimed), config, LIMITS)


def with_stage(p: Plan, k: int, **changes) -> Plan:
    stages = list(p.stages)
    stages[k] = dataclasses.replace(stages[k], **changes)
    return dataclasses.replace(p, stages=tuple(stages))


def with_link(p: Plan, k: int, **changes) -> Plan:
    links = list(p.links)
    links[k] = dataclasses.replace(links[k], **changes)
    return dataclasses.replace(p, links=tuple(links))


@pytest.fixture(scope="module")
def fast() -> tuple[Plan, Swarm]:
    swarm = view(4)
    p = plan_in(swarm, min_stages=2)
    assert len(p.stages) >= 2
    assert all(link.forward_codec == "dense" for link in p.links)
    return p, swarm


@pytest.fixture(scope="module")
def slow() -> tuple[Plan, Swarm]:
    """Slow access links: AdaTopK compresses the cut."""
    swarm = view(4, **{f"peer{i}": record(f"peer{i}", bandwidth=2e6) for i in range(4)})
    p = plan_in(swarm, min_stages=2)
    assert p.links[0].forward_codec == "topk"
    return p, swarm


# ----------------------------------------------------------------------------- retime


@pytest.mark.parametrize("which", ["fast", "slow"])
def test_retime_reproduces_the_planners_own_plan(request, which):
    p, swarm = request.getfixturevalue(which)
    again = Retimer(GRAPH, swarm, CONFIG).retime(p)
    assert plan_to_json(again.plan) == plan_to_json(p)
    assert again.rule == again.plan.links  # the planner followed the rule
    # Also after the wire's rounding (what a proposal actually carries).
    carried = plan_from_json(plan_to_json(p))
    assert plan_to_json(Retimer(GRAPH, swarm, CONFIG).retime(carried).plan) == plan_to_json(p)


def test_retime_refuses_a_replica_that_cannot_hold_its_stage(fast):
    p, _ = fast
    peer = p.stages[0].peers[0]
    small = view(4, **{peer: record(peer, memory=GIB // 4)})
    with pytest.raises(PlanCheckError, match=r"needs .* GiB"):
        Retimer(GRAPH, small, CONFIG).retime(p)


def test_retime_refuses_a_replica_the_others_would_carry():
    swarm = view(4)
    p = plan_in(swarm, max_replicas=2, max_stages=2)
    k = next(i for i, s in enumerate(p.stages) if len(s.peers) == 2)
    weak = p.stages[k].peers[1]
    small = view(4, **{weak: record(weak, memory=GIB // 4)})
    with pytest.raises(PlanCheckError, match="cannot hold"):
        Retimer(GRAPH, small, CONFIG).retime(p)


def test_retime_refuses_peers_outside_the_view(fast):
    p, swarm = fast
    with pytest.raises(PlanCheckError, match="outside our view"):
        Retimer(GRAPH, swarm, CONFIG).retime(with_stage(p, 0, peers=("stranger",)))


def test_retime_refuses_an_uncuttable_cut(fast):
    p, swarm = fast
    graph = dataclasses.replace(GRAPH, uncuttable=frozenset({p.stages[1].start}))
    with pytest.raises(PlanCheckError, match="cannot ship"):
        Retimer(graph, swarm, CONFIG).retime(p)


def test_wire_bytes_for_the_planners_codecs():
    assert wire_bytes_for("dense", 1.0, 4000, CONFIG) == 4000
    assert wire_bytes_for("fp16", 1.0, 4000, CONFIG) == 2000
    assert wire_bytes_for("topk", 0.25, 4000, CONFIG) == topk_wire_bytes(1000, 0.25)
    for codec, ratio in [("dense", 0.5), ("fp16", 0.5), ("topk", 1.0), ("topk", 0.001),
                         ("zstd", 1.0), ("topk", -0.5)]:  # fmt: skip
        with pytest.raises(PlanCheckError, match="not one the planner makes"):
            wire_bytes_for(codec, ratio, 4000, CONFIG)
    no_fp16 = dataclasses.replace(CONFIG, allow_fp16=False)
    with pytest.raises(PlanCheckError):
        wire_bytes_for("fp16", 1.0, 4000, no_fp16)


# ----------------------------------------------------------------------------- audit


@pytest.mark.parametrize("which", ["fast", "slow"])
def test_an_honest_plan_audits_clean(request, which):
    p, swarm = request.getfixturevalue(which)
    result = full_audit(p, swarm)
    assert result == Audit(view=CLEAN, own=CLEAN, compression=CLEAN)
    assert str(result) == "every figure at least ours"


def test_a_claim_above_ours_costs_nothing(fast):
    p, swarm = fast
    slower = with_stage(p, 0, forward_time=1.0)
    modest = dataclasses.replace(slower, estimated_step_time=p.estimated_step_time * 10)
    assert modest.estimated_step_time > simulate(modest.pipeline_times()).step_time
    assert full_audit(modest, swarm) == Audit(view=CLEAN, own=CLEAN, compression=CLEAN)


@pytest.mark.parametrize(
    ("lie", "figure"),
    [
        (lambda p: dataclasses.replace(p, estimated_step_time=p.estimated_step_time * 0.5),
         "estimated step time"),
        (lambda p: with_stage(p, 0, forward_time=p.stages[0].forward_time * 0.5),
         "stage 0 forward time"),
        (lambda p: with_stage(p, 1, backward_time=p.stages[1].backward_time * 0.5),
         "stage 1 backward time"),
        (lambda p: with_stage(p, 0, memory_bytes=(p.stages[0].memory_bytes[0] // 2,)),
         "stage 0 memory on"),
    ],
)  # fmt: skip
def test_an_understated_figure_sets_the_slack(fast, lie, figure):
    p, swarm = fast
    result = audited(lie(p), swarm)
    assert result.slack == pytest.approx(0.5, rel=1e-3)
    assert result.figure.startswith(figure)
    assert "claims" in str(result)


def test_the_worst_figure_wins(fast):
    p, swarm = fast
    both = dataclasses.replace(p, estimated_step_time=p.estimated_step_time * 0.9)
    both = with_stage(both, 0, forward_time=p.stages[0].forward_time * 0.6)
    result = audited(both, swarm)
    assert result.figure == "stage 0 forward time"
    assert result.slack == pytest.approx(0.6, rel=1e-3)


def test_a_faster_bandwidth_claim_is_caught_by_the_step_time(slow):
    """A plan made where links look 8x faster: fine there, understated here."""
    _, swarm = slow
    boasted = view(4, **{f"peer{i}": record(f"peer{i}", bandwidth=16e6) for i in range(4)})
    optimistic = plan(GRAPH, boasted, dataclasses.replace(CONFIG, min_stages=2))
    result = audited(optimistic, swarm)
    assert result.slack < 1 - LIMITS.tolerance, result


@pytest.mark.parametrize(("faster", "believed"), [(1.6, True), (4.0, False)])
def test_a_view_that_drifted_by_the_measured_noise_is_believed_an_octave_beyond_is_not(
    faster, believed
):
    """Loopback links under training load drift by ~1.6x between epochs (a node's own plan
    refused 2 s after it made it, with a tight bar): that much is believed, 4x is not."""
    here = view(4, **{f"peer{i}": record(f"peer{i}", bandwidth=2e6) for i in range(4)})
    made_in = view(4, **{f"peer{i}": record(f"peer{i}", bandwidth=2e6 * faster) for i in range(4)})
    config = dataclasses.replace(CONFIG, min_stages=2)
    result = full_audit(plan(GRAPH, made_in, config), here, config)
    assert result.view.slack < 1.0  # the plan does claim more than we see
    assert result.own == CLEAN
    assert result.believable(LIMITS) is believed


def test_compression_beyond_the_rule_is_caught(fast):
    """A link compressed where we see room for dense: consistent bytes, but fewer than ours."""
    p, swarm = fast
    dense = p.links[0].dense_bytes
    squeezed = with_link(p, 0, forward_codec="topk", forward_ratio=0.1,
                         forward_wire_bytes=topk_wire_bytes(dense // 4, 0.1))  # fmt: skip
    result = audited(squeezed, swarm)
    assert result.figure == "link 0 forward wire bytes"
    assert result.slack < 0.2


def test_a_view_that_drifted_leaves_the_own_figures_clean(slow):
    """Links measured slower since the plan was made: every view figure may fall short, the
    figures no view enters do not (what a followed plan is held to)."""
    p, _ = slow
    slower = view(4, **{f"peer{i}": record(f"peer{i}", bandwidth=2.5e5) for i in range(4)})
    result = full_audit(p, slower)
    assert result.view.slack < 1 - LIMITS.tolerance
    assert result.own == CLEAN


@pytest.mark.parametrize(
    ("lie", "figure"),
    [
        (lambda p: dataclasses.replace(p, estimated_step_time=p.estimated_step_time * 0.5),
         "estimated step time (by its own figures)"),
        (lambda p: with_stage(p, 0, forward_time=p.stages[0].forward_time * 0.5),
         "stage 0 forward time"),
        (lambda p: with_stage(p, 0, memory_bytes=(p.stages[0].memory_bytes[0] // 2,)),
         "stage 0 memory on"),
    ],
)  # fmt: skip
def test_own_figures_catch_lies_in_any_view(slow, lie, figure):
    p, _ = slow
    faster = view(4)  # links far faster than the plan assumed: no view figure falls short
    result = full_audit(lie(p), faster)
    assert result.own.figure.startswith(figure)
    assert result.own.slack < 0.9


def test_a_link_claimed_at_no_bandwidth_is_refused(fast):
    p, swarm = fast
    with pytest.raises(PlanCheckError, match=r"claims a bandwidth of 0\.0"):
        full_audit(with_link(p, 0, forward_bandwidth=0.0), swarm)


def test_own_figures_refuse_a_plan_that_cannot_time_a_step(fast):
    p, swarm = fast
    with pytest.raises(RecordError, match="own figures"):
        full_audit(with_link(p, 0, forward_rtt=-1.0), swarm)


def test_compression_beyond_our_view_is_believed_only_within_its_tolerance(slow):
    """A plan compressed for links slower than we see: its own figures hold, its bytes fall
    short of AdaTopK at our bandwidth, and past compression_tolerance it is not believed."""
    p, _ = slow
    assert p.links[0].forward_ratio < 0.9
    faster = view(4, **{f"peer{i}": record(f"peer{i}", bandwidth=4e6) for i in range(4)})
    result = full_audit(p, faster)
    assert result.own == CLEAN
    assert result.compression.figure.startswith("link 0")
    assert "at our bandwidth" in result.compression.figure
    assert result.compression.slack < 1.0
    slack = result.compression.slack
    strict = AuditLimits(tolerance=0.99, compression_tolerance=max(0.0, 1 - slack - 0.01))
    loose = AuditLimits(tolerance=0.99, compression_tolerance=min(0.99, 1 - slack + 0.01))
    assert not result.believable(strict)
    assert result.believable(loose)


def test_fewer_micro_batches_than_the_swarms(fast):
    p, swarm = fast
    with pytest.raises(RecordError, match="micro-batches"):
        audited(dataclasses.replace(p, micro_batches=2), swarm)


@pytest.mark.parametrize(
    "changes",
    [
        {"forward_codec": "zstd"},
        {"forward_ratio": 0.5},  # dense at a ratio
        {"backward_codec": "topk", "backward_ratio": 0.001, "backward_wire_bytes": 1},  # < min
    ],
)
def test_codecs_must_be_ones_the_rule_makes(fast, changes):
    p, swarm = fast
    with pytest.raises(PlanCheckError, match=r"link 0: .* not one the planner makes"):
        audited(with_link(p, 0, **changes), swarm)


@pytest.mark.parametrize(
    "changes",
    [
        {"forward_wire_bytes": 1},  # dense with fewer bytes than dense
        {"backward_codec": "fp16", "backward_ratio": 1.0, "backward_wire_bytes": 7},
        {"backward_codec": "topk", "backward_ratio": 0.5, "backward_wire_bytes": 1000},
    ],
)
def test_wire_bytes_must_be_the_codecs(fast, changes):
    p, swarm = fast
    with pytest.raises(RecordError, match=r"link 0 .* bytes on the wire"):
        audited(with_link(p, 0, **changes), swarm)


def test_a_dense_swarm_refuses_any_compression(slow):
    p, _ = slow
    swarm = view(4, **{f"peer{i}": record(f"peer{i}", bandwidth=2e6) for i in range(4)})
    dense_plan = plan_in(swarm, DENSE, min_stages=2)
    assert audited(dense_plan, swarm, DENSE).slack == 1.0
    with pytest.raises(PlanCheckError, match="the swarm sends dense"):
        audited(p, swarm, DENSE)


def test_dense_bytes_must_be_our_models(fast):
    p, swarm = fast
    with pytest.raises(RecordError, match="dense bytes"):
        audited(with_link(p, 0, dense_bytes=10, forward_wire_bytes=10, backward_wire_bytes=10),
                swarm)  # fmt: skip


def test_shares_must_follow_the_devices():
    swarm = view(4)
    p = plan_in(swarm, max_replicas=2, max_stages=2)
    k = next(i for i, s in enumerate(p.stages) if len(s.peers) == 2)
    assert audited(p, swarm).slack == 1.0
    skewed = with_stage(p, k, shares=(0.1, 0.9))
    with pytest.raises(RecordError, match="shares"):
        audited(skewed, swarm)


def test_negative_figures_are_refused(fast):
    p, swarm = fast
    with pytest.raises(RecordError, match=r"negative|must be finite and >= 0"):
        audited(with_stage(p, 0, allreduce_time=-1.0), swarm)


def test_measured_links_enter_the_recomputation(slow):
    """Our book measured the plan's link at a quarter of what the plan assumed: its codec, run
    over the link we see, takes longer than it claims (AdaTopK alone would have hidden it)."""
    p, _ = slow
    link = p.links[0]
    book = BandwidthBook(max_age_s=60.0)
    for src, dst in ((link.src_peer, link.dst_peer), (link.dst_peer, link.src_peer)):
        book.record(src, dst, LinkSample(bandwidth=5e5, rtt=0.05, measured_at=NOW), now=NOW)
    slow_records = {f"peer{i}": record(f"peer{i}", bandwidth=2e6) for i in range(4)}
    measured = view(4, book=book, **slow_records)
    assert audited(p, measured).slack < 1 - LIMITS.tolerance


@pytest.mark.parametrize(
    "limits",
    [{"tolerance": -0.1}, {"tolerance": 1.0}, {"own_tolerance": 1.5}, {"share_tolerance": 0.5},
     {"compression_tolerance": -1}],
)  # fmt: skip
def test_audit_limits_are_validated(limits):
    with pytest.raises(ConfigError):
        AuditLimits(**limits)


def audit_trusting(claimed: Plan, swarm: Swarm, trust: float, config: PlanConfig) -> Audit:
    retimer = Retimer(GRAPH, swarm, config, unmeasured_trust=trust)
    return audit(claimed, retimer.retime(claimed), config, LIMITS)


def measured_book(bandwidth: float, n: int = 4) -> BandwidthBook:
    book = BandwidthBook(max_age_s=60.0)
    for i in range(n):
        for j in range(n):
            if i != j:
                book.record(f"peer{i}", f"peer{j}", LinkSample(bandwidth, 0.01, NOW), now=NOW)
    return book


@pytest.mark.parametrize(("faster", "trust", "believed"),
                         [(4.0, 8.0, True), (4.0, 1.0, False)])  # fmt: skip
def test_a_link_we_have_not_measured_is_believed_up_to_the_trust_factor(faster, trust, believed):
    """The proposer measured links ``faster`` times what the ends' records give us; we have
    measured none. Our estimate is no evidence that the proposer's probes were wrong: up to
    ``unmeasured_trust`` the claim stands (the testbed's first plans were refused at ~5x)."""
    config = dataclasses.replace(CONFIG, min_stages=2)
    here = view(4, **{f"peer{i}": record(f"peer{i}", bandwidth=2e6) for i in range(4)})
    made_in = view(4, book=measured_book(2e6 * faster),
                   **{f"peer{i}": record(f"peer{i}", bandwidth=2e6) for i in range(4)})  # fmt: skip
    result = audit_trusting(plan(GRAPH, made_in, config), here, trust, config)
    assert result.believable(LIMITS) is believed, result


def test_a_claim_beyond_the_trust_factor_is_timed_at_the_bound():
    config = dataclasses.replace(CONFIG, min_stages=2)
    records = {f"peer{i}": record(f"peer{i}", bandwidth=2e6) for i in range(4)}
    here = view(4, **records)
    claimed = plan(GRAPH, view(4, book=measured_book(2e6 * 32), **records), config)
    ours = Retimer(GRAPH, here, config, unmeasured_trust=8.0).retime(claimed).plan
    assert claimed.links[0].forward_bandwidth > 2e6 * 16
    assert ours.links[0].forward_bandwidth == pytest.approx(2e6 * 8, rel=0.2)  # quantized grid
    assert ours.estimated_step_time > claimed.estimated_step_time


def test_a_link_we_measured_is_judged_by_our_figure_whatever_the_trust():
    """The same 4x claim, but we measured the links at the records' figure: refused."""
    config = dataclasses.replace(CONFIG, min_stages=2)
    records = {f"peer{i}": record(f"peer{i}", bandwidth=2e6) for i in range(4)}
    here = view(4, book=measured_book(2e6), **records)
    made_in = view(4, book=measured_book(8e6), **records)
    result = audit_trusting(plan(GRAPH, made_in, config), here, 8.0, config)
    assert not result.believable(LIMITS), result
    assert result.view.figure == "estimated step time"


@pytest.mark.parametrize("trust", [0.5, math.inf, math.nan])
def test_the_trust_factor_is_at_least_one_and_finite(trust):
    with pytest.raises(ConfigError, match="unmeasured_trust"):
        Retimer(GRAPH, view(2), CONFIG, unmeasured_trust=trust)
    with pytest.raises(ConfigError, match="unmeasured_trust"):
        AuditLimits(unmeasured_trust=trust)
