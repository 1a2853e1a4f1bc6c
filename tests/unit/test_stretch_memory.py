"""A node keeps its confirmed slowdown beside its key and starts from it (stretch_memory.py)."""

import dataclasses
import json

import pytest

from fusionllm.common.run_spec import RunSpec
from fusionllm.node.control.pacing import StepPacing
from fusionllm.node.control.stretch_memory import (
    MAX_ENTRIES,
    MAX_FILE_BYTES,
    StretchMemory,
    memory_path,
    parse_memory,
    work_key,
)
from tests.unit.test_epochs import GRAPH, SETTINGS
from tests.unit.test_records import device as a_device
from tests.unit.test_stretch import _adopted, predicted_compute_s, predicted_own_s, serving_peers

KEY = "a" * 32


def _memory(tmp_path, key=KEY) -> StretchMemory:
    return StretchMemory(memory_path(tmp_path / "node.key"), key)


def test_a_kept_slowdown_is_recalled_by_the_next_start(tmp_path):
    _memory(tmp_path).keep(1.68)
    assert (tmp_path / "node.key.stretch.json").exists()
    assert _memory(tmp_path).recall() == pytest.approx(1.68)
    assert _memory(tmp_path, "b" * 32).recall() == 0.0  # another work or device


def test_the_key_names_the_work_and_the_device():
    run, device_info = RunSpec(), a_device()
    base = work_key(run, device_info)
    assert work_key(RunSpec(), device_info) == base
    assert work_key(dataclasses.replace(run, micro_batches=8), device_info) != base
    assert work_key(dataclasses.replace(run, seq_len=128), device_info) != base
    assert work_key(run, dataclasses.replace(device_info, flops=device_info.flops * 2)) != base


@pytest.mark.parametrize(
    "raw",
    [b"\xff\xfe", b"[]", b'{"v": 2, "entries": {}}', b'{"v": 1, "entries": []}',
     b'{"v": 1, "entries": {"short": [1.5, 0]}}',
     json.dumps({"v": 1, "entries": {KEY: [float("nan"), 0]}}).encode(),
     json.dumps({"v": 1, "entries": {KEY: [0.5, 0]}}).encode(),
     json.dumps({"v": 1, "entries": {KEY: [1e9, 0]}}).encode(),
     json.dumps({"v": 1, "entries": {KEY: ["2", 0]}}).encode(),
     json.dumps({"v": 1, "entries": {KEY: [True, 0]}}).encode(),
     b" " * (MAX_FILE_BYTES + 1)],
    ids=["not-utf8", "a-list", "version-2", "entries-a-list", "short-key", "nan", "below-one",
         "huge", "a-string", "a-bool", "too-big"],
)  # fmt: skip
def test_a_bad_file_is_ignored_and_replaced_by_the_next_figure(tmp_path, raw):
    path = memory_path(tmp_path / "node.key")
    path.write_bytes(raw)
    memory = _memory(tmp_path)
    assert memory.recall() == 0.0
    memory.keep(2.0)
    assert parse_memory(path.read_bytes())[KEY][0] == 2.0


def test_the_oldest_entries_go_first(tmp_path):
    for k in range(MAX_ENTRIES + 3):
        _memory(tmp_path, f"{k:032d}").keep(1.19)
    entries = parse_memory(memory_path(tmp_path / "node.key").read_bytes())
    assert len(entries) == MAX_ENTRIES
    assert f"{0:032d}" not in entries
    assert f"{MAX_ENTRIES + 2:032d}" in entries


def test_a_figure_out_of_range_is_not_kept(tmp_path):
    memory = _memory(tmp_path)
    for bad in (0.5, float("inf"), float("nan"), 1e6):
        memory.keep(bad)
    assert not memory_path(tmp_path / "node.key").exists()


def test_a_restarted_node_plans_from_what_it_confirmed_and_keeps_pace_times_stretch(tmp_path):
    adopted, device = _adopted()
    config, peer = SETTINGS.plan_config(), sorted(serving_peers(adopted.plan))[0]
    compute = predicted_compute_s(GRAPH, adopted.plan, peer, device, config)
    model = predicted_own_s(adopted.plan, peer, device, config, compute_s=compute, pace=1.0)
    first = StepPacing()
    assert first.remember(_memory(tmp_path)) == 0.0  # a first start: nothing kept
    for _ in range(64):  # compute 2.5x its device (pace 2), all its own work 3.4x
        first.measured(adopted, adopted.digest, 2.5 * compute, 3.4 * model, costs=GRAPH,
                       peer_id=peer, device=device, config=config)  # fmt: skip
    assert first.meter.published == 2.0
    kept = first.meter.published * first.stretch.confirmed
    assert kept == pytest.approx(2**1.75)
    again = StepPacing()
    assert again.remember(_memory(tmp_path)) == pytest.approx(kept)
    assert (again.meter.published, again.stretch.published) == (1.0, pytest.approx(kept))
