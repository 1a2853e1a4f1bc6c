"""Top-k frames charged by their size (issue 25, topology C: the OP-Fence + AdaTopK plan ran at
0.43-0.50 of its estimate, its top-k frames charged a fixed 8 x the dense frame, 2.7 ms, where
655 KB frames took some 9-22 ms): a node's two-size fit, the charge it gives, a plan's stages
paying it by the cut's dense bytes, and the figures in a node's record."""

from dataclasses import replace

import msgpack
import numpy as np
import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.dag.cost import DeviceProfile, LinkProfile, mbps, topk_charge
from fusionllm.dag.plan_build import build_plan, topk_frames
from fusionllm.dag.plan_check import Retimer
from fusionllm.dag.planner import PlanConfig
from fusionllm.dag.swarm import Peer, Swarm
from fusionllm.dht.records import DeviceInfo, RecordError
from fusionllm.node.control.frame_cost import TopkFrameCost, _adatopk_packer, linear_cost
from tests.unit.test_planner import chain_graph

GIB = 2**30
DENSE_S = 3.4e-4  # h1's dense frame on topology C
PER_FRAME, PER_BYTE = 1e-3, 1 / 40e6  # 1 ms + 40 MB/s, in the range measured in session 8
CPU = DeviceProfile(name="cpu", flops=1e11, memory_bandwidth=1e10, memory_bytes=16 * GIB,
                    frame_overhead=DENSE_S)  # fmt: skip
MEASURED = replace(CPU, topk_frame_overhead=PER_FRAME, topk_byte_cost=PER_BYTE)


def _charge(frames: int, nbytes: float, device: DeviceProfile) -> float:
    arrays = {
        "dense_s": np.array([device.frame_overhead]),
        "per_frame": np.array([device.topk_frame_overhead]),
        "per_byte": np.array([device.topk_byte_cost]),
    }
    return float(topk_charge(frames, nbytes, factor=8.0, **arrays)[0])


def test_the_fit_through_two_sizes_is_a_constant_and_a_rate():
    fit = linear_cost((128 << 10, 2e-3 + (128 << 10) * 1e-8), (2 << 20, 2e-3 + (2 << 20) * 1e-8))
    assert fit.per_frame == pytest.approx(2e-3)
    assert fit.per_byte == pytest.approx(1e-8)
    # Noise that tilts the line below zero or under the origin is clamped, not negative.
    assert linear_cost((100, 5e-3), (200, 4e-3)) == TopkFrameCost(per_frame=5e-3, per_byte=0.0)
    assert linear_cost((100, 0.0), (200, 1e-3)).per_frame == 0.0
    with pytest.raises(ValueError, match="need 0 < bytes small < large"):
        linear_cost((200, 1e-3), (100, 2e-3))
    with pytest.raises(ConfigError, match="per_byte must be finite and >= 0"):
        TopkFrameCost(per_frame=0.0, per_byte=float("nan"))


def test_a_top_k_frame_costs_a_constant_plus_its_dense_bytes():
    tiny = _charge(1, 1000, MEASURED)
    assert tiny == pytest.approx(PER_FRAME - DENSE_S, rel=0.05)  # about the constant
    c_frame = 655_000  # s8 C's first plan: 655 KB top-k activations into the head
    assert _charge(1, c_frame, MEASURED) == pytest.approx(PER_FRAME - DENSE_S + c_frame * PER_BYTE)
    assert _charge(1, 10 * c_frame, MEASURED) > 8 * _charge(1, c_frame, MEASURED)
    assert _charge(4, 4 * c_frame, MEASURED) == pytest.approx(4 * _charge(1, c_frame, MEASURED))
    # A peer that published no top-k figures keeps the fixed 8x its dense frame, any size.
    assert _charge(2, c_frame, CPU) == _charge(2, 10 * c_frame, CPU) == pytest.approx(14 * DENSE_S)
    assert _charge(0, 0.0, MEASURED) == 0.0


def test_the_c_plan_shape_is_charged_by_its_cut_on_both_ends_and_passes():
    """One host, then two replicas of the head, top-k both ways over a slow link: each end pays
    per_frame + per_byte x the cut's dense bytes a pass, beyond its dense frame (replicas their
    share of it), and every node's retimer finds the same estimate."""
    graph = chain_graph(8, flops=10**9)
    peers = [Peer(peer_id=f"h{i}", device=MEASURED, uplink=mbps(8), downlink=mbps(40), rtt=0.04)
             for i in range(3)]  # fmt: skip
    links = {(x.peer_id, y.peer_id): LinkProfile(bandwidth=mbps(8), rtt=0.04)
             for x in peers for y in peers if x is not y}  # fmt: skip
    measured = Swarm.from_links(peers, links)
    unmeasured = Swarm.from_links([replace(p, device=CPU) for p in peers], links)
    config = PlanConfig(micro_batches=4, batch_size=4, topk_frame_factor=1.0)
    groups, cuts = [["h0"], ["h1", "h2"]], [0, 6, 8]
    free = build_plan(graph, unmeasured, config, groups, cuts)
    charged = build_plan(graph, measured, config, groups, cuts)
    link = charged.links[0]
    assert (link.forward_codec, link.backward_codec) == ("topk", "topk")
    assert [(f.dense_bytes, b.dense_bytes) for f, b in topk_frames(charged.links, 2)] == [
        (link.dense_bytes, link.dense_bytes)
    ] * 2
    extra = PER_FRAME - DENSE_S + link.dense_bytes * PER_BYTE
    assert extra > 100 * 7 * DENSE_S  # the fixed 8x charge missed it by far on a large cut
    for a, b in zip(free.stages, charged.stages, strict=True):
        share = max(b.shares)
        assert b.forward_time == pytest.approx(a.forward_time + share * extra)
        assert b.backward_time == pytest.approx(a.backward_time + share * extra)
    assert charged.estimated_step_time > free.estimated_step_time + extra
    retimed = Retimer(graph, measured, config).retime(charged).plan
    assert retimed.estimated_step_time == pytest.approx(charged.estimated_step_time)


def test_top_k_figures_travel_in_a_record_and_a_peers_are_bounded():
    info = DeviceInfo(name="cpu", kind="cpu", memory_bytes=GIB, flops=1e11, memory_bandwidth=1e10,
                      op_overhead=1e-5, cpu_cores=2, ram_bytes=GIB, frame_overhead=3e-4,
                      topk_frame_overhead=1e-3, topk_byte_cost=2.5e-8)  # fmt: skip
    wire = info.to_wire()
    assert (wire["tkf"], wire["tkb"]) == (1e-3, 2.5e-8)
    assert DeviceInfo.from_wire(wire) == info
    old = replace(info, topk_frame_overhead=0.0, topk_byte_cost=0.0).to_wire()
    assert "tkf" not in old
    assert "tkb" not in old
    for key, bad in (("tkf", -1e-3), ("tkf", 2.0), ("tkb", float("inf")), ("tkb", 1e-3),
                     ("tkb", "fast")):  # fmt: skip
        with pytest.raises(RecordError, match="top-k"):
            DeviceInfo.from_wire({**wire, key: bad})


def test_the_probe_codes_activations_and_gradients_as_their_links_do():
    """Forward a ternary activation (ratio <= 0.25, no feedback), backward a top-k gradient
    with error feedback, in turn: the fit is the mean of the two, as the codec runs."""
    pack = _adatopk_packer((4, 8, 16), 0.2)
    codecs = [msgpack.unpackb(pack(), raw=False)["c"] for _ in range(4)]
    assert codecs == ["tern", "topk", "tern", "topk"]
