"""node/agreement.py: the pure rules every node applies to the same proposals."""

import dataclasses
import hashlib
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fusionllm.dag.plan_check import Retimer
from fusionllm.dag.plan_wire import plan_to_json
from fusionllm.dag.planner import Plan, PlanConfig, plan
from fusionllm.dag.swarm import Swarm
from fusionllm.dag.synthetic import gpt2_costs
from fusionllm.dht.records import DeviceInfo, NodeInfo, NodeState, PlanProposal, RecordError
from fusionllm.node.control.agreement import (
    Candidate,
    EpochView,
    NotAMemberError,
    backup_pool,
    check_plan,
    check_proposal,
    choose,
    epoch_at,
    epoch_start,
    fresh_members,
    keep_incumbent,
    serving_peers,
)
from fusionllm.node.control.audit import AuditLimits
from fusionllm.node.control.bandwidth import BandwidthBook

MEMORY = 8 << 30
FRACTION = 0.9
SWARM, EPOCH = "demo", 42
GRAPH = gpt2_costs("small", batch=1, seq=128)
NODE_IDS = tuple(n.node_id for n in GRAPH.nodes)
CONFIG = PlanConfig(micro_batches=4, batch_size=8, memory_fraction=FRACTION)
NOW = 1.7e9


def member(peer_id: str, memory: int = MEMORY) -> NodeInfo:
    return NodeInfo(
        peer_id=peer_id,
        swarm=SWARM,
        addrs=(),
        dht_addrs=(),
        device=DeviceInfo(name="gpu", kind="cuda", memory_bytes=memory, flops=1e12,
                          memory_bandwidth=1e11, op_overhead=0.0, cpu_cores=8, ram_bytes=MEMORY),
        uplink=1e9,
        downlink=1e9,
        links=(),
        software="fusionllm 0.1.0",
        config_digest="0123456789abcdef",
        state=NodeState.BACKUP,
        stage=None,
        adopted=None,
        time=NOW,
    )  # fmt: skip


def swarm_of(members: dict[str, NodeInfo]) -> Swarm:
    """The planner's view of ``members``, as a node builds it (quantized, no measured links)."""
    return BandwidthBook(max_age_s=60.0).swarm(sorted(members.values(), key=lambda m: m.peer_id),
                                               now=NOW)  # fmt: skip


def make_plan(n_peers: int, **config) -> Plan:
    settings = {"micro_batches": 4, "batch_size": 8, "memory_fraction": FRACTION, **config}
    return plan(GRAPH, swarm_of(members_of(n_peers)), PlanConfig(**settings))


def view_of(members: dict[str, NodeInfo], **changes) -> EpochView:
    fields = {"swarm": SWARM, "epoch": EPOCH, "members": members, "node_ids": NODE_IDS,
              "config": CONFIG, "retimer": Retimer(GRAPH, swarm_of(members), CONFIG)}  # fmt: skip
    fields.update(changes)
    return EpochView(**fields)


@pytest.fixture(scope="module")
def pipeline() -> Plan:
    """Several stages, one peer each, and peers left in backup."""
    p = make_plan(4, max_replicas=1, max_stages=3)
    assert len(p.stages) >= 2
    assert p.backup
    assert all(len(s.peers) == 1 for s in p.stages)
    return p


@pytest.fixture(scope="module")
def replicated() -> Plan:
    p = make_plan(8, max_stages=2)
    assert any(len(s.peers) >= 2 for s in p.stages)
    return p


def members_of(n: int, **memory: int) -> dict[str, NodeInfo]:
    ids = [f"peer{i}" for i in range(n)]
    return {pid: member(pid, memory.get(pid, MEMORY)) for pid in ids}


def proposal_of(p: Plan, **changes) -> PlanProposal:
    fields = {"swarm": SWARM, "epoch": EPOCH, "proposer": "peer0",
              "estimate": p.estimated_step_time, "plan": plan_to_json(p)}  # fmt: skip
    fields.update(changes)
    return PlanProposal(**fields)


def check(proposal: PlanProposal, members: dict | None = None) -> Candidate:
    return check_proposal(proposal, view_of(members or members_of(8)))


def check_p(p: Plan, members: dict | None = None, node_ids=NODE_IDS) -> None:
    check_plan(p, members=members or members_of(8), node_ids=node_ids, memory_fraction=FRACTION)


def with_stage(p: Plan, k: int, **changes) -> Plan:
    stages = list(p.stages)
    stages[k] = dataclasses.replace(stages[k], **changes)
    return dataclasses.replace(p, stages=tuple(stages))


def with_link(p: Plan, k: int, **changes) -> Plan:
    links = list(p.links)
    links[k] = dataclasses.replace(links[k], **changes)
    return dataclasses.replace(p, links=tuple(links))


# ----------------------------------------------------------------------------- epochs


def test_epoch_boundaries():
    assert epoch_at(0.0, 10.0) == 0
    assert epoch_at(9.999, 10.0) == 0
    assert epoch_at(10.0, 10.0) == 1
    assert epoch_at(1_700_000_005.0, 10.0) == 170_000_000
    assert epoch_start(170_000_000, 10.0) == 1_700_000_000.0
    assert isinstance(epoch_at(12.5, 2.5), int)


@given(now=st.floats(0.0, 4e9), epoch_s=st.floats(0.5, 3600.0))
def test_epoch_contains_now(now, epoch_s):
    epoch = epoch_at(now, epoch_s)
    assert epoch_start(epoch, epoch_s) <= now * (1 + 1e-12)
    assert now < epoch_start(epoch + 1, epoch_s) * (1 + 1e-12)


# ----------------------------------------------------------------------------- valid plans


def test_valid_proposal_is_accepted(pipeline):
    prop = proposal_of(pipeline)
    candidate = check(prop)
    assert candidate.proposal is prop
    assert candidate.digest == pipeline.digest() == prop.digest
    assert candidate.estimate == prop.estimate
    assert candidate.plan.digest() == pipeline.digest()


def test_valid_replicated_plan_is_accepted(replicated):
    assert check(proposal_of(replicated)).digest == replicated.digest()


def test_only_used_peers_need_to_be_alive(pipeline):
    alive = {pid: member(pid) for pid in serving_peers(pipeline)}
    check_p(pipeline, alive)


# ----------------------------------------------------------------------------- proposal level


@pytest.mark.parametrize(
    ("swarm", "epoch"), [("other", EPOCH), (SWARM, EPOCH - 1), (SWARM, EPOCH + 1)]
)
def test_wrong_swarm_or_epoch(pipeline, swarm, epoch):
    with pytest.raises(RecordError, match="proposal is for"):
        check(proposal_of(pipeline, swarm=swarm, epoch=epoch))


@pytest.mark.parametrize(
    "data", [b"junk", b"{}", b"[1, 2]", b'{"method": "x"}', b"\xff" * 10, b"{" * 5000]
)
def test_junk_plan_bytes(pipeline, data):
    with pytest.raises(RecordError):
        check(proposal_of(pipeline, plan=data))


@pytest.mark.parametrize("factor", [0.5, 0.999, 1.0 + 1e-6, 2.0])
def test_estimate_mismatch(pipeline, factor):
    with pytest.raises(RecordError, match="estimate"):
        check(proposal_of(pipeline, estimate=pipeline.estimated_step_time * factor))


def test_estimate_within_canonical_rounding_is_accepted(pipeline):
    check(proposal_of(pipeline, estimate=pipeline.estimated_step_time * (1 + 1e-12)))


def test_plan_level_rejection_surfaces_through_proposal(pipeline):
    members = members_of(8)
    del members[pipeline.stages[0].peers[0]]
    proposer = pipeline.stages[-1].peers[0]
    with pytest.raises(RecordError, match="not alive"):
        check(proposal_of(pipeline, proposer=proposer), members)


def test_a_plan_many_members_propose_is_audited_once_per_view(pipeline):
    """A stable swarm: every member proposes the same plan. The memo audits it once and hands
    each proposer its own Candidate; another estimate, or a stranger, is checked on its own."""
    view = view_of(members_of(8))
    retimed: list[str] = []
    retime = view.retimer.retime

    def counting(plan):
        retimed.append(plan.digest())
        return retime(plan)

    object.__setattr__(view.retimer, "retime", counting)
    checked: dict = {}
    props = [proposal_of(pipeline, proposer=f"peer{i}") for i in range(8)]
    candidates = [check_proposal(p, view, checked=checked) for p in props]
    assert len(retimed) == 1
    assert [c.proposal for c in candidates] == props
    assert {c.audit for c in candidates} == {candidates[0].audit}
    liar = proposal_of(pipeline, proposer="peer1", estimate=pipeline.estimated_step_time / 2)
    with pytest.raises(RecordError, match="estimate"):
        check_proposal(liar, view, checked=checked)
    with pytest.raises(NotAMemberError):
        check_proposal(proposal_of(pipeline, proposer="stranger"), view, checked=checked)
    assert len(retimed) == 1


# ----------------------------------------------------------------------------- members only


def test_a_non_member_proposal_is_refused_even_when_its_plan_is_valid(pipeline):
    prop = proposal_of(pipeline, proposer="stranger")
    with pytest.raises(NotAMemberError, match="not a fresh member"):
        check(prop)
    # The same plan from a member is fine: only the proposer made the difference.
    assert check(proposal_of(pipeline, proposer="peer7")).digest == prop.digest


def test_a_member_that_went_stale_may_not_propose(pipeline):
    records = members_of(8)
    records["peer7"] = dataclasses.replace(records["peer7"], time=NOW - 30)
    members = fresh_members(records, digest="0123456789abcdef", now=NOW, suspect_after_s=15,
                            max_skew_s=5)  # fmt: skip
    with pytest.raises(NotAMemberError):
        check(proposal_of(pipeline, proposer="peer7"), members)


def test_fresh_members_rules():
    base = member("a")
    records = {
        "a": base,
        "other-settings": dataclasses.replace(member("other-settings"), config_digest="ffff"),
        "leaving": dataclasses.replace(member("leaving"), state=NodeState.LEAVING),
        "stale": dataclasses.replace(member("stale"), time=NOW - 15.001),
        "edge-stale": dataclasses.replace(member("edge-stale"), time=NOW - 15.0),
        "ahead": dataclasses.replace(member("ahead"), time=NOW + 5.001),
        "edge-ahead": dataclasses.replace(member("edge-ahead"), time=NOW + 5.0),
    }
    fresh = fresh_members(records, digest=base.config_digest, now=NOW, suspect_after_s=15.0,
                          max_skew_s=5.0)  # fmt: skip
    assert sorted(fresh) == ["a", "edge-ahead", "edge-stale"]
    assert fresh["a"] is base


def test_micro_batches_must_be_the_swarms(pipeline):
    other = dataclasses.replace(pipeline, micro_batches=pipeline.micro_batches * 2)
    with pytest.raises(RecordError, match="micro-batches"):
        check(proposal_of(other))


def test_a_lying_estimate_is_checked_but_left_to_the_caller(pipeline):
    honest = check(proposal_of(pipeline))
    assert honest.audit.view.slack == 1.0
    assert honest.believable(AuditLimits(tolerance=0.0))
    lie = dataclasses.replace(pipeline, estimated_step_time=pipeline.estimated_step_time / 2)
    candidate = check(proposal_of(lie))
    assert candidate.audit.view.slack == pytest.approx(0.5)
    assert candidate.audit.view.figure.startswith("estimated step time")
    assert not candidate.consistent(AuditLimits())  # its own figures give twice the claim
    assert not candidate.believable(AuditLimits(tolerance=0.05))
    assert candidate.believable(AuditLimits(tolerance=0.51))
    shaded = dataclasses.replace(pipeline, estimated_step_time=pipeline.estimated_step_time * 0.97)
    assert check(proposal_of(shaded)).believable(AuditLimits(tolerance=0.05))


# ----------------------------------------------------------------------------- plan level


def test_dead_peer(pipeline):
    for stage in pipeline.stages:
        members = members_of(8)
        del members[stage.peers[0]]
        with pytest.raises(RecordError, match="not alive"):
            check_p(pipeline, members)


def test_memory_too_small(pipeline):
    stage = pipeline.stages[0]
    need = stage.memory_bytes[0]
    just_enough = math.ceil(need / FRACTION)
    check_p(pipeline, members_of(8, **{stage.peers[0]: just_enough}))
    with pytest.raises(RecordError, match="needs"):
        check_p(pipeline, members_of(8, **{stage.peers[0]: math.floor(need / FRACTION) - 1}))
    with pytest.raises(RecordError, match="needs"):
        check_p(pipeline, members_of(8, **{stage.peers[0]: need}))  # the fraction applies


def test_stricter_memory_fraction(pipeline):
    with pytest.raises(RecordError, match="needs"):
        check_plan(pipeline, members=members_of(8), node_ids=NODE_IDS, memory_fraction=0.01)


def test_wrong_node_ids(pipeline):
    with pytest.raises(RecordError, match="not our model's"):
        check_p(pipeline, node_ids=tuple(reversed(NODE_IDS)))
    other = tuple(n.node_id for n in gpt2_costs("medium", batch=1, seq=128).nodes)
    with pytest.raises(RecordError):
        check_p(pipeline, node_ids=other)
    renamed = (NODE_IDS[0] + "_x", *NODE_IDS[1:])
    with pytest.raises(RecordError, match="not our model's"):
        check_p(pipeline, node_ids=renamed)


def test_plan_covers_part_of_the_model(pipeline):
    with pytest.raises(RecordError, match="covers"):
        check_p(pipeline, node_ids=(*NODE_IDS, "extra_node"))
    last = len(pipeline.stages) - 1
    short = with_stage(pipeline, last, stop=pipeline.stages[last].stop - 1,
                       node_ids=pipeline.stages[last].node_ids[:-1])  # fmt: skip
    with pytest.raises(RecordError, match="covers"):
        check_p(short)


def test_no_stages(pipeline):
    with pytest.raises(RecordError, match="no stages"):
        check_p(dataclasses.replace(pipeline, stages=(), links=()))


def test_gap_between_stages(pipeline):
    s1 = pipeline.stages[1]
    gap = with_stage(pipeline, 1, start=s1.start + 1, node_ids=s1.node_ids[1:])
    with pytest.raises(RecordError, match="does not continue"):
        check_p(gap)


def test_overlapping_stages(pipeline):
    s1 = pipeline.stages[1]
    overlap = with_stage(pipeline, 1, start=s1.start - 1,
                         node_ids=NODE_IDS[s1.start - 1 : s1.stop])  # fmt: skip
    with pytest.raises(RecordError, match="does not continue"):
        check_p(overlap)


def test_empty_stage(pipeline):
    s0 = pipeline.stages[0]
    empty = with_stage(pipeline, 0, stop=s0.start, node_ids=())
    with pytest.raises(RecordError, match="does not continue"):
        check_p(empty)


def test_stage_index_out_of_order(pipeline):
    with pytest.raises(RecordError, match="does not continue"):
        check_p(with_stage(pipeline, 0, index=1))


def test_peer_in_two_stages(pipeline):
    twice = with_stage(pipeline, 1, peers=pipeline.stages[0].peers)
    with pytest.raises(RecordError, match="two stages"):
        check_p(twice)


def test_peer_twice_in_one_stage(replicated):
    k = next(i for i, s in enumerate(replicated.stages) if len(s.peers) >= 2)
    s = replicated.stages[k]
    dup = with_stage(replicated, k, peers=(s.peers[0],) * len(s.peers))
    with pytest.raises(RecordError, match="two stages"):
        check_p(dup)


def test_mismatched_peers_shares_memory(replicated):
    k = next(i for i, s in enumerate(replicated.stages) if len(s.peers) >= 2)
    s = replicated.stages[k]
    for changes in (
        {"shares": s.shares[:-1]},
        {"memory_bytes": (*s.memory_bytes, 1)},
        {"peers": s.peers[:-1]},
        {"peers": (), "shares": (), "memory_bytes": ()},
    ):
        with pytest.raises(RecordError, match="mismatched"):
            check_p(with_stage(replicated, k, **changes))


@pytest.mark.parametrize(
    "shares",
    [
        lambda n: (1.0,) * n,
        lambda n: (0.0,) * (n - 1) + (1.0,),
        lambda n: (-0.5,) + (1.5 / (n - 1),) * (n - 1),
        lambda n: (1.0 / n - 1e-3,) + (1.0 / n,) * (n - 1),
        lambda n: (math.inf,) * n,
        lambda n: (math.nan,) * n,
    ],
)
def test_shares_must_split_the_micro_batch(replicated, shares):
    k = next(i for i, s in enumerate(replicated.stages) if len(s.peers) >= 2)
    n = len(replicated.stages[k].peers)
    with pytest.raises(RecordError, match="shares"):
        check_p(with_stage(replicated, k, shares=shares(n)))


def test_link_count(pipeline):
    with pytest.raises(RecordError, match="one link per cut"):
        check_p(dataclasses.replace(pipeline, links=pipeline.links[:-1]))
    with pytest.raises(RecordError, match="one link per cut"):
        check_p(dataclasses.replace(pipeline, links=pipeline.links + pipeline.links[-1:]))


@pytest.mark.parametrize("src_stage", [-1, 99])
def test_link_outside_pipeline(pipeline, src_stage):
    with pytest.raises(RecordError, match="outside the pipeline"):
        check_p(with_link(pipeline, 0, src_stage=src_stage))


def test_link_after_last_stage(pipeline):
    last = len(pipeline.stages) - 1
    with pytest.raises(RecordError, match="outside the pipeline"):
        check_p(with_link(pipeline, 0, src_stage=last))


def test_link_endpoints_outside_stages(pipeline):
    link = pipeline.links[0]
    backup = pipeline.backup[0]
    with pytest.raises(RecordError, match="starts outside"):
        check_p(with_link(pipeline, 0, src_peer=backup))
    with pytest.raises(RecordError, match="ends outside"):
        check_p(with_link(pipeline, 0, dst_peer=backup))
    with pytest.raises(RecordError, match="starts outside"):  # reversed direction
        check_p(with_link(pipeline, 0, src_peer=link.dst_peer, dst_peer=link.src_peer))


def test_mutated_plan_through_proposal(pipeline):
    """A plan wrong in the details but well-formed JSON: refused, and as a RecordError."""
    twice = with_stage(pipeline, 1, peers=pipeline.stages[0].peers)
    prop = proposal_of(twice, estimate=twice.estimated_step_time)
    with pytest.raises(RecordError, match="two stages"):
        check(prop)


# ----------------------------------------------------------------------------- choosing


def candidate(estimate: float, plan_bytes: bytes, p: Plan) -> Candidate:
    prop = PlanProposal(swarm=SWARM, epoch=EPOCH, proposer="peer0", estimate=estimate,
                        plan=plan_bytes)  # fmt: skip
    return Candidate(prop, p)


def test_choose_lowest_estimate(pipeline):
    cands = [candidate(e, f"plan{e}".encode(), pipeline) for e in (0.7, 0.5, 0.9)]
    assert choose(cands).estimate == 0.5
    assert choose(reversed(cands)).estimate == 0.5


def test_choose_ties_by_lowest_digest(pipeline):
    cands = [candidate(0.5, bytes([i]), pipeline) for i in range(10)]
    lowest = min(hashlib.sha256(bytes([i])).hexdigest() for i in range(10))
    assert choose(cands).digest == lowest
    assert choose(iter(reversed(cands))).digest == lowest
    # A lower estimate still beats a lower digest.
    slow_low = candidate(0.6, b"zzz", pipeline)
    assert choose([slow_low, *cands]).estimate == 0.5


def test_a_candidates_score_is_its_claim_or_our_slower_figure(pipeline):
    """A followed plan is re-proposed with the claim it was made with (0.5 s on idle links):
    its score is what it takes in our view now (0.9 s); a claim above our figure stands."""
    stale = dataclasses.replace(candidate(0.5, b"followed", pipeline), retimed_estimate=0.9)
    assert stale.score == 0.9
    modest = dataclasses.replace(candidate(0.8, b"modest", pipeline), retimed_estimate=0.6)
    assert modest.score == 0.8
    # Ranking stays by claims: every node ranks the same proposals the same way.
    assert choose([stale, modest]).digest == stale.digest


def test_choose_nothing():
    assert choose([]) is None
    assert choose(iter(())) is None


@given(estimates=st.lists(st.sampled_from([0.25, 0.5, 1.0]), min_size=1, max_size=8),
       order=st.randoms(use_true_random=False))  # fmt: skip
def test_choose_is_order_independent(pipeline, estimates, order):
    cands = [candidate(e, f"p{i}".encode(), pipeline) for i, e in enumerate(estimates)]
    best = choose(cands)
    order.shuffle(cands)
    assert choose(cands).digest == best.digest
    assert best.estimate == min(estimates)


def test_keep_incumbent():
    assert keep_incumbent(1.0, 0.95, 0.1)  # better, but within the margin
    assert keep_incumbent(1.0, 0.9, 0.1)  # exactly at the margin
    assert not keep_incumbent(1.0, 0.89, 0.1)  # clearly better: switch
    assert keep_incumbent(1.0, 1.5, 0.1)  # worse: keep
    assert keep_incumbent(1.0, 1.0, 0.0)
    assert not keep_incumbent(1.0, 0.999, 0.0)  # no margin: any improvement switches


def test_serving_peers_and_backup_pool(pipeline):
    used = serving_peers(pipeline)
    # Every stage's one replica, each a distinct peer: as many as stages, none in backup.
    assert len(used) == len(pipeline.stages)
    assert used.isdisjoint(pipeline.backup)
    assert used | set(pipeline.backup) == {f"peer{i}" for i in range(4)}
    members = [f"peer{i}" for i in range(8)] + ["late-joiner"]
    pool = backup_pool(pipeline, reversed(members))
    assert pool == sorted(set(members) - used)
    assert "late-joiner" in pool
    assert not used & set(pool)
    assert backup_pool(pipeline, []) == []
    assert backup_pool(pipeline, used) == []


def test_a_plan_of_another_method_than_the_swarms_is_refused(pipeline):
    naive = view_of(members_of(8), config=dataclasses.replace(CONFIG, planner="naive"))
    with pytest.raises(RecordError, match="op-fence plan, but the swarm plans naive"):
        check_proposal(proposal_of(pipeline), naive)
