"""Stage workers, layouts and run configs: the parts of a pipeline process below its runner.

Whole pipeline runs (the real ``PipelineRunner``s, 1F1B, tied and replicated parameters)
are compared with the single-process reference in ``test_runner.py``.
"""

from dataclasses import replace

import pytest
import torch

from fusionllm.common.errors import ConfigError
from fusionllm.dag.cost import DeviceProfile, LinkProfile, mbps
from fusionllm.dag.graph import GraphCosts, OpNode
from fusionllm.dag.planner import PlanConfig, plan
from fusionllm.dag.swarm import Peer, Swarm
from fusionllm.node.errors import PipelineError
from fusionllm.node.pipeline.data import TokenDataset
from fusionllm.node.pipeline.layout import (
    PipelineLayout,
    balanced_cuts,
    crossing_values,
    cut_problem,
)
from fusionllm.node.pipeline.local_train import train_local
from fusionllm.node.pipeline.stage import StageWorker, clip_coefficient
from fusionllm.node.pipeline.train_config import (
    TrainConfig,
    build_layout,
    build_model,
    halves_from_plan,
    ratios_from_plan,
)

SMALL_GPU = DeviceProfile(name="small", flops=10e12, memory_bandwidth=1e12, memory_bytes=3 << 30)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dataset() -> TokenDataset:
    return TokenDataset.from_stdlib(max_bytes=256 << 10)


def _config(**overrides) -> TrainConfig:
    base = dict(stages=2, micro_batches=3, batch_size=2, seq_len=16, steps=3, max_grad_norm=0.5)
    base.update(overrides)
    return TrainConfig(**base)


def test_clipping_changes_the_reference_run(dataset) -> None:
    """With max_grad_norm 0.5 the early steps clip (the runner tests' setting)."""
    config = _config(steps=1, max_grad_norm=0.0)
    unclipped = train_local(config, dataset=dataset)
    clipped = train_local(_config(steps=1), dataset=dataset)
    assert not all(
        torch.equal(unclipped.parameters[n], clipped.parameters[n]) for n in clipped.parameters
    )


def test_clip_coefficient() -> None:
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(2.0, 1.0) == pytest.approx(0.5)
    assert clip_coefficient(1e9, 0.0) == 1.0
    assert clip_coefficient(1e9, float("inf")) == 1.0


def test_layout_links_and_tied_parameters() -> None:
    config = _config(stages=3)
    layout = build_layout(config, build_model(config))
    assert layout.num_stages == 3
    assert layout.tied == {"transformer.wte.weight": (0, 2)}
    assert layout.counted_elsewhere(2) == frozenset({"transformer.wte.weight"})
    assert layout.counted_elsewhere(0) == frozenset()
    for link in layout.links:
        assert link.numel > 0
        flat = torch.arange(link.numel, dtype=torch.float32)
        assert torch.equal(link.pack(link.unpack(flat)), flat)


def test_bad_cuts_are_refused() -> None:
    config = _config()
    graph = build_layout(config, build_model(config)).graph
    ids = graph.node_ids
    # The position ids are int64: a cut that makes them cross is not a float link.
    cut = ids.index("transformer_wpe")
    assert "position_ids" in crossing_values(graph, cut)
    assert "int64" in cut_problem(graph, cut)
    with pytest.raises(ConfigError, match="position_ids"):
        PipelineLayout(graph, [cut])
    with pytest.raises(ConfigError, match="increasing"):
        PipelineLayout(graph, [10, 5])
    for stages in (2, 3, 4, 6):
        cuts = balanced_cuts(graph, stages)
        assert len(cuts) == stages - 1
        PipelineLayout(graph, cuts)


def test_worker_refuses_out_of_order_calls(dataset) -> None:
    config = _config()
    layout = build_layout(config, build_model(config))
    first = StageWorker(layout, 0, optimizer=config.optimizer, micro_batches=1)
    idx, _ = dataset.batch(config.batch, 0, 0)
    first.forward(0, 0, {"idx": idx})
    with pytest.raises(PipelineError, match="twice"):
        first.forward(0, 0, {"idx": idx})
    with pytest.raises(PipelineError, match="before its forward"):
        first.backward(0, 1, {})
    with pytest.raises(PipelineError, match="in flight"):
        first.clip_and_step(1.0)
    first.drop(0)
    assert first.in_flight == 0
    last = StageWorker(layout, 1, optimizer=config.optimizer, micro_batches=1)
    with pytest.raises(PipelineError, match="targets"):
        last.forward(0, 0, layout.links[0].unpack(torch.zeros(layout.links[0].numel)))


def _three_peer_plan():
    """An OP-Fence plan of three 3 GiB peers that each hold a third of a 1.5 GiB model: the
    c-b link is the bottleneck (top-k), b-a has room for fp16."""
    peers = [
        Peer(peer_id=name, device=SMALL_GPU, uplink=mbps(10_000), downlink=mbps(10_000), rtt=0.001)
        for name in "abc"
    ]
    bandwidth = {"ab": mbps(30), "bc": mbps(10), "ac": mbps(8)}
    links = {
        (x, y): LinkProfile(bandwidth=bandwidth["".join(sorted(x + y))], rtt=0.001)
        for x in "abc"
        for y in "abc"
        if x != y
    }
    nodes, prev = [], "x"
    for i in range(6):
        nodes.append(
            OpNode(node_id=f"n{i}", op="linear", inputs=(prev,), forward_flops=10**12,
                   backward_flops=2 * 10**12, param_bytes=256 << 20, output_bytes=4 << 20,
                   peak_activation_bytes=4 << 20)
        )  # fmt: skip
        prev = f"n{i}"
    graph = GraphCosts(nodes=tuple(nodes), input_bytes={"x": 1000}, output_names=(prev,))
    return plan(graph, Swarm.from_links(peers, links), PlanConfig(micro_batches=4, batch_size=4))


def test_link_ratios_come_from_a_plan() -> None:
    result = _three_peer_plan()
    assert [s.peers for s in result.stages] == [("c",), ("b",), ("a",)]
    codecs = [(link.src_stage, link.forward_codec, link.backward_codec) for link in result.links]
    assert codecs == [(0, "topk", "topk"), (1, "fp16", "fp16")]
    forward, backward = result.links[0].forward_ratio, result.links[0].backward_ratio
    assert 0 < forward < 1
    assert 0 < backward < 1
    expected = ((forward, 1.0), (backward, 1.0))  # the fp16 link is dense ...
    assert ratios_from_plan(result) == expected
    assert ratios_from_plan(replace(result, links=result.links[::-1])) == expected  # by stage
    halves = ((False, True), (False, True))  # ... at 2 bytes an element, as the plan counts it
    assert halves_from_plan(result) == halves
    assert halves_from_plan(replace(result, links=result.links[::-1])) == halves
    activation, gradient = expected
    config = _config(
        stages=3, activation_ratios=activation, gradient_ratios=gradient,
        activation_halves=halves[0], gradient_halves=halves[1],
    )  # fmt: skip
    assert config.activation_ratio(0) == forward
    assert config.gradient_ratio(1) == 1.0
    assert (config.activation_half(0), config.activation_half(1)) == (False, True)
    assert config.gradient_half(1)
    assert TrainConfig.from_json(config.to_json()) == config
    with pytest.raises(ConfigError, match="activation_halves needs 2 entries"):
        _config(stages=3, activation_halves=(True,))


def test_gradient_codec_is_validated_and_survives_json() -> None:
    config = _config(gradient_ratios=(0.05,), gradient_codec="ternary")
    assert TrainConfig.from_json(config.to_json()) == config
    assert _config().gradient_codec == "topk"
    with pytest.raises(ConfigError, match="gradient_codec"):
        _config(gradient_codec="sign")


def test_a_stage_without_parameters_steps(dataset) -> None:
    """Cuts around the GELU between two Linears leave the middle stage no parameters (the
    compute-balanced baseline made such a plan on the testbed, and AdamW raised on it)."""
    config = _config(stages=3, cuts=(43, 44))
    layout = build_layout(config, build_model(config))
    assert layout.graph.costs().nodes[43].param_bytes == 0
    middle = StageWorker(layout, 1, optimizer=config.optimizer, micro_batches=1)
    assert middle.parameters == {}
    assert middle.local_grad_sq_norm() == 0.0
    assert middle.clip_and_step(2.0) == pytest.approx(config.optimizer.max_grad_norm / 2.0)
    middle.skip_step()
    assert middle.state_dict() == {}
