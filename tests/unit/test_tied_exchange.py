"""tied_exchange.py and GraphCosts.shared_params: the tied gradients' frames are in the plan's
estimate, from the traced model through JSON to build_plan and the audit's Retimer."""

import pytest

from fusionllm.dag.cost import DeviceProfile, LinkProfile
from fusionllm.dag.graph import GraphCosts, OpNode, costs_from_json, costs_to_json
from fusionllm.dag.plan_build import build_plan
from fusionllm.dag.plan_check import Retimer
from fusionllm.dag.planner import PlanConfig
from fusionllm.dag.swarm import Peer, Swarm
from fusionllm.dag.tied_exchange import tied_tails
from fusionllm.node.control.facts_main import model_costs

MB = 1e6


def _chain(n: int, shared=()) -> GraphCosts:
    nodes = tuple(
        OpNode(node_id=f"n{i}", op="f", inputs=(f"n{i - 1}",) if i else ("x",),
               forward_flops=10**6, backward_flops=2 * 10**6, param_bytes=4096,
               output_bytes=4096, peak_activation_bytes=4096)
        for i in range(n)
    )  # fmt: skip
    return GraphCosts(nodes=nodes, input_bytes={"x": 4096}, shared_params=shared)


def _link(table):
    return lambda a, b: LinkProfile(bandwidth=table[(a, b)], rtt=0.01)


def test_each_holder_sends_its_copy_to_the_others():
    graph = _chain(6, (((0, 5), 65536),))
    tails = tied_tails(graph, [0, 2, 4, 6], [10, 11, 12], _link({(10, 12): 5 * MB, (12, 10): MB}))
    assert tails == pytest.approx((65536 / (5 * MB), 0.0, 65536 / MB))


def test_a_parameter_inside_one_stage_costs_nothing():
    graph = _chain(6, (((0, 1), 65536),))
    assert tied_tails(graph, [0, 3, 6], [0, 1], _link({})) == (0.0, 0.0)


@pytest.mark.parametrize("shared", [(((3,), 8),), (((2, 1), 8),), (((0, 9), 8),), (((0, 1), -1),)])
def test_bad_shared_parameters_are_refused(shared):
    with pytest.raises(ValueError, match="shared parameter"):
        _chain(6, shared)


def test_gpt2_tiny_names_its_tied_embedding_and_json_keeps_it():
    costs = model_costs("tiny", 64)
    assert costs.shared_params == (((0, len(costs.nodes) - 1), 256 * 64 * 4),)
    assert costs_from_json(costs_to_json(costs)) == costs


def test_a_two_stage_plan_pays_the_tied_frame_and_the_audit_agrees():
    costs = model_costs("tiny", 64)
    device = DeviceProfile(name="cpu", flops=5e10, memory_bandwidth=2e9, memory_bytes=4 << 30)
    peers = [Peer(peer_id=p, device=device, uplink=MB, downlink=MB) for p in "ab"]
    links = {(a, b): LinkProfile(bandwidth=MB, rtt=0.02) for a, b in ("ab", "ba")}
    swarm = Swarm.from_links(peers, links)
    config = PlanConfig(micro_batches=4, batch_size=8, graph_batch_size=1, compression=False)
    cut = [0, len(costs.nodes) // 2, len(costs.nodes)]
    untied = GraphCosts(nodes=costs.nodes, input_bytes=costs.input_bytes,
                        output_names=costs.output_names, uncuttable=costs.uncuttable)  # fmt: skip
    tied = build_plan(costs, swarm, config, [["a"], ["b"]], cut)
    plain = build_plan(untied, swarm, config, [["a"], ["b"]], cut)
    # The frame holds stage 0's uplink after its last backward: the step is that much longer
    # (or more, where the longer step lets a connection idle past its timeout).
    assert tied.estimated_step_time >= plain.estimated_step_time + 0.99 * 65536 / MB
    retimed = Retimer(costs, swarm, config).retime(tied).plan
    assert retimed.estimated_step_time == pytest.approx(tied.estimated_step_time)
