"""PlanConfig.max_replicas: the data-parallel width per stage; the rest wait in backup."""

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.dag.cost import DeviceProfile
from fusionllm.dag.planner import Plan, PlanConfig, plan
from fusionllm.dag.swarm import Peer, Swarm
from fusionllm.dag.synthetic import gpt2_costs

DEVICE = DeviceProfile(name="gpu", flops=1e12, memory_bandwidth=1e11, memory_bytes=8 << 30)
IDS = tuple(f"peer{i}" for i in range(8))


def eight_peer_plan(**config) -> Plan:
    peers = [Peer(peer_id=pid, device=DEVICE, uplink=1e9, downlink=1e9) for pid in IDS]
    settings = {"micro_batches": 4, "batch_size": 8, **config}
    return plan(
        gpt2_costs("small", batch=1, seq=128), Swarm.from_links(peers), PlanConfig(**settings)
    )


def assert_partition(p: Plan) -> None:
    """Every peer is either in exactly one stage or in backup."""
    used = [peer for stage in p.stages for peer in stage.peers]
    assert len(used) == len(set(used))
    assert set(used).isdisjoint(p.backup)
    assert sorted(used + list(p.backup)) == sorted(IDS)


@pytest.mark.parametrize("max_stages", [2, 4, 8])
def test_one_replica_per_stage(max_stages):
    p = eight_peer_plan(max_replicas=1, max_stages=max_stages)
    assert all(len(stage.peers) == 1 for stage in p.stages)
    assert all(stage.shares == (1.0,) for stage in p.stages)
    assert len(p.stages) <= max_stages
    assert len(p.backup) == len(IDS) - len(p.stages)
    assert_partition(p)


def test_two_replicas_at_most():
    # With two stages allowed, the uncapped plan spreads the 8 peers wider than two per stage.
    wide = eight_peer_plan(max_stages=2)
    assert max(len(stage.peers) for stage in wide.stages) > 2
    assert_partition(wide)
    p = eight_peer_plan(max_stages=2, max_replicas=2)
    assert all(1 <= len(stage.peers) <= 2 for stage in p.stages)
    assert len(p.backup) >= len(IDS) - 2 * len(p.stages)
    assert_partition(p)


def test_cap_above_swarm_changes_nothing():
    assert (
        eight_peer_plan(max_stages=2, max_replicas=8).digest()
        == eight_peer_plan(max_stages=2).digest()
    )


@pytest.mark.parametrize("value", [0, -1])
def test_max_replicas_must_be_positive(value):
    with pytest.raises(ConfigError, match="max_replicas"):
        PlanConfig(max_replicas=value)


def test_default_max_replicas():
    assert PlanConfig().max_replicas == 64
