"""The end of a wait chain is the member blamed for a stalled step (node/training/blame.py)."""

import math

import pytest
import torch

from fusionllm.node.training.blame import chain_end, read_note, settled


def test_the_member_at_the_end_of_the_chain_is_blamed_not_the_neighbour():
    # Ranks 0 -> 1 -> 2: stage 0 waited on stage 1, which waited on stage 2, which sent nothing.
    waits = {0: 1, 1: 2}
    assert chain_end(waits, 1) == 2
    assert settled(waits, 2, 3)


def test_without_the_neighbours_note_the_neighbour_is_the_end_so_far():
    waits = {0: 1}
    assert chain_end(waits, 1) == 1
    assert not settled(waits, 1, 3)  # rank 2 may still say rank 1 waits on it


def test_a_cycle_blames_nobody():
    # A frame lost between ranks 1 and 2: each waits on the other.
    waits = {0: 1, 1: 2, 2: 1}
    assert chain_end(waits, 1) is None
    assert settled(waits, None, 3)


def test_two_members_the_one_waited_on_is_blamed_at_once():
    assert chain_end({0: 1}, 1) == 1
    assert settled({0: 1}, 1, 2)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (2.0, 2),
        (0.0, 0),
        (1.0, None),  # itself
        (3.0, None),
        (-1.0, None),
        (1.5, None),
        (math.nan, None),
        (math.inf, None),
    ],
)
def test_a_note_must_name_another_rank_of_the_plan(value, expected):
    note = torch.tensor([value], dtype=torch.float64)
    assert read_note(note, sender=1, ranks=3) == expected


def test_a_note_of_the_wrong_size_is_ignored():
    assert read_note(torch.zeros(2, dtype=torch.float64), sender=0, ranks=3) is None
