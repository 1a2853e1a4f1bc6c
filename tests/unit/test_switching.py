"""node/control/switching.py: after the followed plan broke, the holders' plan or a fresh one;
when a fresh plan that won on figures alone is worth switching to (SwitchStreak)."""

import dataclasses

import pytest

from fusionllm.dag.cost import DeviceProfile, LinkProfile
from fusionllm.dag.graph import GraphCosts, OpNode
from fusionllm.dag.methods import InfeasiblePlanError
from fusionllm.dag.plan_build import build_plan
from fusionllm.dag.planner import PlanConfig
from fusionllm.dag.swarm import Peer, Swarm
from fusionllm.dag.switch_cost import SwitchPolicy
from fusionllm.node.control.switching import SwitchStreak, after_a_loss

GIB = 2**30
CPU = DeviceProfile(name="cpu", flops=1e12, memory_bandwidth=1e11, memory_bytes=16 * GIB)
FAST = dataclasses.replace(CPU, name="fast", flops=1e14, memory_bandwidth=1e13)
CONFIG = PlanConfig(micro_batches=4, batch_size=4)


def graph() -> GraphCosts:
    nodes, prev = [], "x"
    for i in range(4):
        nodes.append(OpNode(node_id=f"n{i}", op="linear", inputs=(prev,), forward_flops=10**9,
                            backward_flops=2 * 10**9, param_bytes=2**20, output_bytes=2**20,
                            peak_activation_bytes=2**20))  # fmt: skip
        prev = f"n{i}"
    return GraphCosts(nodes=tuple(nodes), input_bytes={"x": 1000}, output_names=(prev,))


def swarm(ids: tuple[str, ...]) -> Swarm:
    """d is fast but behind 100 kB/s links; the others share 1 GB/s."""
    peers = [Peer(peer_id=p, device=FAST if p == "d" else CPU, uplink=1e9, downlink=1e9,
                  rtt=0.001) for p in ids]  # fmt: skip
    links = {
        (a, b): LinkProfile(bandwidth=1e5 if "d" in (a, b) else 1e9, rtt=0.001)
        for a in ids
        for b in ids
        if a != b
    }
    return Swarm.from_links(peers, links)


G = graph()
BEFORE = swarm(("a", "b", "c"))
NOW = swarm(("a", "b", "d"))  # c crashed, d joined
OLD = build_plan(G, BEFORE, CONFIG, [["a"], ["b"], ["c"]], [0, 1, 2, 4])
FRESH = build_plan(G, NOW, CONFIG, [["d"]], [0, 4])  # all on the fast newcomer
KEPT = build_plan(G, NOW, CONFIG, [["a"], ["b"]], [0, 2, 4])  # the survivors


def choose(policy: SwitchPolicy, plan_over=lambda peers: KEPT, fresh=FRESH):
    return after_a_loss(OLD, fresh, plan_over, swarm=NOW, costs=G, config=CONFIG,
                        switch_margin=0.1, policy=policy)  # fmt: skip


def test_the_holders_keep_the_model_when_moving_it_costs_more_than_it_saves():
    """The fresh plan is ~10x faster a step, but moves a and b's 6 MB of state to d at
    100 kB/s: 63 s, 0.31 s a step over 200 steps, more than the ~0.05 s it saves."""
    assert FRESH.estimated_step_time < KEPT.estimated_step_time / 5
    assert choose(SwitchPolicy(horizon_steps=200)) is KEPT


def test_a_much_better_plan_wins_over_a_long_enough_horizon():
    assert choose(SwitchPolicy(horizon_steps=10**6)) is FRESH


def test_when_the_holders_cannot_plan_alone_the_fresh_plan_stands():
    def infeasible(peers):
        raise InfeasiblePlanError("2 peers, the swarm waits for 3")

    assert choose(SwitchPolicy(), plan_over=infeasible) is FRESH


def test_a_fresh_plan_on_the_holders_themselves_is_not_planned_twice():
    asked = []
    fresh = build_plan(G, NOW, CONFIG, [["b"], ["a"]], [0, 3, 4])
    assert choose(SwitchPolicy(), plan_over=asked.append, fresh=fresh) is fresh
    assert asked == []


# Two layouts of the same members, as A's early plans were: each looked better in turn as
# lane figures replaced probe figures.
AB = build_plan(G, BEFORE, CONFIG, [["a"], ["b"]], [0, 2, 4])
BA = build_plan(G, BEFORE, CONFIG, [["b"], ["a"]], [0, 2, 4])


def test_a_plan_that_wins_on_figures_alone_must_win_twice_in_a_row():
    streak = SwitchStreak(rounds=2)
    assert not streak.settled("inc", AB, wins=True, figures_only=True)  # once: keep
    assert streak.settled("inc", AB, wins=True, figures_only=True)  # the same, again: switch
    # A different winner each round (figures still arriving) never settles: no flapping.
    streak = SwitchStreak(rounds=2)
    for fresh in (AB, BA, AB, BA):
        assert not streak.settled("inc", fresh, wins=True, figures_only=True)
    # A round the incumbent wins starts the count over; so does a new incumbent.
    streak = SwitchStreak(rounds=2)
    assert not streak.settled("inc", AB, wins=True, figures_only=True)
    assert not streak.settled("inc", AB, wins=False, figures_only=True)
    assert not streak.settled("inc", AB, wins=True, figures_only=True)
    assert not streak.settled("other", AB, wins=True, figures_only=True)


def test_a_plan_for_changed_members_switches_at_once():
    """A newcomer seated or a loss replaced is not noise: no second round."""
    assert SwitchStreak(rounds=2).settled("inc", AB, wins=True, figures_only=False)
    assert SwitchStreak(rounds=1).settled("inc", AB, wins=True, figures_only=True)
    assert not SwitchStreak(rounds=2).settled("inc", AB, wins=False, figures_only=False)
    with pytest.raises(ValueError, match="rounds must be an integer >= 1"):
        SwitchStreak(rounds=0)
