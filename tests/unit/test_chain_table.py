"""The cut search's stage-cost table (dag/chain_cuts.py) and the planner's memo of chains
(dag/planner.py) are speed-ups only: the figures and the plans are those of the direct
computation, exactly."""

import numpy as np
import pytest

import fusionllm.dag.chain_cuts as chain_cuts
from fusionllm.dag.chain_cuts import _Chain, _make_unit, _Model
from fusionllm.dag.fences import group_links
from fusionllm.dag.planner import PlanConfig, plan
from fusionllm.dag.synthetic import generate_swarm, gpt2_costs

GRAPH = gpt2_costs("small", batch=2, seq=64)


@pytest.mark.parametrize("seed", range(3))
def test_every_looked_up_stage_cost_equals_the_direct_computation(seed):
    swarm = generate_swarm("home", 6, np.random.default_rng(seed))
    config = PlanConfig(batch_size=32, micro_batches=4, min_stages=2)
    model = _Model(GRAPH, swarm, config)
    groups = [np.array([0, 1]), np.array([2]), np.array([3, 4, 5])]
    units = [_make_unit(model, g, f) for f, g in enumerate(groups)]
    chain = _Chain(model, units, group_links(swarm, groups))
    a, b = np.triu_indices(model.n + 1, 1)
    for k in range(len(units)):
        looked_up = chain.stage_full(k, a, b)
        direct = chain._stage_costs(k, a, b)
        for mine, theirs in zip(looked_up, direct, strict=True):
            assert np.array_equal(mine, theirs)
        one = chain.stage_full(k, np.array([3]), np.array([40]))  # any pair, any order asked
        assert [x[0] for x in one] == [x[0] for x in chain._stage_costs(k, *one_pair(3, 40))]


def one_pair(a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    return np.array([a]), np.array([b])


@pytest.mark.parametrize(("topology", "n"), [("home", 5), ("sites", 8), ("flat", 3)])
def test_plans_with_the_table_and_memo_are_those_without_the_table(monkeypatch, topology, n):
    config = PlanConfig(batch_size=32, micro_batches=4, min_stages=2)
    swarms = [generate_swarm(topology, n, np.random.default_rng(seed)) for seed in range(3)]
    fast = [plan(GRAPH, swarm, config) for swarm in swarms]
    monkeypatch.setattr(chain_cuts, "_TABLE_MAX_PAIRS", 0)
    direct = [plan(GRAPH, swarm, config) for swarm in swarms]
    assert [p.digest() for p in fast] == [p.digest() for p in direct]
    assert [p.estimated_step_time for p in fast] == [p.estimated_step_time for p in direct]
