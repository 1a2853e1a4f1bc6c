"""node/swarm_settings.py: the settings a swarm shares, their validation and their digest."""

import dataclasses
import math

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.common.run_spec import RunSpec
from fusionllm.dag.planner import PlanConfig
from fusionllm.node.control.swarm_settings import MODELS, SwarmSettings


def test_defaults_are_valid():
    settings = SwarmSettings()
    assert settings.heartbeat_s <= settings.ttl_s / 2
    assert settings.run.model in MODELS


@pytest.mark.parametrize(
    "changes",
    [
        {"swarm": ""},
        {"swarm": "bad name"},
        {"swarm": "-lead"},
        {"max_stages": 0},
        {"max_replicas": 0},
        {"max_replicas": -3},
        {"min_stages": 0},
        {"min_stages": 3, "max_stages": 2},
        {"run": {"model": "tiny"}},
        {"compress": 1},
        {"heartbeat_s": 0.0},
        {"heartbeat_s": -1.0},
        {"heartbeat_s": 7.6, "ttl_s": 15.0},
        {"heartbeat_s": 5.0, "ttl_s": 9.0},
        {"heartbeat_s": math.nan},
        {"ttl_s": math.nan},
        {"epoch_s": 0.49},
        {"epoch_s": 0.0},
        {"epoch_s": math.nan},
        {"settle_fraction": 0.05},
        {"settle_fraction": 0.95},
        {"settle_fraction": math.nan},
        {"switch_margin": -0.1},
        {"switch_margin": 1.0},
        {"switch_margin": math.nan},
        {"quiet_max_stride": 0},
        {"quiet_max_stride": 3},  # not a power of two: quiet nodes would act in other epochs
        {"quiet_max_stride": 128},
        {"quiet_max_stride": 2.0},
        {"quiet_max_stride": True},
    ],
)
def test_invalid_settings(changes):
    with pytest.raises(ConfigError):
        SwarmSettings(**changes)


@pytest.mark.parametrize(
    "changes",
    [
        {"heartbeat_s": 7.5, "ttl_s": 15.0},  # exactly ttl / 2
        {"epoch_s": 0.5},
        {"settle_fraction": 0.1},
        {"settle_fraction": 0.9},
        {"switch_margin": 0.0},
        {"min_stages": 2, "max_stages": 2},
        {"max_replicas": 1, "max_stages": 1},
        {"swarm": "a" * 64},
        {"quiet_max_stride": 1},
        {"quiet_max_stride": 64},
    ],
)
def test_boundary_settings_are_valid(changes):
    settings = SwarmSettings(**changes)
    for name, value in changes.items():
        assert getattr(settings, name) == value


def test_settings_are_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        SwarmSettings("demo")  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        SwarmSettings().run = RunSpec(model="small")  # type: ignore[misc]


def test_digest_is_stable():
    assert SwarmSettings().digest() == SwarmSettings().digest()
    digest = SwarmSettings(swarm="demo", run=RunSpec(model="small")).digest()
    assert digest == SwarmSettings(run=RunSpec(model="small"), swarm="demo").digest()
    assert len(digest) == 16
    assert all(c in "0123456789abcdef" for c in digest)


_OTHER_VALUES = {
    "checkpoint_every": 7,
    "swarm": "other",
    "run": RunSpec(seq_len=128),
    "min_stages": 2,
    "compress": False,
    "max_stages": 4,
    "max_replicas": 2,
    "heartbeat_s": 4.0,
    "ttl_s": 20.0,
    "epoch_s": 30.0,
    "settle_fraction": 0.6,
    "switch_margin": 0.2,
    "quiet_max_stride": 4,
}


def test_every_field_is_covered():
    assert set(_OTHER_VALUES) == {f.name for f in dataclasses.fields(SwarmSettings)}


@pytest.mark.parametrize(("name", "value"), sorted(_OTHER_VALUES.items()))
def test_digest_changes_with_every_field(name, value):
    base = SwarmSettings()
    changed = dataclasses.replace(base, **{name: value})
    assert getattr(changed, name) != getattr(base, name)
    assert changed.digest() != base.digest()


def test_digests_of_all_single_changes_are_distinct():
    base = SwarmSettings()
    digests = {dataclasses.replace(base, **{k: v}).digest() for k, v in _OTHER_VALUES.items()}
    assert len(digests) == len(_OTHER_VALUES)
    assert base.digest() not in digests


def test_plan_config_mapping():
    run = RunSpec(micro_batch_size=8, micro_batches=2)
    settings = SwarmSettings(run=run, max_stages=3, max_replicas=5)
    config = settings.plan_config()
    assert isinstance(config, PlanConfig)
    assert config.micro_batches == 2
    assert config.batch_size == 16
    assert config.graph_batch_size == 1
    assert config.max_stages == 3
    assert config.max_replicas == 2  # whole micro-batches per replica: at most 2 replicas
    assert config.scale == 16 / 2
    # Everything else is PlanConfig's default.
    defaults = PlanConfig(micro_batches=2, batch_size=16, max_stages=3, max_replicas=2)
    assert config == defaults


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"model": "gigantic"}, "model must be one of"),
        ({"model": ""}, "model must be one of"),
        ({"seq_len": 0}, "seq_len must be"),
        ({"micro_batch_size": 0}, "micro_batch_size must be"),
        ({"micro_batches": 0}, "micro_batches must be"),
        ({"micro_batches": 2.5}, "micro_batches must be"),
        ({"steps": -1}, "steps must be"),
        ({"seed": -1}, "seed must be"),
        ({"lr": 0.0}, "need lr > 0"),
        ({"lr": math.nan}, "finite"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"betas": (0.9,)}, "betas"),
        ({"gradient_codec": "gzip"}, "gradient_codec"),
    ],
)
def test_invalid_run_spec(changes, match):
    with pytest.raises(ConfigError, match=match):
        RunSpec(**changes)


def test_run_spec_batch_arithmetic():
    run = RunSpec(micro_batch_size=3, micro_batches=5, seq_len=7, steps=0)
    assert run.global_batch == 15
    assert run.tokens_per_step == 105
    assert run.runs_forever()
