"""A node's own work against the planner's model (stretch.py): the published stretch, what it
is measured against, the record field and how every planner plans with it."""

import dataclasses

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.dht.records import NodeInfo, RecordError, Witnessed
from fusionllm.node.control.agreement import serving_peers
from fusionllm.node.control.bandwidth import peer_of
from fusionllm.node.control.pace import predicted_compute_s
from fusionllm.node.control.pacing import StepPacing
from fusionllm.node.control.stretch import (
    StretchMeter,
    as_planned,
    predicted_own_s,
    swarm_slowdown,
)
from fusionllm.node.pipeline.steps import StepReport
from tests.unit.test_epochs import GRAPH, SETTINGS, FakeClock, epoch_round, record, swarm_of
from tests.unit.test_pace import _meter_after as pace_meter_after
from tests.unit.test_records import node


def _meter_after(ratios, meter=None) -> StretchMeter:
    return pace_meter_after(ratios, meter or StretchMeter(window=4, skip=0))


def test_nothing_is_published_before_a_window_of_steps():
    assert _meter_after([3.0] * 3).published == 0.0
    assert _meter_after([3.0] * 4).published == pytest.approx(2**1.5)


@pytest.mark.parametrize(
    ("ratios", "stretch"),
    [([2.1] * 4, 2.0), ([2.3] * 4, 2**1.25), ([1.18] * 4, 2**0.25), ([1.05] * 4, 1.0),
     ([0.4] * 4, 1.0), ([1.4, 9.0, 1.35, 1.45], 2**0.5), ([1e6] * 4, 64.0)],
)  # fmt: skip
def test_the_stretch_is_the_medians_nearest_quarter_power_of_two_at_least_one(ratios, stretch):
    assert _meter_after(ratios).published == pytest.approx(stretch)


def test_a_published_stretch_holds_through_a_small_change_and_leaves_on_a_large_one():
    meter = _meter_after([2.4] * 8)  # the first figure, and the window confirming it
    assert meter.published == pytest.approx(2**1.25)
    assert _meter_after([1.5] * 4, meter).published == pytest.approx(2**1.25)  # 0.63x: held
    assert _meter_after([3.9] * 4, meter).published == pytest.approx(2**1.25)  # 1.64x: held
    assert _meter_after([4.1] * 4, meter).published == pytest.approx(4.0)  # 1.72x: moved


def test_the_first_figure_is_published_again_by_the_next_window_of_steps():
    """C, session 17: a first window beside the swarm's first plans and probes published
    2.83 for a last stage whose median then ran ~13% lower; inside the band, it held."""
    meter = _meter_after([3.0] * 4)
    assert meter.published == pytest.approx(2**1.5)
    assert _meter_after([2.2] * 3, meter).published == pytest.approx(2**1.5)  # not a window
    assert _meter_after([2.2], meter).published == pytest.approx(2**1.25)  # 0.78x: moved
    assert _meter_after([3.0] * 4, meter).published == pytest.approx(2**1.25)  # now it holds


def test_bad_measurements_are_ignored_and_a_bad_window_refused():
    meter = _meter_after([2.0] * 8)
    for own, predicted in ((0.0, 1.0), (1.0, 0.0), (float("inf"), 1.0), (-1.0, 1.0)):
        meter.add(own, predicted)
    assert list(meter.window.ratios) == [2.0] * 4
    with pytest.raises(ConfigError):
        StretchMeter(window=2)
    with pytest.raises(ConfigError):
        StretchMeter(skip=-1)


def test_a_plans_first_steps_are_left_out():
    meter = StretchMeter(window=4, skip=2)
    _meter_after([100.0, 100.0] + [2.0] * 4, meter)
    assert meter.published == pytest.approx(2.0)
    meter.reset()
    _meter_after([100.0, 100.0] + [2.0] * 3, meter)  # a new plan: its first two again
    assert list(meter.window.ratios) == [2.0] * 3


def test_own_time_is_the_step_less_its_waits_on_the_network():
    report = StepReport(step=0, loss=1.0, grad_norm=1.0, seconds=1.0, busy_s=0.4, wait_s=0.2,
                        phases={"exchange_s": 0.05, "summary_wait_s": 0.1, "update_s": 0.03,
                                "sends_s": 0.05})  # fmt: skip
    assert report.own_s == pytest.approx(0.6)  # compute, framing, data and the update


def _adopted():
    _, nodes = swarm_of(2, FakeClock())
    epoch_round(nodes, 850_000_000)
    return nodes[0].agreement.adopted, nodes[0].info().device


def test_the_model_of_own_work_is_the_stages_compute_and_frames_at_the_pace():
    adopted, device = _adopted()
    config, plan = SETTINGS.plan_config(), adopted.plan
    peer = sorted(serving_peers(plan))[0]
    framed = dataclasses.replace(device, frame_overhead=1e-3)
    compute = predicted_compute_s(GRAPH, plan, peer, framed, config)
    own = predicted_own_s(plan, peer, framed, config, compute_s=compute, pace=1.0)
    k = next(k for k, s in enumerate(plan.stages) if peer in s.peers)
    frames = (k > 0) + (k < len(plan.stages) - 1)
    share = plan.stages[k].shares[plan.stages[k].peers.index(peer)]
    assert own == pytest.approx(compute + config.micro_batches * share * frames * 2 * 1e-3)
    again = predicted_own_s(plan, peer, framed, config, compute_s=compute, pace=2.0)
    assert again == pytest.approx(2 * own)
    assert predicted_own_s(plan, "stranger", framed, config, compute_s=compute, pace=1.0) is None


def test_the_model_of_own_work_charges_the_top_k_frames_a_stage_codes():
    """C, session 17: AdaTopK's coding counted as stretch (0.077 s of own work a step coded,
    0.034 s dense) planned every member 2.83x slower, and AdaTopK then compressed less."""
    adopted, device = _adopted()
    config, plan = SETTINGS.plan_config(), adopted.plan
    assert len(plan.stages) == 2
    framed = dataclasses.replace(
        device, frame_overhead=1e-3, topk_frame_overhead=2e-3, topk_byte_cost=1e-9
    )
    coded = dataclasses.replace(
        plan, links=(dataclasses.replace(plan.links[0], backward_codec="topk"),)
    )
    dense_bytes = plan.links[0].dense_bytes
    for peer in ("peer0", "peer1"):  # the gradient's encoder and its decoder pay alike
        compute = predicted_compute_s(GRAPH, plan, peer, framed, config)
        dense = predicted_own_s(plan, peer, framed, config, compute_s=compute, pace=1.0)
        topk = predicted_own_s(coded, peer, framed, config, compute_s=compute, pace=1.0)
        k = next(k for k, s in enumerate(plan.stages) if peer in s.peers)
        share = plan.stages[k].shares[0]
        beyond = (2e-3 - 1e-3) + 1e-9 * dense_bytes  # one frame, its constant and its bytes
        assert topk - dense == pytest.approx(config.micro_batches * share * beyond)


def test_our_steps_publish_a_stretch_once_a_window_of_them_ran():
    adopted, device = _adopted()
    config, peer = SETTINGS.plan_config(), sorted(serving_peers(adopted.plan))[0]
    compute = predicted_compute_s(GRAPH, adopted.plan, peer, device, config)
    model = predicted_own_s(adopted.plan, peer, device, config, compute_s=compute, pace=1.0)
    pacing, changed = StepPacing(), []
    for _ in range(24):
        changed.append(
            pacing.measured(
                adopted,
                adopted.digest,
                compute,
                2.4 * model,
                costs=GRAPH,
                peer_id=peer,
                device=device,
                config=config,
            )
        )
    assert changed == [False] * 23 + [True]  # once, when measured past the warm-up
    assert pacing.stretch.published == pytest.approx(2**1.25)
    assert pacing.meter.published == 1.0  # its compute ran as its device predicts


def test_a_new_pace_keeps_pace_times_stretch_and_measures_the_stretch_afresh():
    meter = _meter_after([2.0] * 8)
    meter.add(1.5, 1.0)
    meter.repaced(1.0, 2.0)
    assert meter.published == pytest.approx(1.0)  # 2.0 at pace 1 is 1.0 at pace 2
    assert list(meter.window.ratios) == []  # measured against the old pace
    assert _meter_after([1.3] * 4, meter).published == pytest.approx(2**0.5)  # provisional


def test_a_pace_published_while_the_stretch_is_measured_is_not_counted_twice():
    """C, session 17: a node published pace 2, and 2 s later a stretch of 2.0 from a window
    measured mostly at pace 1: planned at 4.0 for steps of about 2."""
    adopted, device = _adopted()
    config, peer = SETTINGS.plan_config(), sorted(serving_peers(adopted.plan))[0]
    compute = predicted_compute_s(GRAPH, adopted.plan, peer, device, config)
    model = predicted_own_s(adopted.plan, peer, device, config, compute_s=compute, pace=1.0)
    pacing, planned = StepPacing(), []
    for _ in range(48):  # everything it does runs 2.5x the model: compute and all
        pacing.measured(adopted, adopted.digest, 2.5 * compute, 2.5 * model, costs=GRAPH,
                        peer_id=peer, device=device, config=config)  # fmt: skip
        planned.append(pacing.meter.published * (pacing.stretch.published or 1.0))
    assert pacing.meter.published == 2.0
    assert pacing.stretch.published  # measured, at the new pace
    assert max(planned) <= 2.5 * 2**0.125  # never 2 x 2
    assert planned[-1] >= 2.0


def test_a_stretched_record_is_planned_slower_and_round_trips():
    info = record("p", stretch=2.0)
    assert NodeInfo.from_wire(info.to_wire()).stretch == 2.0
    assert "str" not in record("p").to_wire()  # not measured: older readers see nothing new
    fast, both = peer_of(record("p")), peer_of(record("p", stretch=2.0, pace=2.0))
    assert both.device.flops == pytest.approx(fast.device.flops / 4, rel=0.1)
    assert peer_of(record("p", stretch=0.0)) == fast  # unmeasured: as advertised


@pytest.mark.parametrize("value", [0.5, 0.0, float("nan"), 65.0, "2", True])
def test_a_bad_stretch_is_refused(value):
    with pytest.raises(RecordError, match="stretch"):
        NodeInfo.from_wire({**node().to_wire(), "str": value})


def test_every_member_is_planned_at_the_median_of_the_measured_slowdowns():
    members = {
        "a": record("a", stretch=2.0),
        "b": record("b", stretch=4.0),
        "c": record("c", stretch=2**1.25),
        "new": record("new"),
        "watch": record("watch", observer=True, stretch=32.0),  # trains nothing: not counted
        "slow": record("slow", witnessed=(Witnessed("new", 4.0),)),
    }
    planned = as_planned(members)
    assert swarm_slowdown(members) == pytest.approx(2**1.25)
    planned_at = {p: i.stretch for p, i in planned.items()}
    # What its witness saw still counts: new computes 4x slower than its device, slower than
    # the swarm's 2.38 by its pace alone, so it is planned at its pace.
    assert planned["new"].pace == 4.0
    assert planned_at == pytest.approx({**dict.fromkeys(members, 2**1.25), "new": 1.0})
    assert as_planned({"x": record("x")})["x"].stretch == 1.0  # nobody measured: as modelled


def test_of_two_measured_stretches_the_swarm_is_planned_at_the_larger():
    """A step runs at its slowest stage: B's stage-0 host measured 1.0 while it waited for the
    stage-1 host, which measured 1.68."""
    members = {"w1": record("w1", stretch=1.0), "w2": record("w2", stretch=2**0.75)}
    assert swarm_slowdown(members) == pytest.approx(2**0.75)


def test_a_stretch_measured_on_top_of_a_pace_is_not_counted_twice():
    """C, session 16: h1 published pace 2 and stretch 1.41, h2 pace 1 and stretch 2.83: both
    ran at 2.83 times their device's model. h2's stretch on h1's pace planned h1 at 5.66."""
    members = {
        "h1": record("h1", pace=2.0, stretch=2**0.5),
        "h2": record("h2", stretch=2**1.5),
        "h3": record("h3"),  # never trained
        "h4": record("h4", pace=4.0),  # slower than the swarm by its pace alone
    }
    assert swarm_slowdown(members) == pytest.approx(2**1.5)
    slowdown = {p: i.pace * i.stretch for p, i in as_planned(members).items()}
    assert slowdown == pytest.approx({"h1": 2**1.5, "h2": 2**1.5, "h3": 2**1.5, "h4": 4.0})
    fast, h1 = peer_of(record("h1")), peer_of(as_planned(members)["h1"])
    assert h1.device.flops == pytest.approx(fast.device.flops / 2**1.5, rel=0.1)
