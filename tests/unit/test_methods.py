"""dag/methods.py: the planning method a swarm runs, deterministic on every node."""

import dataclasses

import numpy as np
import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.dag.methods import PLANNERS, InfeasiblePlanError, plan_for
from fusionllm.dag.plan_records import PlanConfig
from fusionllm.dag.swarm import Swarm
from fusionllm.dag.synthetic import generate_swarm, gpt2_costs

GRAPH = gpt2_costs("small")
CONFIG = PlanConfig(micro_batches=4, batch_size=32)


def _sites() -> Swarm:
    # Two sites: fast inside, slow between; OP-Fence compresses the cut between them.
    return generate_swarm("sites", 4, np.random.default_rng(2), sites=2)


def _shuffled(swarm: Swarm, seed: int) -> Swarm:
    """The same swarm with its peers listed in another order (another node's snapshot)."""
    order = np.random.default_rng(seed).permutation(swarm.n)
    peers = [swarm.peers[i] for i in order]
    where = {old: new for new, old in enumerate(order)}
    src = np.array([where[i] for i in swarm.src], dtype=np.int64)
    dst = np.array([where[i] for i in swarm.dst], dtype=np.int64)
    return Swarm.from_arrays(peers, src, dst, swarm.bandwidth, swarm.rtt)


def test_unknown_planner_is_refused():
    with pytest.raises(ConfigError, match="planner must be one of"):
        PlanConfig(planner="fastest")


@pytest.mark.parametrize("planner", sorted(PLANNERS))
def test_each_method_labels_its_plan_and_ignores_peer_listing_order(planner):
    config = dataclasses.replace(CONFIG, planner=planner)
    swarm = _sites()
    first = plan_for(GRAPH, swarm, config)
    assert first.method == PLANNERS[planner]
    again = plan_for(GRAPH, _shuffled(swarm, 7), config)
    assert again.digest() == first.digest()


@pytest.mark.parametrize("planner", ["naive", "balanced"])
def test_baselines_send_dense_even_when_compression_is_on(planner):
    config = dataclasses.replace(CONFIG, planner=planner, compression=True)
    result = plan_for(GRAPH, _sites(), config)
    assert len(result.stages) == 4
    codecs = {(link.forward_codec, link.backward_codec) for link in result.links}
    assert codecs == {("dense", "dense")}


def test_naive_deals_peers_in_id_order_and_splits_layers_evenly():
    result = plan_for(GRAPH, _sites(), dataclasses.replace(CONFIG, planner="naive"))
    peers = [p for stage in result.stages for p in stage.peers]
    assert peers == sorted(peers)
    sizes = [stage.stop - stage.start for stage in result.stages]
    assert max(sizes) - min(sizes) <= max(sizes) // 4  # even in layers, give or take a layer


def test_opfence_dense_is_opfence_without_adatopk():
    # Home uplinks and two stages at least: the cut between them is a slow link.
    swarm = generate_swarm("home", 4, np.random.default_rng(1))
    ada = plan_for(GRAPH, swarm, dataclasses.replace(CONFIG, min_stages=2))
    dense = plan_for(GRAPH, swarm, dataclasses.replace(CONFIG, min_stages=2, compression=False))
    assert dense.method == ada.method == "op-fence"
    assert any(link.forward_codec == "topk" for link in ada.links)  # AdaTopK shrinks it
    assert all(
        (link.forward_codec, link.backward_codec) == ("dense", "dense") for link in dense.links
    )
    assert dense.estimated_step_time >= ada.estimated_step_time


def test_naive_respects_max_stages():
    config = dataclasses.replace(CONFIG, planner="naive", max_stages=2)
    assert len(plan_for(GRAPH, _sites(), config).stages) == 2


@pytest.mark.parametrize("planner", sorted(PLANNERS))
def test_no_plan_for_fewer_peers_than_min_peers(planner):
    swarm = _sites()  # 4 peers
    waiting = dataclasses.replace(CONFIG, planner=planner, min_peers=5)
    with pytest.raises(InfeasiblePlanError, match="4 peers, the swarm waits for 5"):
        plan_for(GRAPH, swarm, waiting)
    enough = dataclasses.replace(waiting, min_peers=4)
    alone = dataclasses.replace(waiting, min_peers=1)
    assert plan_for(GRAPH, swarm, enough).digest() == plan_for(GRAPH, swarm, alone).digest()
