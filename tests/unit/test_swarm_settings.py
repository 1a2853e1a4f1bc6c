"""node/swarm_settings.py: the settings a swarm shares, their validation and their digest."""

import dataclasses
import math

import numpy as np
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
        {"planner": "opfence-fast"},
        {"planner": ""},
        {"min_peers": 0},
        {"min_peers": 2.0},
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
    "planner": "naive",
    "min_peers": 3,
    "max_stages": 4,
    "max_replicas": 2,
    "heartbeat_s": 4.0,
    "ttl_s": 20.0,
    "epoch_s": 30.0,
    "settle_fraction": 0.6,
    "switch_margin": 0.2,
    "quiet_max_stride": 4,
    "key_digest": "0123456789abcdef",  # a private swarm's (common/swarm_key.py)
    "task": "serve",  # serving nodes never plan with trainers
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


def test_nodes_on_different_data_are_never_members_together(tmp_path):
    """The corpus's digest is part of the settings digest: two nodes whose data differs (here
    two token files one token apart; the stdlib of two Pythons alike) publish different
    digests, and a node counts as members only records with its own."""
    from fusionllm.data.corpus import load_corpus, load_stdlib
    from fusionllm.dht.records import DeviceInfo, NodeInfo, NodeState
    from fusionllm.node.control.agreement import fresh_members

    now = 1.7e9
    device = DeviceInfo(name="cpu", kind="cpu", memory_bytes=1 << 30, flops=1e11,
                        memory_bandwidth=1e10, op_overhead=0.0, cpu_cores=2,
                        ram_bytes=1 << 30)  # fmt: skip

    def member(peer: str, digest: str) -> NodeInfo:
        return NodeInfo(peer_id=peer, swarm="default", addrs=(), dht_addrs=(), device=device,
                        uplink=1e9, downlink=1e9, links=(), software="fusionllm 0.1.0",
                        config_digest=digest, state=NodeState.BACKUP, stage=None, adopted=None,
                        time=now)  # fmt: skip

    ids = np.arange(4000, dtype=np.uint16) % 300
    (tmp_path / "a.bin").write_bytes(ids.tobytes())
    ids[1234] += 1
    (tmp_path / "b.bin").write_bytes(ids.tobytes())
    corpora = [load_corpus(tmp_path / n, vocab_size=300) for n in ("a.bin", "b.bin")]
    corpora.append(load_stdlib(max_bytes=1 << 16))
    corpora.append(load_stdlib(max_bytes=1 << 16))
    settings = [
        SwarmSettings(run=RunSpec(data_digest=c.digest, vocab_size=c.vocab_size)) for c in corpora
    ]
    digests = [s.digest() for s in settings]
    assert digests[0] != digests[1]
    assert digests[2] == digests[3]
    assert len({digests[0], digests[1], digests[2]}) == 3
    assert settings[0].run.lineage() != settings[1].run.lineage()  # checkpoints never mix
    records = {peer: member(peer, digest) for peer, digest in zip("abcd", digests, strict=True)}
    for peer, digest in zip("abcd", digests, strict=True):
        fresh = fresh_members(records, digest=digest, now=now, suspect_after_s=15.0, max_skew_s=5.0)
        assert sorted(fresh) == (["c", "d"] if peer in "cd" else [peer])


def test_data_digest_and_vocab_are_validated():
    with pytest.raises(ConfigError, match="data_digest"):
        RunSpec(data_digest="abc")
    with pytest.raises(ConfigError, match="vocab_size"):
        RunSpec(vocab_size=0)
    assert RunSpec(data_digest="0" * 64).data_digest == "0" * 64


@pytest.mark.parametrize(
    ("planner", "compress", "compression"),
    [("opfence", True, True), ("opfence", False, False), ("naive", True, True)],
)
def test_planner_and_dense_reach_the_plan_config(planner, compress, compression):
    config = SwarmSettings(planner=planner, compress=compress).plan_config()
    assert (config.planner, config.compression) == (planner, compression)
