"""The device probe: plausible numbers, cached per device, robust to a damaged cache."""

import json
import math
from dataclasses import replace

import psutil
import pytest
import torch

from fusionllm.common.errors import ConfigError
from fusionllm.node.control.probe import ProbeConfig, cached_measurement, measure_device

TINY = ProbeConfig(matmul_size=64, elementwise_bytes=1 << 16, repeats=1, overhead_ops=3)


def test_measurement_is_consistent():
    # Speeds on a shared machine vary by orders of magnitude under load, so only what must
    # hold whatever the load is checked: positive, finite rates and the machine's memory.
    measurement = measure_device("cpu", TINY)
    for rate in (measurement.flops, measurement.memory_bandwidth, measurement.op_overhead):
        assert 0 < rate < math.inf
    assert measurement.memory_bytes == psutil.virtual_memory().total
    assert measurement.device_name.endswith("cpu")
    # The dense frame's figure is measured, never left at 0 (how: test_frame_beside.py).
    assert 0 < measurement.frame_overhead < math.inf
    assert 0 <= measurement.topk_frame_overhead < math.inf


def test_cache_is_reused_and_survives_damage(tmp_path):
    cache = tmp_path / "probe.json"
    first = cached_measurement("cpu", cache, TINY)
    stored = json.loads(cache.read_text())
    assert len(stored) == 1
    # A second call must come from the cache: make the cached value recognisable.
    key = next(iter(stored))
    stored[key]["flops"] = 12345.0
    cache.write_text(json.dumps(stored))
    assert cached_measurement("cpu", cache, TINY).flops == 12345.0
    cache.write_text("{not json")
    again = cached_measurement("cpu", cache, TINY)
    assert again.device_name == first.device_name
    assert json.loads(cache.read_text())[key]["flops"] == again.flops


def test_config_is_validated():
    with pytest.raises(ConfigError, match="matmul_size"):
        ProbeConfig(matmul_size=3)


def test_cache_write_does_not_depend_on_a_fixed_temp_name(tmp_path):
    cache = tmp_path / "probe.json"
    cache.with_suffix(".tmp").mkdir()  # what a fixed temp name would collide with
    first = cached_measurement("cpu", cache, TINY)
    assert json.loads(cache.read_text())  # written despite the squatter
    assert cached_measurement("cpu", cache, TINY) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["probe.json", "probe.tmp"]


def test_each_precision_is_measured_and_cached_apart(tmp_path):
    """A bf16 run's node advertises what bf16 matmuls do here, not fp32's."""
    cache = tmp_path / "probe.json"
    fp32 = cached_measurement("cpu", cache, TINY)
    bf16 = cached_measurement("cpu", cache, replace(TINY, dtype=torch.bfloat16))
    keys = sorted(json.loads(cache.read_text()))
    assert len(keys) == 2
    assert [("bfloat16" in k, "float32" in k) for k in keys] == [(True, False), (False, True)]
    assert bf16.flops > 0
    assert fp32.flops > 0


def test_the_fastest_repeat_counts_so_a_loaded_machine_does_not_read_slow():
    """Repeats interrupted by other work (a throttled quota period) only ever take longer: the
    figure is the undisturbed one, where a median of five took the load's."""
    from fusionllm.node.control.probe import undisturbed_seconds

    assert undisturbed_seconds([0.010, 0.031, 0.029, 0.011, 0.040]) == 0.010
    assert undisturbed_seconds([0.02]) == 0.02
    for bad in ([], [0.01, 0.0], [0.01, -1.0]):
        with pytest.raises(ValueError, match="positive repeat times"):
            undisturbed_seconds(bad)
