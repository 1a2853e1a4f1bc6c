"""node/control/epochs.py: a node's plan epochs with a fake DHT directory and a fake clock.

No processes and no sleeps: ``FakeDirectory`` holds records and proposals in memory (what
``SwarmDirectory`` would read back from the DHT), ``FakeClock`` moves only when the loop waits.
"""

import dataclasses
import itertools

import pytest

from fusionllm.dag.plan_wire import plan_from_json, plan_to_json
from fusionllm.dag.switch_cost import SwitchPolicy
from fusionllm.dag.synthetic import gpt2_costs
from fusionllm.dht.records import (
    DeviceInfo,
    NodeInfo,
    NodeState,
    PlanProposal,
    TrainingProgress,
)
from fusionllm.node.control.agreement import epoch_at, next_step, serving_peers
from fusionllm.node.control.backoff import BackoffConfig
from fusionllm.node.control.bandwidth import BandwidthBook, LinkSample
from fusionllm.node.control.epochs import PlanAgreement
from fusionllm.node.control.planners import planners
from fusionllm.node.control.quiet import MAX_BEAT
from fusionllm.node.control.swarm_settings import SwarmSettings

SETTINGS = SwarmSettings(
    swarm="demo", heartbeat_s=1.0, ttl_s=5.0, epoch_s=2.0, max_replicas=1, quiet_max_stride=8
)
GRAPH = gpt2_costs("small", batch=1, seq=64)
NODE_IDS = tuple(n.node_id for n in GRAPH.nodes)
# Never quiet (quiet.py): the loop's tests count epochs.
LOUD = dataclasses.replace(SETTINGS, quiet_max_stride=1)
T0 = 1_700_000_000.0  # an epoch start (epoch_s 2)
GIB = 1 << 30


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeStop:
    """threading.Event's face for the loop: waiting moves the fake clock."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.waits: list[float] = []
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        self.clock.now += timeout
        return self._set


class FakeDirectory:
    def __init__(self) -> None:
        self.records: dict[str, NodeInfo] = {}
        self.plans: dict[int, dict[str, PlanProposal]] = {}
        self.ttls: dict[int, dict[str, float]] = {}

    def members(self, *, include_leaving: bool = False) -> dict[str, NodeInfo]:
        return {p: i for p, i in self.records.items()
                if include_leaving or i.state is not NodeState.LEAVING}  # fmt: skip

    def proposals(self, epoch: int) -> list[PlanProposal]:
        return list(self.plans.get(epoch, {}).values())

    def propose(self, proposal: PlanProposal, *, ttl_s: float) -> bool:
        self.plans.setdefault(proposal.epoch, {})[proposal.proposer] = proposal
        self.ttls.setdefault(proposal.epoch, {})[proposal.proposer] = ttl_s
        return True


def record(peer: str, *, at: float = T0, memory: int = 8 * GIB, **changes) -> NodeInfo:
    device = DeviceInfo(
        name="cpu",
        kind="cpu",
        memory_bytes=memory,
        flops=1e11,
        memory_bandwidth=1e10,
        op_overhead=1e-5,
        cpu_cores=2,
        ram_bytes=memory,
    )
    fields = dict(peer_id=peer, swarm="demo", addrs=(), dht_addrs=(), device=device, uplink=1e8,
                  downlink=1e8, links=(), software="t", config_digest=SETTINGS.digest(),
                  state=NodeState.BACKUP, stage=None, adopted=None, time=at)  # fmt: skip
    fields.update(changes)
    return NodeInfo(**fields)


class Node:
    """One PlanAgreement over a shared FakeDirectory, with the events it emitted."""

    def __init__(self, peer: str, directory: FakeDirectory, clock: FakeClock, **kw) -> None:
        self.peer, self.directory, self.clock = peer, directory, clock
        self.events: list[dict] = []
        self.memory = kw.pop("memory", 8 * GIB)
        self.bandwidth = kw.pop("bandwidth", 1e8)  # what its record says of its access link
        self.device = kw.pop("device", None)  # None: record()'s CPU
        self.observer = kw.pop("observer", False)
        self.agreement = PlanAgreement(
            settings=kw.pop("settings", SETTINGS),
            costs=GRAPH,
            node_ids=NODE_IDS,
            peer_id=peer,
            directory=directory,
            book=BandwidthBook(max_age_s=60.0),
            own_info=self.info,
            emit=lambda event, **fields: self.events.append({"event": event, **fields}),
            clock=clock,
            switch_policy=kw.pop("switch_policy", None),
            backoff=kw.pop("backoff", None),
            link_wait_s=kw.pop("link_wait_s", 0.0),
        )

    def info(self) -> NodeInfo:
        a = self.agreement
        adopted = (a.adopted_epoch, a.adopted.digest) if a.adopted is not None else None
        return record(self.peer, at=self.clock(), memory=self.memory, adopted=adopted,
                      uplink=self.bandwidth, downlink=self.bandwidth,
                      config_digest=a.settings.digest(), observer=self.observer,
                      **({"device": self.device} if self.device else {}))  # fmt: skip

    def heartbeat(self) -> None:
        self.directory.records[self.peer] = self.info()


def swarm_of(n: int, clock: FakeClock, **kw) -> tuple[FakeDirectory, list[Node]]:
    directory = FakeDirectory()
    nodes = [Node(f"peer{i}", directory, clock, **kw) for i in range(n)]
    for node in nodes:
        node.heartbeat()
    return directory, nodes


def epoch_round(nodes: list[Node], epoch: int) -> None:
    for node in nodes:
        node.agreement.propose(epoch)
    for node in nodes:
        node.heartbeat()
    for node in nodes:
        node.agreement.adopt(epoch)
    for node in nodes:
        node.heartbeat()


# ----------------------------------------------------------------------------- schedule


def test_next_step_schedule():
    kw = {"epoch_s": 2.0, "settle_fraction": 0.5}
    e = epoch_at(T0, 2.0)
    # Proposed in e, not adopted: wait for the settle time, then adopt (even late).
    assert next_step(T0 + 0.2, proposed=e, adopted_for=e - 1, **kw) == (None, e, T0 + 1.0)
    assert next_step(T0 + 1.0, proposed=e, adopted_for=e - 1, **kw) == ("adopt", e, T0 + 1.0)
    assert next_step(T0 + 9.0, proposed=e, adopted_for=e - 1, **kw) == ("adopt", e, T0 + 9.0)
    # Adopted: wait for the next epoch, then propose in the epoch we are in.
    assert next_step(T0 + 1.5, proposed=e, adopted_for=e, **kw) == (None, e, T0 + 2.0)
    assert next_step(T0 + 2.0, proposed=e, adopted_for=e, **kw) == ("propose", e + 1, T0 + 2.0)
    assert next_step(T0 + 7.0, proposed=e, adopted_for=e, **kw) == ("propose", e + 3, T0 + 7.0)


def test_the_loop_proposes_then_adopts_every_epoch():
    clock = FakeClock(T0 + 0.1)
    directory, (node,) = swarm_of(1, clock, settings=LOUD)
    stop = FakeStop(clock)
    node.agreement.run(stop, end=T0 + 8.05)
    e = epoch_at(T0, 2.0)
    assert sorted(directory.plans) == [e, e + 1, e + 2, e + 3, e + 4]  # the last at T0 + 8
    adopted = [ev["epoch"] for ev in node.events if ev["event"] == "epoch"]
    assert adopted == [e, e + 1, e + 2, e + 3]
    assert node.agreement.state is NodeState.SERVING
    # It slept to the settle and epoch times, not in small polls.
    assert len(stop.waits) <= 2 * 4 + 2


def test_a_late_starter_follows_last_epochs_plan_and_waits_to_vote():
    clock = FakeClock(T0 + 0.1)
    directory, nodes = swarm_of(2, clock)
    e = epoch_at(T0, 2.0)
    epoch_round(nodes, e)  # the swarm settled a plan in epoch e
    clock.now = T0 + 2.9  # 45% into epoch e + 1: too late for its proposal to be read
    for node in nodes:
        node.agreement.propose(e + 1)
    newcomer = Node("peer9", directory, clock)
    newcomer.heartbeat()
    newcomer.agreement.run(FakeStop(clock), end=T0 + 4.05)
    assert [ev["epoch"] for ev in newcomer.events] == [e, e + 1]  # followed, then adopted
    assert "peer9" not in directory.plans[e + 1]
    assert "peer9" in directory.plans[e + 2]  # it votes from the next epoch on


# ----------------------------------------------------------------------------- snapshot


def test_snapshot_keeps_fresh_members_on_our_settings_and_ourselves():
    clock = FakeClock(T0 + 100)
    directory, (node,) = swarm_of(1, clock)
    now = clock.now
    directory.records.update({
        "fresh": record("fresh", at=now - 1),
        "stale": record("stale", at=now - SETTINGS.suspect_after_s - 0.1),
        "ahead": record("ahead", at=now + 60),
        "other": record("other", at=now, config_digest="ffffffffffffffff"),
        "leaving": record("leaving", at=now, state=NodeState.LEAVING),
    })  # fmt: skip
    del directory.records["peer0"]  # our own record has not shown yet: we count anyway
    assert sorted(node.agreement.snapshot()) == ["fresh", "peer0"]
    assert not node.agreement.run_finished
    done = TrainingProgress(replica=0, step=9, loss=1.0, finished=True)
    directory.records["leaving"] = dataclasses.replace(directory.records["leaving"], training=done)
    node.agreement.snapshot()
    assert node.agreement.run_finished
    assert node.agreement.is_member("fresh")
    assert not node.agreement.is_member("ahead")


# ----------------------------------------------------------------------------- propose


def test_the_incumbent_stays_within_the_switch_margin_and_goes_beyond_it():
    clock = FakeClock(T0 + 0.1)
    directory, nodes = swarm_of(2, clock, backoff=BackoffConfig(planners=8))  # peer0 plans
    e = epoch_at(T0, 2.0)
    epoch_round(nodes, e)
    first = nodes[0].agreement.adopted
    # A slower member joins: the fresh plan differs (three stages) and is better, but by less
    # than the 10% margin (2.5% here): we keep proposing the plan we follow.
    slow = dataclasses.replace(record("peer2").device, flops=8e10)
    directory.records["peer2"] = dataclasses.replace(record("peer2", at=clock.now), device=slow)
    members = nodes[0].agreement.snapshot()
    fresh = nodes[0].agreement._plan(nodes[0].agreement._swarm(members))
    assert len(fresh.stages) != len(first.plan.stages)
    assert first.estimate * 0.9 < fresh.estimated_step_time < first.estimate
    nodes[0].agreement.propose(e + 1)
    assert directory.plans[e + 1]["peer0"].plan == first.proposal.plan
    # Much faster peers arrive: a fresh plan wins by far more than the margin.
    for pid in ("fast0", "fast1"):
        directory.records[pid] = dataclasses.replace(
            record(pid, at=clock.now),
            device=dataclasses.replace(record(pid).device, flops=1e13, memory_bandwidth=1e12),
        )
    nodes[0].agreement.propose(e + 2)
    assert directory.plans[e + 2]["peer0"].plan != first.proposal.plan
    assert directory.plans[e + 2]["peer0"].estimate < first.estimate * 0.9


def test_an_infeasible_swarm_counts_and_proposes_nothing():
    clock = FakeClock(T0 + 0.1)
    directory, (node,) = swarm_of(1, clock, memory=1 << 20)  # 1 MiB: no stage fits
    e = epoch_at(T0, 2.0)
    node.agreement.propose(e)
    node.agreement.propose(e + 1)
    assert node.agreement.counters["plans_failed"] == 2
    assert directory.plans == {}


def test_a_swarm_of_observers_only_plans_nothing_and_goes_on():
    # It raised "a swarm needs at least one peer" out of the loop: `fusionllm node --no-train`
    # alone, or before any trainer joined, exited with that error.
    clock = FakeClock(T0 + 0.1)
    directory, nodes = swarm_of(2, clock, observer=True)
    e = epoch_at(T0, 2.0)
    epoch_round(nodes, e)
    assert [n.agreement.counters["plans_failed"] for n in nodes] == [1, 1]
    assert directory.plans == {}


def test_after_a_plan_breaks_a_holder_that_may_not_be_seated_is_no_survivor():
    # The plan a member left is kept among its surviving holders (switching.after_a_loss):
    # a holder that turned observer (or is suspected) still holds its stage, but it is not a
    # survivor. It was kept, so the swarm proposed a plan its own audit refused, for good.
    clock = FakeClock(T0 + 0.1)
    directory, nodes = swarm_of(3, clock)
    e = epoch_at(T0, 2.0)
    epoch_round(nodes, e)
    old = nodes[0].agreement.adopted.plan
    assert {p for s in old.stages for p in s.peers} == {"peer0", "peer1", "peer2"}
    directory.records["peer2"] = dataclasses.replace(directory.records["peer2"], observer=True)
    nodes[0].agreement.propose(e + 1)
    proposed = plan_from_json(directory.plans[e + 1]["peer0"].plan)
    assert {p for s in proposed.stages for p in s.peers} <= {"peer0", "peer1"}


# ----------------------------------------------------------------------------- adopt


def test_honest_nodes_agree_and_a_liar_and_a_stranger_change_nothing():
    clock = FakeClock(T0 + 0.1)
    directory, nodes = swarm_of(3, clock)
    e = epoch_at(T0, 2.0)
    epoch_round(nodes, e)
    honest = {n.agreement.adopted.digest for n in nodes}
    assert len(honest) == 1
    for node in nodes:
        node.agreement.propose(e + 1)
    # peer2 lies: the plan it follows, claimed twice as fast; "stranger" is not a member.
    real = directory.plans[e + 1]["peer2"]
    directory.plans[e + 1]["peer2"] = shaded(real, 0.5)
    directory.plans[e + 1]["stranger"] = shaded(real, 0.97, proposer="stranger")
    for node in nodes:
        node.agreement.adopt(e + 1)
    assert {n.agreement.adopted.digest for n in nodes} == honest
    for node in nodes:
        counters = node.agreement.counters
        assert counters["proposals_overclaimed"] == 1
        assert counters["proposals_not_members"] == 1
        assert counters["invalid_proposals"] == 2
        last = node.events[-1]
        assert last["proposals"] == 4
        assert last["valid"] == 2


def test_adopt_reuses_the_records_read_this_epoch_unless_a_proposal_needs_newer_ones():
    """A DHT get costs the whole swarm CPU: adopt judges with the records propose read at the
    start of the epoch. A proposal from a member those records lack makes it read again, and
    the newcomer's proposal counts as valid, not refused."""
    clock = FakeClock(T0 + 0.1)
    directory, nodes = swarm_of(2, clock)
    reads: list[int] = []
    members = directory.members

    def counted(**kw):
        reads.append(1)
        return members(**kw)

    directory.members = counted
    e = epoch_at(T0, 2.0)
    epoch_round(nodes, e)
    assert len(reads) == 2  # one per node, in propose
    clock.now = T0 + 2.1
    for node in nodes:
        node.agreement.propose(e + 1)
    directory.records["peer9"] = record("peer9", at=clock.now)
    directory.plans[e + 1]["peer9"] = dataclasses.replace(
        directory.plans[e + 1]["peer0"], proposer="peer9"
    )
    for node in nodes:
        node.agreement.adopt(e + 1)
    assert len(reads) == 2 + 2 + 2  # propose, then a fresh read each for peer9's proposal
    for node in nodes:
        assert node.agreement.counters["invalid_proposals"] == 0
        assert node.events[-1]["valid"] == 3
        assert "peer9" in node.agreement.members_now()


# ----------------------------------------------------------------------------- converge


def shaded(proposal: PlanProposal, factor: float, **changes) -> PlanProposal:
    """``proposal``'s plan with its estimate times ``factor`` (other bytes: another digest)."""
    plan = plan_from_json(proposal.plan)
    plan = dataclasses.replace(plan, estimated_step_time=plan.estimated_step_time * factor)
    fields = {"plan": plan_to_json(plan), "estimate": plan.estimated_step_time, **changes}
    return dataclasses.replace(proposal, **fields)


def renamed_below(proposal: PlanProposal) -> PlanProposal:
    """The same plan with other bytes (a bubble figure no audit reads; the method must stay
    the swarm's), chosen so its digest sorts first (a low digest may take thousands of tries)."""
    plan = plan_from_json(proposal.plan)
    for i in range(20_000):
        bubble = plan.bubble_fraction + (i + 1) * 1e-9
        other = dataclasses.replace(proposal, plan=plan_to_json(
            dataclasses.replace(plan, bubble_fraction=bubble)))  # fmt: skip
        if other.digest < proposal.digest:
            return other
    raise AssertionError("no bubble figure gives a lower digest")


def test_a_node_in_the_minority_follows_the_majority_and_does_not_flap():
    clock = FakeClock(T0 + 0.1)
    directory, nodes = swarm_of(3, clock)
    e = epoch_at(T0, 2.0)
    for node in nodes:
        node.agreement.propose(e)
    honest = dict(directory.plans[e])
    # peer2 alone saw an honest alternative (same figures, other bytes, a lower digest: it
    # ranks first wherever it is seen): it adopts that one.
    alt = renamed_below(honest["peer2"])
    directory.plans[e] = {"peer2": alt}
    nodes[2].agreement.adopt(e)
    directory.plans[e] = honest
    nodes[0].agreement.adopt(e)
    nodes[1].agreement.adopt(e)
    majority = nodes[0].agreement.adopted.digest
    assert nodes[1].agreement.adopted.digest == majority
    assert nodes[2].agreement.adopted.digest == alt.digest
    for node in nodes:
        node.heartbeat()
    # Next epoch: its peers' records say they follow the other plan; it switches to it.
    odd = nodes[2].agreement
    odd.propose(e + 1)
    assert odd.adopted.digest == majority
    assert odd.adopted_epoch == e
    assert odd.counters["converged"] == 1
    assert nodes[2].events[-1]["converged"] is True
    assert nodes[2].events[-1]["digest"] == majority
    assert odd.outvoted.holds(alt.digest, e + 1)
    # The plan it left stays out of its choice even where it would rank first ...
    directory.plans[e + 1]["peer1"] = dataclasses.replace(alt, epoch=e + 1, proposer="peer1")
    odd.adopt(e + 1)
    assert odd.adopted.digest == majority
    # ... unless the majority follows it: convergence overrides the hold.
    for node in nodes[:2]:
        node.agreement.adopt(e + 1)
        assert node.agreement.adopted.digest == alt.digest
    for node in nodes:
        node.heartbeat()
    odd.propose(e + 2)
    assert odd.adopted.digest == alt.digest
    assert odd.counters["converged"] == 2


def test_the_majority_plan_is_followed_only_if_we_accept_it():
    clock = FakeClock(T0 + 0.1)
    directory, nodes = swarm_of(3, clock)
    e = epoch_at(T0, 2.0)
    epoch_round(nodes, e)
    ours = nodes[0].agreement.adopted.digest
    # Two members report a plan whose figures are far below ours (a liar's, say).
    lie = shaded(directory.plans[e]["peer1"], 0.5)
    directory.plans[e]["peer1"] = lie
    for peer in ("peer1", "peer2"):
        directory.records[peer] = dataclasses.replace(
            directory.records[peer], adopted=(e, lie.digest)
        )
    nodes[0].agreement.propose(e + 1)
    assert nodes[0].agreement.adopted.digest == ours
    assert nodes[0].agreement.counters["converged"] == 0


@pytest.mark.parametrize("tie", [True, False])
def test_equal_camps_keep_their_plans(tie):
    clock = FakeClock(T0 + 0.1)
    directory, nodes = swarm_of(2, clock)
    e = epoch_at(T0, 2.0)
    epoch_round(nodes, e)
    before = nodes[0].agreement.adopted.digest
    if tie:
        directory.records["peer1"] = dataclasses.replace(
            directory.records["peer1"], adopted=(e, "f" * 64)
        )
    nodes[0].agreement.propose(e + 1)
    assert nodes[0].agreement.adopted.digest == before
    assert nodes[0].agreement.counters["converged"] == 0


def test_a_followed_plan_survives_a_drifting_view_a_new_one_does_not():
    """Links measured slower after agreement (training load on the probes): the plan the swarm
    follows keeps being proposed and adopted, judged by the figures no view changes; the same
    claims under a new digest are judged by every figure, and refused."""
    clock = FakeClock(T0 + 0.1)
    settings = dataclasses.replace(SETTINGS, min_stages=2)
    directory, nodes = swarm_of(2, clock, bandwidth=2e6, settings=settings)
    e = epoch_at(T0, 2.0)
    epoch_round(nodes, e)
    followed = nodes[0].agreement.adopted
    assert len(followed.plan.stages) == 2
    for node in nodes:
        node.bandwidth = 2e6 / 64  # far slower links than when the plan was made
        node.heartbeat()
    nodes[0].agreement.propose(e + 1)
    assert directory.plans[e + 1]["peer0"].plan == followed.proposal.plan
    newcomer = dataclasses.replace(renamed_below(followed.proposal), epoch=e + 1)
    directory.plans[e + 1]["peer1"] = newcomer
    nodes[0].agreement.adopt(e + 1)
    assert nodes[0].agreement.adopted.digest == followed.digest
    assert nodes[0].agreement.counters["proposals_overclaimed"] == 1
    # A newcomer that follows nothing yet takes the plan a majority reports following.
    newcomer = Node("peer9", directory, clock, bandwidth=2e6 / 64, settings=settings)
    newcomer.heartbeat()
    newcomer.agreement.adopt(e + 1)
    assert newcomer.agreement.adopted.digest == followed.digest


def newcomer_round(horizon_steps: int) -> tuple[list[Node], float]:
    """Two nodes agree on idle links; training slows the probes 8x; a newcomer 1.5x faster
    than the rest joins and every node plans an epoch: (the nodes, the first plan's claim)."""
    clock = FakeClock(T0 + 0.1)
    settings = dataclasses.replace(SETTINGS, min_stages=2)
    policy = SwitchPolicy(horizon_steps=horizon_steps)
    directory, nodes = swarm_of(2, clock, bandwidth=1e7, settings=settings, switch_policy=policy)
    e = epoch_at(T0, 2.0)
    epoch_round(nodes, e)
    claim = nodes[0].agreement.adopted.estimate
    faster = dataclasses.replace(record("fast").device, flops=1.5e11, memory_bandwidth=1.5e10)
    fast = Node("fast", directory, clock, bandwidth=1e7 / 8, settings=settings, device=faster,
                switch_policy=policy)  # fmt: skip
    for node in nodes:
        node.bandwidth = 1e7 / 8
    swarm = [*nodes, fast]
    for node in swarm:
        node.heartbeat()
    clock.now = T0 + 2.1
    epoch_round(swarm, e + 1)
    assert len({node.agreement.adopted.digest for node in swarm}) == 1
    return swarm, claim


def seated(node: Node) -> set[str]:
    return {p for s in node.agreement.adopted.plan.stages for p in s.peers}


def test_a_newcomer_is_placed_when_it_beats_the_incumbent_on_todays_figures():
    """The newcomer's plan (3.17 s) is slower than the incumbent's old claim (3.03 s) but
    beats the incumbent planned again on today's figures (3.98 s) by more than the margin:
    with the moved state spread over a long run, the swarm seats it (claims alone kept it out
    for good)."""
    swarm, claim = newcomer_round(horizon_steps=1_000_000)
    assert "fast" in seated(swarm[0])
    assert swarm[0].agreement.adopted.estimate > claim  # not better than the stale claim


def test_a_newcomer_is_not_worth_moving_minutes_of_state_for_a_short_horizon():
    """The same newcomer, but its plan moves GPT-2 small's state (~815 MB with AdamW's
    moments) over 1.25 MB/s links: 652 s, 3.3 s a step over 200 steps, more than the 0.8 s a
    step it saves. The swarm keeps its holders."""
    swarm, _ = newcomer_round(horizon_steps=200)
    assert seated(swarm[0]) == {"peer0", "peer1"}


# ----------------------------------------------------------------------------- idle backoff


def count_plans(node: Node) -> list[int]:
    """Wrap the node's planner: the list grows by one per fresh plan."""
    calls: list[int] = []
    plan = node.agreement._plan

    def counted(swarm):
        calls.append(len(swarm.peers))
        return plan(swarm)

    node.agreement._plan = counted
    return calls


def test_a_stable_swarm_re_proposes_its_plan_and_plans_afresh_less_often():
    clock = FakeClock(T0 + 0.1)
    directory, nodes = swarm_of(2, clock)
    calls = count_plans(nodes[0])
    e = epoch_at(T0, 2.0)
    for k in range(20):
        clock.now = T0 + 2.0 * k + 0.1
        epoch_round(nodes, e + k)
    assert len(calls) == 5  # in epochs 0, 1, 3, 7, 15 (gaps 1, 2, 4, 8; 23 is not due)
    digests = {p.digest for k in range(20) for p in directory.plans[e + k].values()}
    assert len(digests) == 1  # the same plan every epoch, planned or not
    assert [ev["epoch"] for ev in nodes[0].events] == [e + k for k in range(20)]
    # A newcomer: the next epoch plans afresh, and the plan takes it in.
    clock.now = T0 + 40.1
    directory.records["fast"] = dataclasses.replace(
        record("fast", at=clock.now),
        device=dataclasses.replace(record("fast").device, flops=1e13, memory_bandwidth=1e12),
    )
    before = len(calls)
    nodes[0].agreement.propose(e + 20)
    # The whole swarm only: the bar the newcomer's plan beats is the incumbent re-estimated on
    # the same snapshot (switching.py), not a second plan of its peers.
    assert calls[before:] == [3]
    fresh = plan_from_json(directory.plans[e + 20]["peer0"].plan)
    assert "fast" in {p for s in fresh.stages for p in s.peers}


def test_a_stable_swarms_routine_re_checks_fall_to_a_few_members_per_epoch():
    """Every node's plan of one snapshot is the same: the first plan and, once the swarm is
    stable, the routine re-check (only the gap is due) are made by 3 members per epoch
    (planners.py; equal CPUs take turns), not by every member, and everyone still follows
    the same plan each epoch."""
    clock = FakeClock(T0 + 0.1)
    _, nodes = swarm_of(8, clock)
    calls = {node.peer: count_plans(node) for node in nodes}
    e = epoch_at(T0, 2.0)
    per_epoch = []
    for k in range(24):
        clock.now = T0 + 2.0 * k + 0.1
        before = sum(len(c) for c in calls.values())
        epoch_round(nodes, e + k)
        per_epoch.append(sum(len(c) for c in calls.values()) - before)
        assert len({n.agreement.adopted.digest for n in nodes}) == 1
    assert per_epoch[0] == 3  # the first plan: the epoch's planners
    assert max(per_epoch[1:]) <= 3
    assert sum(per_epoch[1:]) >= 8  # routine checks still happen, by turns
    assert all(calls[n.peer] for n in nodes)


def test_a_newcomers_first_measured_link_is_planned_for_at_once():
    """A newcomer is priced on default figures until its links are measured. The epoch its
    first link is, the node plans afresh, not after the doubled gap of a stable swarm."""
    clock = FakeClock(T0 + 0.1)
    directory, nodes = swarm_of(2, clock)
    for node in nodes:  # the incumbents' link is measured from the start
        node.agreement.book.record("peer0", "peer1", LinkSample(1e8, 1e-3, T0), now=T0 + 0.1)
    calls = count_plans(nodes[0])
    e = epoch_at(T0, 2.0)
    directory.records["new"] = record("new", at=T0)
    for k in range(6):  # the newcomer arrives: planned for, then the gap grows (1, 2, 4)
        clock.now = T0 + 2.0 * k + 0.1
        directory.records["new"] = record("new", at=clock.now)
        epoch_round(nodes, e + k)
    assert len(calls) == 3  # epochs 0, 1, 3 (and 5 is not due)
    book = nodes[0].agreement.book
    clock.now = T0 + 12.1
    directory.records["new"] = record("new", at=clock.now)
    book.record("peer0", "new", LinkSample(1e8, 1e-3, clock.now), now=clock.now)
    nodes[0].agreement.propose(e + 6)
    assert len(calls) == 4, "the newcomer's first measured link was not planned for"


def test_an_idle_stable_node_goes_quiet_and_a_wake_brings_it_back():
    clock = FakeClock(T0 + 0.1)
    directory, (node,) = swarm_of(1, clock)
    told = []
    node.agreement.quiet._tell_swarm = lambda: told.append(clock.now)
    stop = FakeStop(clock)
    node.agreement.run(stop, end=T0 + 80.05)
    e = epoch_at(T0, 2.0)
    acted = sorted(directory.plans)
    assert acted[:3] == [e, e + 1, e + 2]  # the view must hold a few epochs first
    gaps = [b - a for a, b in itertools.pairwise(acted)]
    assert gaps[-2:] == [8, 8]
    assert gaps == sorted(gaps)
    assert all(epoch % 8 == 0 for epoch in acted[-3:])  # in the same epochs as every node
    assert len(acted) < 12  # of 41 epochs
    # It kept following its plan in the epochs it sat out: its record says so (e + 40 was
    # proposed in; its adopt time lies after the end).
    assert node.agreement.adopted_epoch == e + 39
    assert node.agreement.quiet.cadence.beat == min(8, MAX_BEAT)  # stride 8
    assert told == []  # nothing changed
    # A member told us it woke: we act in the very next epoch (e + 40 is not one of the
    # stride's), and finding nothing changed, go quiet again from there.
    del directory.plans[e + 40]
    node.agreement.quiet.wake(alert=False)
    node.agreement.run(FakeStop(clock), end=T0 + 84.05)
    assert sorted(directory.plans)[-2:] == [e + 40, e + 42]
    assert node.agreement.quiet.cadence.stride == 2


def test_a_newcomer_wakes_a_quiet_swarm_and_is_planned_in():
    clock = FakeClock(T0 + 0.1)
    directory, nodes = swarm_of(2, clock)
    e = epoch_at(T0, 2.0)
    for k in range(6):
        epoch_round(nodes, e + k)
    assert all(n.agreement.quiet.cadence.stride == 8 for n in nodes)
    told = []
    nodes[0].agreement.quiet._tell_swarm = lambda: told.append(nodes[0].peer)
    newcomer = Node("peer9", directory, clock)
    newcomer.heartbeat()
    # A hint (it connected to probe us) wakes peer0: the next epoch shows the newcomer.
    nodes[0].agreement.quiet.wake(alert=True)
    assert not nodes[0].agreement._quiet_in(e + 9)
    assert nodes[1].agreement._quiet_in(e + 9)  # not told yet: it sits the epoch out
    epoch_round([nodes[0], newcomer], e + 9)
    assert told == ["peer0"]  # it saw the change: the swarm hears of it (gossip, links.py)
    nodes[1].agreement.quiet.wake(alert=False)
    epoch_round([*nodes, newcomer], e + 10)
    assert all(n.agreement.quiet.cadence.stride == 1 for n in (*nodes, newcomer))
    assert {len(ev["members"]) for ev in nodes[1].events[-1:]} == {3}


def test_a_suspected_quiet_member_is_out_until_it_writes_again():
    clock = FakeClock(T0 + 0.1)
    _, nodes = swarm_of(3, clock)
    e = epoch_at(T0, 2.0)
    epoch_round(nodes, e)
    watcher, gone = nodes[0].agreement, nodes[2]
    # It wrote a record after the one the watcher read last, then its connection dropped.
    clock.now += 0.2
    gone.heartbeat()
    watcher.quiet.suspect(gone.peer, clock.now)  # no reconnect either: suspected from now
    assert gone.peer not in watcher.snapshot()
    assert gone.peer not in watcher.snapshot()  # until it writes again ...
    clock.now += 0.5
    gone.heartbeat()
    assert gone.peer in watcher.snapshot()  # ... which shows it lives: forgotten
    clock.now += 0.5
    assert gone.peer in watcher.snapshot()


def test_in_a_quiet_swarm_only_the_planners_store_the_plan_again():
    clock = FakeClock(T0 + 0.1)
    directory, nodes = swarm_of(5, clock)
    e = epoch_at(T0, 2.0)
    for k in range(5):
        epoch_round(nodes, e + k)
    assert len(directory.plans[e + 1]) == 5  # still acting every epoch: everyone stores
    assert all(n.agreement.quiet.cadence.stride > 1 for n in nodes)
    plan = nodes[0].agreement.adopted.digest
    quiet_epoch = e + 8
    epoch_round(nodes, quiet_epoch)
    stored = directory.plans[quiet_epoch]
    assert set(stored) == set(planners(quiet_epoch, directory.records, 3))
    assert {n.agreement.adopted.digest for n in nodes} == {plan}
    assert {n.agreement.adopted_epoch for n in nodes} == {quiet_epoch}
    # What they store lives until they store it again (the stride, doubled at most), so a
    # status call in any epoch between finds the plan the members stamp their records with.
    stride = nodes[0].agreement.quiet.cadence.stride
    assert min(directory.ttls[quiet_epoch].values()) >= (stride + 1) * SETTINGS.epoch_s


# ----------------------------------------------------------------------------- link wait


def _unmeasured_pair(*, link_wait_s: float) -> tuple[FakeClock, FakeDirectory, list[Node]]:
    """Two nodes that have measured no link between them, with a link wait."""
    clock = FakeClock(T0 + 0.1)
    directory = FakeDirectory()
    nodes = [Node(f"peer{i}", directory, clock, link_wait_s=link_wait_s) for i in range(2)]
    for node in nodes:
        node.heartbeat()
    return clock, directory, nodes


def test_no_plan_over_links_nobody_measured_until_they_are_or_the_wait_runs_out():
    """The testbed's first plans were all made on estimated links (0.1122 s everywhere): with
    a link wait, a node proposes nothing while a pair of candidates is unmeasured."""
    clock, directory, nodes = _unmeasured_pair(link_wait_s=6.0)
    e = epoch_at(T0, 2.0)
    epoch_round(nodes, e)
    assert e not in directory.plans
    assert nodes[0].agreement.counters["waited_for_links"] == 1
    sample = LinkSample(bandwidth=1e8, rtt=0.01, measured_at=clock.now)
    nodes[0].agreement.book.record("peer0", "peer1", sample, now=clock.now)
    clock.now = T0 + 2.1
    epoch_round(nodes, e + 1)
    assert e + 1 not in directory.plans  # one way measured: the other is priced from records
    nodes[0].agreement.book.record("peer1", "peer0", sample, now=clock.now)
    epoch_round(nodes, e + 2)
    assert set(directory.plans[e + 2]) == {"peer0"}  # peer1 has not heard of the link yet
    # Nobody measures peer1's side for peer1: past the wait it plans with what it has.
    clock.now = T0 + 6.1
    nodes[1].agreement.propose(e + 3)
    assert "peer1" in directory.plans[e + 3]


def test_a_swarm_waiting_for_its_links_does_not_go_quiet():
    """Topology B, session 16: nodes waiting for links saw nothing change in membership, went
    quiet, and acted once in 8 epochs; a link's figure wakes nobody, so the first plan came
    51 s after the last member was ready. Waiting, a node acts every epoch."""
    clock, directory, nodes = _unmeasured_pair(link_wait_s=600.0)
    e = epoch_at(T0, 2.0)
    for k in range(6):
        clock.now = T0 + 2.0 * k + 0.1
        epoch_round(nodes, e + k)
    assert not directory.plans
    assert all(n.agreement.counters["waited_for_links"] == 6 for n in nodes)
    assert all(n.agreement.quiet.cadence.stride == 1 for n in nodes)
    sample = LinkSample(bandwidth=1e8, rtt=0.01, measured_at=clock.now)
    for node in nodes:
        node.agreement.book.record("peer0", "peer1", sample, now=clock.now)
        node.agreement.book.record("peer1", "peer0", sample, now=clock.now)
    clock.now = T0 + 12.1
    epoch_round(nodes, e + 6)
    assert all(n.agreement.adopted is not None for n in nodes)
    for k in range(7, 13):  # planned and idle: quiet as before
        clock.now = T0 + 2.0 * k + 0.1
        epoch_round(nodes, e + k)
    assert all(n.agreement.quiet.cadence.stride == 8 for n in nodes)


def test_a_plan_that_broke_is_replaced_without_waiting_for_a_newcomers_links():
    """CI, session 16: eight nodes re-planned 10.2 s after a crash (bound 10 s), waiting for
    links that a swarm of eight had not all measured both ways."""
    clock = FakeClock(T0 + 0.1)
    directory = FakeDirectory()
    nodes = [Node(f"peer{i}", directory, clock, link_wait_s=600.0) for i in range(3)]
    sample = LinkSample(bandwidth=1e8, rtt=0.01, measured_at=clock.now)
    for node in nodes:
        for a in nodes:
            for b in nodes:
                if a is not b:
                    node.agreement.book.record(a.peer, b.peer, sample, now=clock.now)
        node.heartbeat()
    e = epoch_at(T0, 2.0)
    epoch_round(nodes, e)
    serving = [n for n in nodes if n.agreement.adopted is not None
               and n.peer in serving_peers(n.agreement.adopted.plan)]  # fmt: skip
    assert serving, "the three measured nodes plan at once"
    newcomer = Node("peer3", directory, clock, link_wait_s=600.0)  # no link of it measured
    newcomer.heartbeat()
    clock.now = T0 + 2.1
    epoch_round([*nodes, newcomer], e + 1)
    assert nodes[0].agreement.counters["waited_for_links"] == 1  # the plan stands meanwhile
    victim = serving[-1]
    del directory.records[victim.peer]
    survivors = [n for n in nodes if n is not victim]
    clock.now = T0 + 4.1
    epoch_round([*survivors, newcomer], e + 2)
    plans = [plan_from_json(p.plan) for p in directory.proposals(e + 2)]
    assert plans, "the survivors of a crash plan without waiting for the newcomer's links"
    assert all(victim.peer not in serving_peers(p) for p in plans)


def test_a_slow_read_does_not_age_the_records_it_returns():
    """Topology C, session 7: a DHT read took 5.4 s on every node at once and a training
    member's record, fresh when the read began, was judged 5.4 s older at its end: four nodes
    abandoned the step. A record is judged by its age when our read began."""

    class SlowDirectory(FakeDirectory):
        def members(self, *, include_leaving: bool = False) -> dict[str, NodeInfo]:
            clock.now += 5.4  # the read itself takes this long
            return super().members(include_leaving=include_leaving)

    clock = FakeClock(T0 + 100)
    directory = SlowDirectory()
    node = Node("peer0", directory, clock)
    age = SETTINGS.suspect_after_s - 0.5  # fresh when the read begins
    directory.records["busy"] = record("busy", at=clock.now - age)
    assert node.agreement.is_member("busy") is False  # nothing read yet
    assert "busy" in node.agreement.snapshot()
    assert node.agreement.is_member("busy")
    # A record already stale when the read began still counts as gone.
    directory.records["gone"] = record("gone", at=clock.now - SETTINGS.suspect_after_s - 0.1)
    assert "gone" not in node.agreement.snapshot()
