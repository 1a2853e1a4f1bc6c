"""Which step a new plan starts from, and who keeps a stage's state (``holdings.py``).

``choose_start`` is fed a fake ``params_of``: a table from node ranges to parameter names,
which stands in for the model's graph (a pure input of the rule). Custodians are computed over
plain ``Role -> peer`` tables.
"""

import itertools

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.pipeline.loss_scale import ScaleState
from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.training.holdings import (
    SEED_STEP,
    Holding,
    Move,
    Start,
    checkpoint_custodian,
    choose_start,
    parting_custodian,
    start_scale,
)

# A model of six graph nodes: stage-sized ranges, and one range spanning two of them.
PARAMS = {
    (0, 2): frozenset({"a", "b"}),
    (2, 4): frozenset({"c"}),
    (4, 6): frozenset({"d", "e"}),
    (0, 4): frozenset({"a", "b", "c"}),
}


def params_of(start: int, stop: int) -> frozenset[str]:
    return PARAMS[(start, stop)]  # a range the model does not have is a test error (KeyError)


def H(step: int, start: int, stop: int) -> Holding:  # noqa: N802 (reads like the class)
    return Holding(step, start, stop)


# ----- Holding --------------------------------------------------------------------------------


def test_a_holding_is_a_non_negative_step_and_a_non_empty_node_range() -> None:
    assert H(0, 0, 1) == Holding(step=0, start=0, stop=1)
    for step, start, stop in [(-1, 0, 2), (3, 2, 2), (3, 4, 2), (3, -1, 2)]:
        with pytest.raises(ConfigError, match="not a holding"):
            Holding(step, start, stop)


# ----- choose_start ---------------------------------------------------------------------------


def test_the_newest_fully_covered_step_wins() -> None:
    holdings = {
        "x": [H(5, 0, 2), H(10, 0, 2)],
        "y": [H(10, 2, 4), H(5, 2, 4)],
    }
    needs = {"x": PARAMS[(0, 2)], "y": PARAMS[(2, 4)]}
    start = choose_start(["x", "y"], holdings, needs, params_of)
    assert start == Start(10, (), {"x": (H(10, 0, 2),), "y": (H(10, 2, 4),)})


def test_a_step_covered_only_in_part_is_skipped_for_an_older_full_one() -> None:
    holdings = {
        "x": [H(12, 0, 2), H(12, 2, 4), H(8, 0, 2)],  # step 12: nobody holds d and e
        "y": [H(8, 2, 4), H(8, 4, 6)],
    }
    needs = {"x": PARAMS[(0, 4)], "y": PARAMS[(4, 6)]}
    start = choose_start(["x", "y"], holdings, needs, params_of)
    assert start.step == 8
    # x's newer holding of c is of no use at step 8: c moves from y.
    assert start.moves == (Move("c", "y", "x"),)
    assert start.local == {"x": (H(8, 0, 2),), "y": (H(8, 2, 4), H(8, 4, 6))}


def test_nothing_covering_falls_back_to_the_seed_step_with_no_moves() -> None:
    needs = {"x": PARAMS[(0, 2)], "y": PARAMS[(2, 4)] | PARAMS[(4, 6)]}
    seed = Start(SEED_STEP, (), {"x": (), "y": ()})
    assert SEED_STEP == 0
    # Nobody holds anything.
    assert choose_start(["x", "y"], {}, needs, params_of) == seed
    # Every step covers part of the model, none all of it (d and e are never held).
    partial = {"x": [H(9, 0, 2), H(4, 0, 2)], "y": [H(9, 2, 4), H(4, 2, 4)]}
    assert choose_start(["x", "y"], partial, needs, params_of) == seed


def test_holdings_of_step_zero_are_never_moved_everyone_builds_the_seed() -> None:
    holdings = {"x": [H(0, 0, 4)], "y": [H(0, 4, 6)]}
    needs = {"x": PARAMS[(4, 6)], "y": PARAMS[(0, 4)]}  # a swap that step 0 would need
    assert choose_start(["x", "y"], holdings, needs, params_of) == Start(0, (), {"x": (), "y": ()})


def test_holdings_of_peers_outside_the_plan_are_not_counted() -> None:
    holdings = {"x": [H(3, 0, 2)], "outsider": [H(7, 0, 4), H(7, 4, 6)]}
    needs = {"x": PARAMS[(0, 2)]}
    start = choose_start(["x"], holdings, needs, params_of)
    assert start == Start(3, (), {"x": (H(3, 0, 2),)})


def test_moves_come_from_the_first_holder_in_plan_order() -> None:
    holdings = {
        "x": [H(6, 4, 6)],
        "y": [H(6, 0, 2)],  # y and z both hold a and b
        "z": [H(6, 0, 2), H(6, 2, 4)],
    }
    needs = {"x": PARAMS[(0, 2)], "y": PARAMS[(2, 4)], "z": PARAMS[(4, 6)]}
    start = choose_start(["x", "y", "z"], holdings, needs, params_of)
    assert start.step == 6
    assert start.moves == (
        Move("a", "y", "x"),
        Move("b", "y", "x"),
        Move("c", "z", "y"),
        Move("d", "x", "z"),
        Move("e", "x", "z"),
    )
    # The same holdings in another plan order: z now comes before y, so z sends a and b.
    reordered = choose_start(["x", "z", "y"], holdings, needs, params_of)
    assert [m for m in reordered.moves if m.name in "ab"] == [
        Move("a", "z", "x"),
        Move("b", "z", "x"),
    ]


def test_a_member_holding_a_parameter_at_the_step_gets_no_move_for_it() -> None:
    holdings = {
        "x": [H(6, 0, 2), H(4, 2, 4)],  # x holds c too, but at step 4: that does not count
        "y": [H(6, 2, 4), H(6, 4, 6)],
    }
    needs = {"x": PARAMS[(0, 4)], "y": PARAMS[(2, 4)] | PARAMS[(4, 6)]}
    start = choose_start(["x", "y"], holdings, needs, params_of)
    assert start.step == 6
    assert start.moves == (Move("c", "y", "x"),)  # nothing for a, b (x's) nor c, d, e (y's)


def test_local_lists_each_members_own_holdings_at_the_chosen_step() -> None:
    holdings = {
        "x": [H(6, 4, 6), H(3, 0, 2), H(6, 0, 2)],
        "y": [H(6, 2, 4), H(3, 2, 4)],
        "z": [H(3, 4, 6)],  # only an older step
    }
    needs = {"x": PARAMS[(0, 2)], "y": PARAMS[(2, 4)], "z": PARAMS[(4, 6)]}
    start = choose_start(["x", "y", "z"], holdings, needs, params_of)
    assert start.step == 6
    assert start.local == {"x": (H(6, 4, 6), H(6, 0, 2)), "y": (H(6, 2, 4),), "z": ()}
    assert start.moves == (Move("d", "x", "z"), Move("e", "x", "z"))


def test_the_start_does_not_depend_on_the_order_of_the_dicts() -> None:
    members = ["x", "y", "z"]
    holdings = {
        "x": [H(9, 0, 2), H(5, 0, 4)],
        "y": [H(9, 2, 4), H(9, 0, 2), H(5, 4, 6)],
        "z": [H(9, 4, 6), H(2, 0, 2)],
    }
    needs = {"x": PARAMS[(4, 6)], "y": PARAMS[(0, 2)], "z": PARAMS[(2, 4)]}
    first = choose_start(members, holdings, needs, params_of)
    assert first.step == 9
    # y holds a and b itself: only c, d and e move.
    assert first.moves == (Move("c", "y", "z"), Move("d", "z", "x"), Move("e", "z", "x"))
    for order in itertools.permutations(members):
        shuffled_holdings = {m: holdings[m] for m in order}
        for needs_order in itertools.permutations(members):
            shuffled_needs = {m: needs[m] for m in needs_order}
            assert choose_start(members, shuffled_holdings, shuffled_needs, params_of) == first


# ----- custodians -----------------------------------------------------------------------------


def test_no_checkpoint_custodian_for_a_stage_with_replicas_or_a_single_process() -> None:
    peers = {Role(0, 0): "a0", Role(0, 1): "a1", Role(1, 0): "b0"}
    assert checkpoint_custodian(0, peers) is None  # a0 and a1 each write their own
    assert checkpoint_custodian(0, {Role(0, 0): "solo"}) is None


def test_the_checkpoint_custodian_is_the_next_stages_first_replica_wrapping_around() -> None:
    # Listed out of order, so "first" must come from the roles, not from the dict.
    peers = {
        Role(2, 0): "c0",
        Role(1, 1): "b1",
        Role(0, 1): "a1",
        Role(1, 0): "b0",
        Role(0, 0): "a0",
    }
    assert checkpoint_custodian(2, peers) == "a0"  # the last stage wraps to stage 0
    assert checkpoint_custodian(1, peers) is None  # replicated
    chain = {Role(0, 0): "a", Role(1, 0): "b", Role(2, 0): "c"}
    assert [checkpoint_custodian(s, chain) for s in range(3)] == ["b", "c", "a"]


def test_no_parting_custodian_while_a_holder_of_the_stage_stays() -> None:
    peers = {Role(0, 0): "a0", Role(0, 1): "a1", Role(1, 0): "b0"}
    assert parting_custodian(0, peers, frozenset({"a0"}), preferred=["b0"]) is None
    assert parting_custodian(1, peers, frozenset({"a0", "a1"})) is None


def test_the_parting_custodian_is_the_first_staying_member_among_the_preferred() -> None:
    peers = {Role(0, 0): "a", Role(1, 0): "b", Role(2, 0): "c", Role(3, 0): "d"}
    leaving = frozenset({"b", "c"})
    # "new" is not in the plan being left and "c" leaves: the first staying one in the list
    # is taken, "a", although the next stage's first staying replica would be "d".
    assert parting_custodian(1, peers, leaving, preferred=["new", "c", "a", "d"]) == "a"
    assert parting_custodian(1, peers, leaving, preferred=["new", "c", "d", "a"]) == "d"


def test_the_parting_custodian_falls_back_to_the_next_stages_first_staying_replica() -> None:
    peers = {
        Role(0, 0): "a0",
        Role(1, 0): "b0",
        Role(2, 1): "c1",
        Role(2, 0): "c0",
    }
    assert parting_custodian(1, peers, frozenset({"b0"})) == "c0"
    assert parting_custodian(1, peers, frozenset({"b0", "c0"})) == "c1"
    # Stage 2 leaves whole: the next stage wraps to 0.
    assert parting_custodian(2, peers, frozenset({"c0", "c1"})) == "a0"
    # The whole next stage leaves too: the one after it.
    assert parting_custodian(1, peers, frozenset({"b0", "c0", "c1"})) == "a0"
    # Preferred peers that are not staying members change nothing.
    assert parting_custodian(1, peers, frozenset({"b0"}), preferred=["b0", "joiner"]) == "c0"


def test_no_parting_custodian_when_nobody_stays() -> None:
    peers = {Role(0, 0): "a", Role(1, 0): "b", Role(1, 1): "b1"}
    everyone = frozenset(peers.values())
    assert parting_custodian(0, peers, everyone) is None
    assert parting_custodian(1, peers, everyone, preferred=["a", "joiner"]) is None


def test_every_member_restores_the_first_announced_loss_scale_of_the_start_step() -> None:
    s4, s8 = ScaleState(2.0**18, 3), ScaleState(2.0**17, 0)
    announced = {
        "b": ((Holding(8, 0, 2), s8), (Holding(4, 0, 2), ScaleState(2.0**20, 1))),
        "a": ((Holding(4, 2, 5), None), (Holding(4, 0, 2), s4)),
    }
    # Plan order first (a before b), then a's own order; a holding without a scale is skipped.
    assert start_scale(4, ["a", "b"], announced) == s4
    assert start_scale(4, ["b", "a"], announced) == ScaleState(2.0**20, 1)
    assert start_scale(8, ["a", "b"], announced) == s8
    assert start_scale(6, ["a", "b"], announced) is None  # nobody holds it: none to restore
    assert start_scale(0, ["a", "b"], {"a": ((Holding(0, 0, 2), s4),)}) is None  # the seed
