"""Measured beats claimed (pace.py): the meter's published pace, the prediction it compares
against, and the planner's view of a paced node."""

import dataclasses

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.dht.records import NodeInfo, RecordError
from fusionllm.node.control.agreement import serving_peers
from fusionllm.node.control.bandwidth import peer_of
from fusionllm.node.control.pace import (
    PaceMeter,
    checked_compute,
    predicted_compute_s,
)
from fusionllm.node.control.pacing import StepPacing
from tests.unit.test_epochs import GRAPH, SETTINGS, FakeClock, epoch_round, record, swarm_of
from tests.unit.test_records import node
from tests.unit.test_seating import FAST, Marked


def _meter_after(ratios, meter=None) -> PaceMeter:
    meter = meter or PaceMeter(window=4)
    for r in ratios:
        meter.add(r, 1.0)
    return meter


def test_nothing_is_published_before_a_window_of_steps():
    assert _meter_after([8.0, 8.0, 8.0]).published == 1.0
    assert _meter_after([8.0] * 4).published == 8.0


@pytest.mark.parametrize(
    ("ratios", "pace"),
    [([1.9] * 4, 1.0), ([2.1] * 4, 2.0), ([4.2, 3.9, 4.1, 4.0], 4.0), ([3.9] * 4, 2.0),
     ([4.3] * 4, 4.0), ([0.01] * 4, 1.0), ([100.0, 1.0, 100.0, 100.0], 64.0)],
)  # fmt: skip
def test_the_pace_is_the_medians_power_of_two_above_the_threshold(ratios, pace):
    assert _meter_after(ratios).published == pace


def test_a_published_pace_holds_through_noise_and_leaves_on_a_real_change():
    meter = _meter_after([4.5] * 4)
    assert meter.published == 4.0
    assert _meter_after([3.1, 9.5, 3.2, 9.9], meter).published == 4.0  # median within the band


def test_bad_measurements_are_ignored():
    meter = _meter_after([8.0] * 4)
    for measured, predicted in ((0.0, 1.0), (1.0, 0.0), (float("inf"), 1.0), (-1.0, 1.0)):
        meter.add(measured, predicted)
    assert list(meter.window.ratios) == [8.0] * 4


@pytest.mark.parametrize(("window", "threshold"), [(2, 2.0), (16, 1.0), (16, float("nan"))])
def test_bad_meter_settings_are_refused(window, threshold):
    with pytest.raises(ConfigError):
        PaceMeter(window=window, threshold=threshold)


def test_the_prediction_is_the_planners_compute_for_the_peers_share():
    clock = FakeClock()
    _, nodes = swarm_of(2, clock)
    epoch_round(nodes, 850_000_000)
    plan = nodes[0].agreement.adopted.plan
    device = nodes[0].info().device
    config = SETTINGS.plan_config()
    seated = sorted(serving_peers(plan))
    times = [predicted_compute_s(GRAPH, plan, p, device, config) for p in seated]
    assert all(t > 0 for t in times)
    assert predicted_compute_s(GRAPH, plan, "stranger", device, config) is None
    slower = dataclasses.replace(device, flops=device.flops / 4, memory_bandwidth=1e10 / 4,
                                 op_overhead=device.op_overhead * 4)  # fmt: skip
    again = predicted_compute_s(GRAPH, plan, seated[0], slower, config)
    assert again == pytest.approx(4 * times[0], rel=1e-9)


def test_a_paced_record_is_planned_with_its_measured_figures():
    info = record("p", pace=4.0)
    assert NodeInfo.from_wire(info.to_wire()).pace == 4.0
    assert "pace" not in record("p").to_wire()  # older readers refuse unknown fields
    fast, paced = peer_of(record("p")), peer_of(info)
    assert paced.device.flops == pytest.approx(fast.device.flops / 4, rel=0.1)
    assert paced.device.op_overhead == pytest.approx(fast.device.op_overhead * 4, rel=0.1)


@pytest.mark.parametrize("value", [0.5, 0.0, float("nan"), 2e6, "4", True])
def test_a_bad_pace_is_refused(value):
    with pytest.raises(RecordError, match="pace"):
        NodeInfo.from_wire({**node().to_wire(), "pace": value})


def test_a_fast_claim_that_measures_slow_loses_its_seat():
    def seated(marks: dict) -> set[str]:
        clock = FakeClock()
        directory, nodes = swarm_of(2, clock)
        newcomer = Marked("fast", directory, clock, marks=marks, device=FAST, memory=24 << 30)
        nodes.append(newcomer)
        newcomer.heartbeat()
        epoch_round(nodes, 850_000_000)
        return serving_peers(nodes[0].agreement.adopted.plan)

    assert "fast" in seated({})
    assert "fast" not in seated({"pace": 4096.0})  # it measured itself 4096x slower: a CPU


def test_a_step_of_the_plan_we_switch_from_is_not_witnessed_against_the_next():
    """The trainer runs the old plan up to its switch step after the daemon adopted the next:
    a 3-stage step read against a 2-stage plan raised IndexError and stopped every trainer."""
    clock = FakeClock()
    _, nodes = swarm_of(2, clock)
    epoch_round(nodes, 850_000_000)
    adopted = nodes[0].agreement.adopted
    stages = len(adopted.plan.stages)
    ranks = [(f"peer{s % 2}", s) for s in range(stages + 1)]  # one stage more than adopted
    timings = [(0.01, 0.0, 0.0)] * len(ranks)
    with pytest.raises(IndexError):  # what the old plan's step did to the new plan's figures
        checked_compute(adopted.plan, [s for _, s in ranks], timings, 4, lambda a, b: None)
    pacing, unread = StepPacing(), None  # a step of another plan reads neither costs nor config
    assert not pacing.witnessed(adopted, "the-old-plan", ranks, timings, members={},
                                costs=unread, peer_id="peer0", config=unread,
                                measured=unread)  # fmt: skip
    assert not pacing.measured(adopted, "the-old-plan", 0.01, 0.02, costs=unread,
                               peer_id="peer0", device=unread, config=unread)  # fmt: skip
    assert pacing.witness.current() == ()
    assert pacing.meter.published == 1.0
