import math

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.compression.adaptive import target_ratio, topk_wire_bytes
from fusionllm.dag.cost import (
    DeviceProfile,
    LinkProfile,
    allreduce_time,
    compressed_wire,
    estimate_cut_time,
    estimate_stage_time,
    mbps,
    node_time,
    transfer_time,
)
from fusionllm.dag.graph import OpNode

GPU = DeviceProfile(name="gpu", flops=1e12, memory_bandwidth=1e11, memory_bytes=8 * 2**30)


def _node(fwd: int, params: int = 0, out: int = 0) -> OpNode:
    return OpNode(
        node_id="n",
        op="linear",
        inputs=(),
        forward_flops=fwd,
        backward_flops=2 * fwd,
        param_bytes=params,
        output_bytes=out,
        peak_activation_bytes=out,
    )


def test_node_time_is_compute_bound_for_matmuls() -> None:
    t = node_time(_node(10**12, params=1000, out=1000), GPU)
    assert t.forward == pytest.approx(1.0)
    assert t.backward == pytest.approx(2.0)


def test_node_time_is_memory_bound_for_elementwise() -> None:
    t = node_time(_node(10, out=10**11), GPU)
    assert t.forward == pytest.approx(1.0)  # 1e11 bytes at 1e11 B/s
    assert t.backward == pytest.approx(2.0)


def test_stage_time_adds_nodes_and_scales_with_batch() -> None:
    nodes = [_node(10**12), _node(2 * 10**12)]
    assert estimate_stage_time(nodes, GPU).total == pytest.approx(9.0)
    assert estimate_stage_time(nodes, GPU, scale=0.5).total == pytest.approx(4.5)


def test_transfer_and_cut_time() -> None:
    link = LinkProfile(bandwidth=mbps(8), rtt=0.1)
    assert mbps(8) == 1e6
    assert transfer_time(1e6, link) == pytest.approx(1.05)
    assert estimate_cut_time(10**6, link) == pytest.approx(1.05)
    # With a budget of 0.01 s the tensor is compressed to what AdaTopK's rule allows.
    ratio = target_ratio(link.bandwidth, 10**6, 0.01, min_ratio=0.001)
    wire = topk_wire_bytes(10**6 // 4, ratio)
    assert estimate_cut_time(10**6, link, time_budget_s=0.01, min_ratio=0.001) == pytest.approx(
        wire / link.bandwidth + 0.05
    )


def test_compressed_wire_dense_fp16_topk() -> None:
    assert compressed_wire(1000, 1e6, 1.0, min_ratio=0.01).codec == "dense"
    fp16 = compressed_wire(1000, 600, 1.0, min_ratio=0.01)
    assert (fp16.codec, fp16.wire_bytes) == ("fp16", 500)
    topk = compressed_wire(10**6, 1e3, 1.0, min_ratio=0.01)
    assert topk.codec == "topk"
    assert topk.ratio == pytest.approx(0.01)
    assert topk.wire_bytes == topk_wire_bytes(250_000, 0.01)


def test_allreduce_time() -> None:
    link = LinkProfile(bandwidth=1e9, rtt=0.001)
    assert allreduce_time(1e9, 1, link) == 0.0
    assert allreduce_time(1e9, 2, link) == pytest.approx(1.0 + 0.001)
    assert allreduce_time(1e9, 4, link) == pytest.approx(1.5 + 0.002)


def test_profiles_reject_bad_numbers() -> None:
    with pytest.raises(ConfigError, match="flops"):
        DeviceProfile(flops=0, memory_bandwidth=1, memory_bytes=1)
    with pytest.raises(ConfigError, match="bandwidth"):
        LinkProfile(bandwidth=-1, rtt=0)
    with pytest.raises(ConfigError, match="rtt"):
        LinkProfile(bandwidth=1, rtt=math.nan)
