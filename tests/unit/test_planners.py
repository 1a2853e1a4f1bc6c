"""Who plans afresh in an epoch (node/control/planners.py): pure functions of the records."""

import math
from dataclasses import replace

from fusionllm.dht.records import NodeState
from fusionllm.node.control.agreement import epoch_at
from fusionllm.node.control.backoff import BackoffConfig
from fusionllm.node.control.planners import cpu_class, planners
from tests.unit.test_epochs import T0, FakeClock, count_plans, epoch_round, record, swarm_of


def host(peer: str, op_overhead: float, pace: float = 1.0):
    info = record(peer, pace=pace)
    return replace(info, device=replace(info.device, op_overhead=op_overhead))


def test_equal_members_take_turns_the_same_on_every_node_and_vary_by_epoch():
    members = {f"peer{i}": host(f"peer{i}", 3e-5) for i in range(16)}
    chosen = [planners(epoch, members, 3) for epoch in range(200)]
    assert all(len(c) == 3 and c <= set(members) for c in chosen)
    reordered = dict(reversed(list(members.items())))
    assert planners(7, reordered, 3) == chosen[7]  # order does not matter
    counts = {peer: sum(peer in c for c in chosen) for peer in members}
    assert min(counts.values()) >= 10  # each takes a turn (mean 200 * 3 / 16 = 37.5)
    two = dict(list(members.items())[:2])
    assert planners(7, two, 3) == frozenset(two)


def test_the_members_with_the_most_spare_cpu_plan_and_the_small_homes_never_do():
    # Topology C's shares: 0.8, 0.4, 0.4, 0.2, 0.2 of a core (seconds per operator go as 1/share).
    shares = {"h1": 0.8, "h2": 0.4, "h3": 0.4, "h4": 0.2, "h5": 0.2}
    members = {p: host(p, 2.7e-5 / share) for p, share in shares.items()}
    for epoch in range(100):
        assert planners(epoch, members, 3) == {"h1", "h2", "h3"}
        assert planners(epoch, members, 1) == {"h1"}
    # Equals within the class take turns: h2 and h3 share the second seat.
    assert {next(iter(planners(e, members, 2) - {"h1"})) for e in range(100)} == {"h2", "h3"}
    # OP-Fence seats h2 and h1: a seated member counts one class slower, so the idle h3
    # joins h1 (0.8 core, seated: as slow a class as h3) and h2 plans no more than h4 or h5.
    seated = {p: replace(i, state=NodeState.SERVING, stage=0) if p in ("h1", "h2") else i
              for p, i in members.items()}  # fmt: skip
    for epoch in range(100):
        assert planners(epoch, seated, 2) == {"h1", "h3"}
    thirds = {next(iter(planners(e, seated, 3) - {"h1", "h3"})) for e in range(100)}
    assert thirds == {"h2", "h4", "h5"}


def test_a_measured_pace_counts_and_a_record_without_a_figure_plans_last():
    members = {"fast": host("fast", 1e-5), "slowed": host("slowed", 1e-5, pace=8.0),
               "blank": host("blank", 0.0), "mid": host("mid", 4e-5)}  # fmt: skip
    assert cpu_class(members["blank"]) == math.inf
    assert cpu_class(members["slowed"]) == cpu_class(host("x", 8e-5))
    for epoch in range(50):
        assert planners(epoch, members, 2) == {"fast", "mid"}
        assert planners(epoch, members, 3) == {"fast", "mid", "slowed"}


def test_in_a_swarm_the_small_homes_seldom_plan_yet_follow_the_same_plan():
    clock = FakeClock(T0 + 0.1)
    _, nodes = swarm_of(5, clock)
    for node, share in zip(nodes, (0.8, 0.4, 0.4, 0.2, 0.2), strict=True):
        node.device = replace(record(node.peer).device, op_overhead=2.7e-5 / share)
        node.heartbeat()
    calls = {node.peer: count_plans(node) for node in nodes}
    e = epoch_at(T0, 2.0)
    for k in range(12):
        clock.now = T0 + 2.0 * k + 0.1
        epoch_round(nodes, e + k)
        assert len({n.agreement.adopted.digest for n in nodes}) == 1
    # The planners plan at once; each small home plans for a change only once it has waited
    # max_gap (8) turns, once here, where every member planned in the first epoch before.
    assert len(calls["peer0"]) >= 2
    assert calls["peer1"] or calls["peer2"]
    assert len(calls["peer3"]) <= 1
    assert len(calls["peer4"]) <= 1


def test_a_member_whose_planners_never_propose_plans_itself_an_epoch_later():
    """A record that claims the swarm's fastest CPU and never proposes (a liar, or a planner
    that hangs) costs the swarm one epoch: no plan came, so the member plans."""
    clock = FakeClock(T0 + 0.1)
    directory, (node,) = swarm_of(1, clock, backoff=BackoffConfig(planners=1))
    boaster = record("boaster", at=clock.now)
    fastest = replace(boaster.device, op_overhead=1e-7)
    directory.records["boaster"] = replace(boaster, device=fastest)
    calls = count_plans(node)
    e = epoch_at(T0, 2.0)
    epoch_round([node], e)
    assert calls == []
    assert e not in directory.plans
    assert node.agreement.adopted is None
    clock.now += 2.0
    directory.records["boaster"] = replace(directory.records["boaster"], time=clock.now)
    epoch_round([node], e + 1)
    assert len(calls) == 1
    assert "peer0" in directory.plans[e + 1]
    assert node.agreement.adopted is not None


def test_planners_that_only_re_propose_an_old_plan_hold_a_change_back_max_gap_turns():
    """A newcomer joins; the only planner (a record claiming the fastest CPU) re-proposes the
    old plan every epoch and never plans: we believe that plan, so nothing is unanswered, but
    after ``max_gap`` turns of waiting we plan for the change ourselves."""
    clock = FakeClock(T0 + 0.1)
    directory, (node,) = swarm_of(1, clock, backoff=BackoffConfig(planners=1, max_gap=4))
    e = epoch_at(T0, 2.0)
    epoch_round([node], e)  # alone: we are the planner, and follow our plan
    old = node.agreement.adopted.proposal
    calls = count_plans(node)
    boaster = record("boaster", at=clock.now)
    fastest = replace(boaster.device, op_overhead=1e-7)
    planned_at = None
    for k in range(1, 8):
        clock.now = T0 + 2.0 * k + 0.1
        directory.records["boaster"] = replace(boaster, device=fastest, time=clock.now)
        directory.propose(replace(old, epoch=e + k, proposer="boaster"), ttl_s=10.0)
        epoch_round([node], e + k)
        if calls and planned_at is None:
            planned_at = k
        assert node.agreement.adopted.digest == old.digest or planned_at is not None
    assert planned_at == 1 + 4  # deferred in epoch e + 1, planned once 4 turns had passed
    assert len(calls) == 1
