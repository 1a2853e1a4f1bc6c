"""node/control/link_wait.py: the planner waits, a bounded while, for candidates' links."""

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.control.link_wait import LinkWait, measured_neighbours
from fusionllm.node.control.probe_slots import cycle_seconds


def both(*pairs: tuple[str, str]) -> set[tuple[str, str]]:
    return {*pairs, *((b, a) for a, b in pairs)}


def test_a_link_counts_for_both_ends_once_measured_both_ways():
    linked = measured_neighbours(["a", "b", "c"], {*both(("a", "b"), ("c", "a")), ("a", "x")})
    assert linked == {"a": {"b", "c"}, "b": {"a"}, "c": {"a"}}
    # One way only: the other is priced from the records (B: a 1 Gbit/s link at 20 Mbit/s).
    half = measured_neighbours(["a", "b", "c"], {*both(("a", "b")), ("c", "a")})
    assert half == {"a": {"b"}, "b": {"a"}, "c": set()}


def test_in_a_small_swarm_every_candidate_waits_for_links_to_all_the_others():
    wait = LinkWait(6.0)
    assert wait.waiting(["a", "b", "c"], set(), now=100.0) == {"a", "b", "c"}
    # a-b and a-c measured; b-c not yet: b and c still wait, a does not.
    assert wait.waiting(["a", "b", "c"], both(("a", "b"), ("c", "a")), now=103.0) == {"b", "c"}
    assert (
        wait.waiting(["a", "b", "c"], both(("a", "b"), ("c", "a"), ("b", "c")), now=103.0) == set()
    )
    assert wait.waiting(["a", "b", "c"], both(("a", "b"), ("c", "a")), now=106.0) == set()


def test_in_a_larger_swarm_need_links_are_enough():
    peers = [f"p{i}" for i in range(6)]
    ring = both(*((peers[i], peers[(i + 1) % 6]) for i in range(6)))  # two neighbours each
    assert LinkWait(6.0, need=2).waiting(peers, ring, now=1.0) == set()
    assert LinkWait(6.0, need=3).waiting(peers, ring, now=1.0) == set(peers)


def test_a_late_arrival_waits_from_its_own_arrival_and_the_others_do_not():
    wait = LinkWait(6.0, need=1)
    measured = both(("a", "b"))
    assert wait.waiting(["a", "b"], measured, now=100.0) == set()
    assert wait.waiting(["a", "b", "d"], measured, now=110.0) == {"d"}
    assert wait.waiting(["a", "b", "d"], measured, now=115.9) == {"d"}
    assert wait.waiting(["a", "b", "d"], measured, now=116.0) == set()


def test_a_member_that_left_and_came_back_waits_again():
    wait = LinkWait(6.0)
    assert wait.waiting(["a", "b"], set(), now=100.0) == {"a", "b"}
    assert wait.waiting(["a"], set(), now=107.0) == set()
    assert wait.waiting(["a", "b"], set(), now=108.0) == {"b"}


def test_where_probes_wait_for_slots_the_wait_covers_a_cycle_of_the_whole_swarm():
    wait = LinkWait(6.0, sweep_s=lambda members: cycle_seconds(members, 2.0))
    peers = ["a", "b", "c", "d"]
    assert wait.waiting(peers, set(), now=100.0) == set(peers)
    assert wait.waiting(peers, set(), now=117.9) == set(peers)  # 6 s and a 12 s cycle
    assert wait.waiting(peers, set(), now=118.0) == set()
    # An observer the slots pair off too makes the cycle one of six: 20 s.
    assert wait.waiting(peers, set(), now=125.9, members=5) == set(peers)
    assert wait.waiting(peers, set(), now=126.0, members=5) == set()


def test_no_wait_means_plan_at_once():
    assert LinkWait(0.0).waiting(["a", "b"], set(), now=1.0) == set()


@pytest.mark.parametrize("bad", [-1.0, 3600.0, float("nan")])
def test_the_wait_is_bounded(bad):
    with pytest.raises(ConfigError, match="link wait"):
        LinkWait(bad)
    with pytest.raises(ConfigError, match="need"):
        LinkWait(1.0, need=0)
