"""dag/switch_cost.py and Retimer.recoded: what a plan switch moves, and the incumbent's bar."""

import math

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.dag.cost import DeviceProfile, LinkProfile
from fusionllm.dag.graph import GraphCosts, OpNode
from fusionllm.dag.plan_build import build_plan
from fusionllm.dag.plan_check import PlanCheckError, Retimer
from fusionllm.dag.planner import PlanConfig
from fusionllm.dag.swarm import Peer, Swarm
from fusionllm.dag.switch_cost import SwitchPolicy, amortised_switch_s, state_transfer_time

GIB = 2**30
DEVICE = DeviceProfile(name="d", flops=1e12, memory_bandwidth=1e11, memory_bytes=16 * GIB)
PARAM = 2**20  # bytes of parameters per node
CONFIG = PlanConfig(micro_batches=4, batch_size=4)  # AdamW: 2 bytes of moments per byte


def graph(n: int = 4, out: int = 4 * 2**20) -> GraphCosts:
    nodes, prev = [], "x"
    for i in range(n):
        nodes.append(OpNode(node_id=f"n{i}", op="linear", inputs=(prev,), forward_flops=10**9,
                            backward_flops=2 * 10**9, param_bytes=PARAM, output_bytes=out,
                            peak_activation_bytes=out))  # fmt: skip
        prev = f"n{i}"
    return GraphCosts(nodes=tuple(nodes), input_bytes={"x": 1000}, output_names=(prev,))


def swarm(bandwidth: dict[tuple[str, str], float], ids=("a", "b", "c", "d")) -> Swarm:
    peers = [Peer(peer_id=p, device=DEVICE, uplink=1e9, downlink=1e9, rtt=0.01) for p in ids]
    links = {pair: LinkProfile(bandwidth=bw, rtt=0.01) for pair, bw in bandwidth.items()}
    return Swarm.from_links(peers, links)


def two_stage(groups, sw: Swarm, g: GraphCosts | None = None, config=CONFIG):
    return build_plan(g or graph(), sw, config, groups, [0, 2, 4])


def test_the_same_plan_moves_nothing():
    sw = swarm({})
    p = two_stage([["a"], ["b"]], sw)
    assert state_transfer_time(p, p, graph(), sw, CONFIG) == 0.0


def test_a_stage_moving_to_a_new_peer_costs_its_state_over_the_link():
    sw = swarm({("b", "c"): 1e6})
    old, new = two_stage([["a"], ["b"]], sw), two_stage([["a"], ["c"]], sw)
    # c needs nodes 2 and 3 from b: parameters and AdamW's two moments, 3 bytes a byte.
    assert state_transfer_time(old, new, graph(), sw, CONFIG) == pytest.approx(2 * 3 * PARAM / 1e6)


def test_swapped_stages_move_in_parallel_and_the_slower_receiver_sets_the_time():
    sw = swarm({("a", "b"): 4e6, ("b", "a"): 1e6})
    old, new = two_stage([["a"], ["b"]], sw), two_stage([["b"], ["a"]], sw)
    # Each fetches the other's two nodes at once; a's side (from b at 1 MB/s) is the slower.
    assert state_transfer_time(old, new, graph(), sw, CONFIG) == pytest.approx(6 * PARAM / 1e6)


def test_a_piece_comes_from_the_fastest_holder():
    sw = swarm({("a", "c"): 1e6, ("b", "c"): 8e6})
    old = two_stage([["a", "b"], ["d"]], sw)  # a and b both hold nodes 0, 1
    new = two_stage([["c"], ["d"]], sw)
    assert state_transfer_time(old, new, graph(), sw, CONFIG) == pytest.approx(6 * PARAM / 8e6)


def test_a_new_stage_boundary_moves_only_the_nodes_a_peer_lacks():
    sw = swarm({("b", "a"): 1e6})
    old = two_stage([["a"], ["b"]], sw)
    new = build_plan(graph(), sw, CONFIG, [["a"], ["b"]], [0, 3, 4])  # a also takes node 2
    assert state_transfer_time(old, new, graph(), sw, CONFIG) == pytest.approx(3 * PARAM / 1e6)


def test_pieces_whose_holders_left_are_not_counted():
    before = swarm({})
    old = two_stage([["a"], ["b"]], before)
    after = swarm({("a", "c"): 1e6}, ids=("a", "c", "d"))  # b is gone
    new = two_stage([["a"], ["c"]], after)
    assert state_transfer_time(old, new, graph(), after, CONFIG) == 0.0


def test_a_plan_seating_a_stranger_is_refused():
    sw = swarm({})
    p = two_stage([["a"], ["b"]], sw)
    with pytest.raises(ConfigError, match="not in the swarm"):
        state_transfer_time(p, p, graph(), swarm({}, ids=("a", "c")), CONFIG)


def test_the_policy_spreads_the_transfer_over_its_horizon():
    assert amortised_switch_s(600.0, SwitchPolicy(horizon_steps=200)) == 3.0
    for bad in (0, -1, 1.5):
        with pytest.raises(ConfigError, match="horizon_steps"):
            SwitchPolicy(horizon_steps=bad)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ConfigError, match="transfer time"):
            amortised_switch_s(bad, SwitchPolicy())


def test_recoded_re_applies_adatopk_where_retime_keeps_the_old_codecs():
    """A plan made on a 1 MB/s link compresses it (top-k); on a 1 GB/s snapshot, AdaTopK would
    send dense. ``retime`` keeps top-k (the plan as written); ``recoded`` is the plan the
    planner would make of the same stages now, faster and dense."""
    slow = swarm({("a", "b"): 1e6, ("b", "a"): 1e6})
    fast = swarm({("a", "b"): 1e9, ("b", "a"): 1e9})
    made = two_stage([["a"], ["b"]], slow)
    assert made.links[0].forward_codec == "topk"
    retimer = Retimer(graph(), fast, CONFIG)
    recoded, kept = retimer.recoded(made), retimer.retime(made).plan
    assert recoded.links[0].forward_codec == "dense"
    assert kept.links[0].forward_codec == "topk"
    assert recoded.stages == kept.stages  # same stages, shares and compute
    assert recoded.estimated_step_time == two_stage([["a"], ["b"]], fast).estimated_step_time
    assert recoded.estimated_step_time < made.estimated_step_time


def test_recoded_refuses_a_plan_whose_peer_is_gone():
    made = two_stage([["a"], ["b"]], swarm({}))
    with pytest.raises(PlanCheckError, match="planned again"):
        Retimer(graph(), swarm({}, ids=("a", "c")), CONFIG).recoded(made)
