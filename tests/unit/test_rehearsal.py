"""A rehearsal of the run's first stage before any plan (rehearsal.py): what it times, how it is
read against the device's model (stretch.rehearsed_stretch), and the provisional stretch it
starts a node from."""

import dataclasses
import math

import pytest
import torch

from fusionllm.common.errors import ConfigError
from fusionllm.common.run_spec import RunSpec
from fusionllm.dag import trace
from fusionllm.dag.models import registry
from fusionllm.node.control.local_facts import RehearsalAsk, learn_local_facts
from fusionllm.node.control.pace import nodes_compute_s
from fusionllm.node.control.pacing import StepPacing
from fusionllm.node.control.rehearsal import RehearsalConfig, rehearse
from fusionllm.node.control.stretch import Rehearsal, StretchMeter, rehearsed_stretch
from fusionllm.node.pipeline.compute import Compute
from tests.support.identities import cpu_device
from tests.unit.test_epochs import GRAPH, SETTINGS
from tests.unit.test_pace import _meter_after

CONFIG = SETTINGS.plan_config()
PER_MICRO_BATCH = int(CONFIG.batch_size / CONFIG.micro_batches)
FIVE = {"stop": 3, "batch": 2, "micro_batches": 4, "steps": 5, "step_s": 0.1}


def _rehearsal(stop: int, step_s: float) -> Rehearsal:
    return Rehearsal(stop=stop, batch=PER_MICRO_BATCH, micro_batches=CONFIG.micro_batches,
                     steps=5, step_s=step_s)  # fmt: skip


@pytest.mark.parametrize(("times", "stretch"), [(1.45, 2**0.5), (1.1, 2**0.25), (0.7, 1.0),
                                                (2.1, 2.0), (1e9, 64.0)])  # fmt: skip
def test_a_rehearsal_reads_as_the_nearest_quarter_power_of_its_ratio_to_the_model(times, stretch):
    device = cpu_device()
    for stop in (len(GRAPH.nodes), len(GRAPH.nodes) // 2):  # its own nodes, not the model's
        modelled = nodes_compute_s(GRAPH, 0, stop, device, CONFIG)
        assert modelled > 0
        got = rehearsed_stretch(_rehearsal(stop, modelled * times), GRAPH, device, CONFIG)
        assert got == pytest.approx(stretch)
    half = nodes_compute_s(GRAPH, 0, len(GRAPH.nodes) // 2, device, CONFIG)
    assert half < nodes_compute_s(GRAPH, 0, len(GRAPH.nodes), device, CONFIG)


def test_a_rehearsal_of_another_shape_or_model_is_refused():
    device, step = cpu_device(), 0.1
    other = dataclasses.replace(_rehearsal(3, step), batch=PER_MICRO_BATCH + 1)
    with pytest.raises(ConfigError, match="not the run's"):
        rehearsed_stretch(other, GRAPH, device, CONFIG)
    other = dataclasses.replace(_rehearsal(3, step), micro_batches=CONFIG.micro_batches + 1)
    with pytest.raises(ConfigError, match="not the run's"):
        rehearsed_stretch(other, GRAPH, device, CONFIG)
    with pytest.raises(ConfigError, match="the model has"):
        rehearsed_stretch(_rehearsal(len(GRAPH.nodes) + 1, step), GRAPH, device, CONFIG)


@pytest.mark.parametrize(
    "fields",
    [{"stop": 0}, {"stop": True}, {"stop": 2.0}, {"steps": -1}, {"batch": 1 << 21},
     {"step_s": 0.0}, {"step_s": -1.0}, {"step_s": math.nan}, {"step_s": math.inf},
     {"step_s": 1}, {"step_s": "0.1"}],
)  # fmt: skip
def test_a_bad_rehearsal_is_refused(fields):
    assert Rehearsal.from_json(FIVE).to_json() == FIVE
    with pytest.raises(ConfigError):
        Rehearsal.from_json({**FIVE, **fields})


@pytest.mark.parametrize("data", [[], None, {"stop": 3}, {**FIVE, "more": 1}])
def test_a_rehearsal_is_exactly_its_five_fields(data):
    with pytest.raises(ConfigError, match="five fields"):
        Rehearsal.from_json(data)


def test_a_rehearsed_figure_is_published_until_two_windows_of_steps_replace_it():
    meter = StretchMeter(window=4, skip=0)
    meter.start_from(2**0.5)
    assert meter.published == pytest.approx(2**0.5)
    assert _meter_after([1.7] * 3, meter).published == pytest.approx(2**0.5)  # not a window
    # The first window publishes its own, though 1.7 is inside the band around 1.41.
    assert _meter_after([1.7], meter).published == pytest.approx(2**0.75)
    # The next confirms, whatever the band: it is of steps after the first figure.
    assert _meter_after([2.3] * 4, meter).published == pytest.approx(2**1.25)
    assert _meter_after([1.6] * 4, meter).published == pytest.approx(2**1.25)  # now it holds
    with pytest.raises(ConfigError, match="rehearsed stretch"):
        meter.start_from(0.5)


def test_a_new_pace_keeps_the_rehearsed_product():
    meter = StretchMeter(window=4, skip=0)
    meter.start_from(2.0)
    meter.repaced(1.0, 2.0)
    assert meter.published == pytest.approx(1.0)
    assert _meter_after([1.5] * 4, meter).published == pytest.approx(2**0.5)  # not held


def test_the_node_starts_from_a_rehearsal_or_from_nothing():
    device = cpu_device()
    modelled = nodes_compute_s(GRAPH, 0, len(GRAPH.nodes), device, CONFIG)
    pacing = StepPacing()
    assert pacing.rehearsed(None, GRAPH, device, CONFIG) is None
    assert pacing.stretch.published == 0.0  # unmeasured: not counted in the swarm's slowdown
    other = dataclasses.replace(_rehearsal(len(GRAPH.nodes), modelled), batch=PER_MICRO_BATCH + 1)
    assert pacing.rehearsed(other, GRAPH, device, CONFIG) is None  # logged, not fatal
    assert pacing.stretch.published == 0.0
    good = _rehearsal(len(GRAPH.nodes), 1.5 * modelled)
    assert pacing.rehearsed(good, GRAPH, device, CONFIG) == pytest.approx(2**0.5)
    assert pacing.stretch.published == pytest.approx(2**0.5)


def test_only_a_node_that_trains_asks_for_a_rehearsal():
    run = RunSpec(micro_batch_size=3, micro_batches=5)
    ask = RehearsalAsk.for_node(False, 1.5, 2, run)
    assert ask == RehearsalAsk(seconds=1.5, batch=3, micro_batches=5, threads=2)
    assert RehearsalAsk.for_node(True, 1.5, 2, run) is None
    assert RehearsalAsk.for_node(False, 0.0, 2, run) is None


def _tiny(vocab_size: int = 256):
    return registry.preset_config("tiny", vocab_size=vocab_size)


def test_a_rehearsal_trains_the_whole_small_model_at_the_runs_shape():
    costs = trace(registry.build(_tiny()), (registry.example_input(1, 16),)).costs()
    config = RehearsalConfig(seconds=0.05, batch=2, seq_len=16, micro_batches=3)
    done = rehearse(_tiny(), config, Compute())
    assert (done.stop, done.batch, done.micro_batches) == (len(costs.nodes), 2, 3)
    assert done.steps >= 1
    assert done.steps * done.step_s >= 0.05


def test_a_model_over_the_stage_bytes_rehearses_its_first_stage_only():
    wide = _tiny(vocab_size=8192)  # its embedding alone is 2 MiB in float32
    parameter_bytes = 4 * sum(p.numel() for p in registry.build(wide).parameters())
    nodes = len(trace(registry.build(wide), (registry.example_input(1, 16),)).node_ids)
    config = RehearsalConfig(seconds=0.02, batch=2, seq_len=16, micro_batches=2,
                             max_stage_bytes=parameter_bytes)  # fmt: skip
    assert rehearse(wide, config, Compute()).stop == nodes
    first = rehearse(wide, dataclasses.replace(config, max_stage_bytes=1 << 20), Compute())
    assert 0 < first.stop < nodes


def test_the_facts_child_rehearses_on_request(tmp_path):
    ask = RehearsalAsk(seconds=0.1, batch=2, micro_batches=2, threads=1)
    facts = learn_local_facts("tiny", 16, device_cache=tmp_path / "d.json",
                              measure_device=False, rehearse=ask)  # fmt: skip
    assert facts.device is None
    assert facts.rehearsal is not None
    assert facts.rehearsal.stop == len(facts.costs.nodes)
    assert (facts.rehearsal.batch, facts.rehearsal.micro_batches) == (2, 2)
    assert facts.rehearsal.step_s > 0
    again = learn_local_facts("tiny", 16, device_cache=tmp_path / "d.json", measure_device=False)
    assert again.rehearsal is None  # cached costs, nothing asked: no child


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_rehearsal_the_child_cannot_run_leaves_the_node_its_facts(tmp_path):
    ask = RehearsalAsk(seconds=0.1, batch=2, micro_batches=2, threads=1)
    facts = learn_local_facts("tiny", 16, device_cache=tmp_path / "d.json", device="cuda",
                              measure_device=False, rehearse=ask)  # fmt: skip
    assert facts.rehearsal is None  # no CUDA here: the child says so in its log
    assert len(facts.costs.nodes) > 10
