"""The per-frame term of the cost model (issue 25: topology C's estimate was 0.58x of the
measured step): which frames a stage pays for, that a plan's stages pay them, that the figure
travels in a node's record, and the measure's arithmetic (its timing is benchmarks/'s)."""

from dataclasses import replace

import numpy as np
import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.dag.baselines import naive_plan
from fusionllm.dag.chain_cuts import _Chain, _make_unit, _Model, _solve_chain
from fusionllm.dag.cost import DeviceProfile, LinkProfile, frame_time, mbps, stage_frames
from fusionllm.dag.plan_build import NO_TOPK, build_plan, topk_frames
from fusionllm.dag.plan_check import Retimer
from fusionllm.dag.planner import PlanConfig
from fusionllm.dag.swarm import Peer, Swarm
from fusionllm.dht.records import DeviceInfo, RecordError
from fusionllm.node.control.frame_cost import FrameProbeConfig, per_side
from tests.unit.test_planner import chain_graph

GIB = 2**30
CPU = DeviceProfile(name="cpu", flops=1e11, memory_bandwidth=1e10, memory_bytes=16 * GIB)


def test_a_stage_pays_for_the_frames_it_sends_and_receives_per_pass():
    assert [stage_frames(k, 1) for k in range(1)] == [0]  # one stage: no frames at all
    assert [stage_frames(k, 2) for k in range(2)] == [1, 1]
    assert [stage_frames(k, 4) for k in range(4)] == [1, 2, 2, 1]
    device = replace(CPU, frame_overhead=2e-3)
    assert frame_time(1, 4, device) == pytest.approx(4e-3)
    assert frame_time(0, 4, CPU) == 0.0  # not measured: no term
    with pytest.raises(ValueError, match=r"stage must be in \[0, 2\), got 2"):
        stage_frames(2, 2)
    with pytest.raises(ConfigError, match="frame_overhead must be finite and >= 0"):
        replace(CPU, frame_overhead=-1.0)


def _swarm(device: DeviceProfile, n: int) -> Swarm:
    return _swarm_of([device] * n)


def _swarm_of(devices: list[DeviceProfile], bandwidth: float = mbps(1000)) -> Swarm:
    peers = [Peer(peer_id=f"p{i}", device=device, uplink=bandwidth, downlink=bandwidth,
                  rtt=1e-3) for i, device in enumerate(devices)]  # fmt: skip
    links = {
        (x.peer_id, y.peer_id): LinkProfile(bandwidth=bandwidth, rtt=1e-3)
        for x in peers
        for y in peers
        if x is not y
    }
    return Swarm.from_links(peers, links)


def test_every_stage_of_a_plan_pays_its_frames_on_both_passes():
    graph, config = chain_graph(8), PlanConfig(micro_batches=4, batch_size=4, compression=False)
    overhead = 5e-3
    base = naive_plan(graph, _swarm(CPU, 4), config)
    priced = naive_plan(graph, _swarm(replace(CPU, frame_overhead=overhead), 4), config)
    assert [s.peers for s in priced.stages] == [s.peers for s in base.stages]
    stages = len(priced.stages)
    assert stages >= 2
    for k, (a, b) in enumerate(zip(base.stages, priced.stages, strict=True)):
        # A replica sends and receives the frames of its share of the micro-batches.
        extra = max(b.shares) * stage_frames(k, stages) * overhead
        assert b.forward_time == pytest.approx(a.forward_time + extra)
        assert b.backward_time == pytest.approx(a.backward_time + extra)
    assert priced.estimated_step_time > base.estimated_step_time


def test_the_figure_travels_in_a_device_record_and_old_records_read_without_it():
    info = DeviceInfo(name="cpu", kind="cpu", memory_bytes=GIB, flops=1e11,
                      memory_bandwidth=1e10, op_overhead=2e-5, cpu_cores=1, ram_bytes=GIB,
                      frame_overhead=6e-4)  # fmt: skip
    assert DeviceInfo.from_wire(info.to_wire()) == info
    old = {k: v for k, v in info.to_wire().items() if k != "frm"}
    assert DeviceInfo.from_wire(old).frame_overhead == 0.0
    assert "frm" not in replace(info, frame_overhead=0.0).to_wire()
    for bad in (-1e-3, 2.0, float("nan"), "1e-3"):
        with pytest.raises(RecordError, match="frame overhead"):
            DeviceInfo.from_wire({**info.to_wire(), "frm": bad})


def test_a_round_of_frames_is_halved_per_side_and_the_probe_config_is_checked():
    assert per_side(0.032, 16) == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="need round_s > 0"):
        per_side(0.0, 16)
    with pytest.raises(ConfigError, match="shape must be"):
        FrameProbeConfig(shape=())
    with pytest.raises(ConfigError, match="frames and repeats must be >= 1"):
        FrameProbeConfig(frames=0)


def test_top_k_frames_are_charged_to_both_ends_and_the_retimer_agrees():
    """A link AdaTopK compresses costs its two ends a top-k frame's CPU per micro-batch and
    pass (``topk_frame_factor`` x the dense figure), not a dense frame's (issue 25: top-k
    frames 6.07 ms a side against 0.76, uncharged)."""
    graph, overhead = chain_graph(8), 5e-3
    swarm = _swarm(replace(CPU, frame_overhead=overhead), 2)
    slow = {(a, b): LinkProfile(bandwidth=mbps(1), rtt=1e-3) for a in ("p0", "p1")
            for b in ("p0", "p1") if a != b}  # fmt: skip
    swarm = Swarm.from_links(list(swarm.peers), slow)
    groups, cuts = [["p0"], ["p1"]], [0, 3, 8]  # a 100 MiB cut over 1 Mbit/s

    def plan(factor: float):
        config = PlanConfig(micro_batches=4, batch_size=4, topk_frame_factor=factor)
        return build_plan(graph, swarm, config, groups, cuts), config

    free, _ = plan(1.0)
    charged, config = plan(8.0)
    link = charged.links[0]
    assert (link.forward_codec, link.backward_codec) == ("topk", "topk")
    counts = [(f.frames, b.frames) for f, b in topk_frames(charged.links, 2)]
    assert counts == [(1, 1), (1, 1)]
    extra = 7 * overhead  # one top-k frame per pass at each end, beyond its dense figure
    for a, b in zip(free.stages, charged.stages, strict=True):
        assert b.forward_time == pytest.approx(a.forward_time + extra)
        assert b.backward_time == pytest.approx(a.backward_time + extra)
    assert charged.estimated_step_time > free.estimated_step_time
    # Every node re-times a proposal: it must find the same figures, charge included.
    retimed = Retimer(graph, swarm, config).retime(charged).plan
    assert retimed.estimated_step_time == pytest.approx(charged.estimated_step_time)
    assert topk_frames([], 1) == [NO_TOPK]
    with pytest.raises(ConfigError, match="topk_frame_factor must be >= 1"):
        PlanConfig(topk_frame_factor=0.5)


def test_the_cut_takes_work_off_a_device_whose_frames_cost_much():
    """The chain solver charges each stage its dense frames as build_plan does: cut blind to
    them (the middle of 12 equal nodes), the plan is slower than with the cut it picks."""
    graph = chain_graph(12, narrow=12, flops=10**9)  # every inner cut the same bytes
    config = PlanConfig(micro_batches=4, batch_size=4, compression=False)
    fast = mbps(10_000)  # links carry a cut in less than a stage computes

    def solve(swarm: Swarm) -> tuple[list[int], float]:
        model = _Model(graph, swarm, config)
        chain = _Chain(model, [_make_unit(model, np.array([i]), i) for i in range(2)],
                       (np.full((2, 2), fast), np.full((2, 2), 1e-3)))  # fmt: skip
        cuts = _solve_chain(chain)
        return cuts, chain.bottleneck(cuts)

    assert solve(_swarm_of([CPU, CPU], fast))[0] == [0, 6, 12]
    # p0's frames cost 0.1 s a side: about three nodes' compute per pass.
    costly = _swarm_of([replace(CPU, name="slow-io", frame_overhead=0.1), CPU], fast)
    cuts, bottleneck = solve(costly)
    assert cuts[1] < 6
    groups = [["p0"], ["p1"]]
    chosen = build_plan(graph, costly, config, groups, cuts).estimated_step_time
    blind = build_plan(graph, costly, config, groups, [0, 6, 12]).estimated_step_time
    assert chosen < 0.97 * blind
    assert bottleneck <= chosen  # the chain's bottleneck still bounds the plan (pruning)
