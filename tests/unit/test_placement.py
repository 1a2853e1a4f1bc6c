"""Which cores a daemon computes on for a plan: its rank in the plan picks them."""

from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.training.assignment import Assignment
from fusionllm.node.training.placement import CorePlacement


def _assignment(role: Role | None) -> Assignment:
    peers = {Role(0, 0): "a", Role(1, 0): "b", Role(1, 1): "c", Role(2, 0): "d"}
    # The placement reads only the roles: no run config is needed for it.
    return Assignment(digest="d" * 64, config=None, peers=peers, role=role, ranges=())


def test_the_kth_process_of_the_plan_takes_the_kth_core():
    placement = CorePlacement(enabled=True, home=[4, 5, 6, 7])
    cores = [placement.cores_for(_assignment(role), 1) for role in _assignment(None).peers]
    assert cores == [(4,), (5,), (6,), (7,)]


def test_replicas_count_after_their_stage_and_blocks_wrap_on_a_small_machine():
    placement = CorePlacement(enabled=True, home=[0, 1])
    assert placement.cores_for(_assignment(Role(1, 1)), 1) == (0,)  # rank 2 of 4 on 2 cores
    assert placement.cores_for(_assignment(Role(2, 0)), 1) == (1,)
    assert placement.cores_for(_assignment(Role(1, 0)), 2) == (0, 1)


def test_a_node_outside_the_plan_is_not_placed():
    assert CorePlacement(enabled=True, home=[0, 1]).cores_for(_assignment(None), 1) is None


def test_disabled_placement_pins_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr("fusionllm.node.training.placement.pin", calls.append)
    with CorePlacement(enabled=False, home=[0, 1]).serving(_assignment(Role(0, 0)), 1):
        pass
    assert calls == []


def test_serving_pins_for_the_plan_and_returns_home_after_it_even_on_error(monkeypatch):
    calls = []
    monkeypatch.setattr(
        "fusionllm.node.training.placement.pin", lambda cores: calls.append(tuple(cores)) or True
    )
    placement = CorePlacement(enabled=True, home=[0, 1])
    try:
        with placement.serving(_assignment(Role(1, 0)), 1):
            assert calls == [(1,)]
            raise RuntimeError("the plan failed")
    except RuntimeError:
        pass
    assert calls == [(1,), (0, 1)]
