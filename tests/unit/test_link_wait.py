"""node/control/link_wait.py: the planner waits, a bounded while, for candidates' links."""

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.control.link_wait import LinkWait, unmeasured_pairs


def test_a_pair_is_measured_by_either_direction():
    measured = {("a", "b"), ("c", "a")}
    assert unmeasured_pairs(["c", "b", "a"], measured) == [("b", "c")]
    assert unmeasured_pairs(["a"], set()) == []


def test_candidates_wait_until_measured_or_until_the_wait_runs_out():
    wait = LinkWait(6.0)
    assert wait.waiting(["a", "b", "c"], set(), now=100.0) == {"a", "b", "c"}
    # a-b and a-c measured; b-c not yet: b and c still wait, a does not.
    assert wait.waiting(["a", "b", "c"], {("a", "b"), ("c", "a")}, now=103.0) == {"b", "c"}
    assert wait.waiting(["a", "b", "c"], {("a", "b"), ("c", "a")}, now=106.0) == set()


def test_a_late_arrival_waits_from_its_own_arrival_and_the_others_do_not():
    wait = LinkWait(6.0)
    measured = {("a", "b")}
    assert wait.waiting(["a", "b"], measured, now=100.0) == set()
    assert wait.waiting(["a", "b", "d"], measured, now=110.0) == {"a", "b", "d"}
    assert wait.waiting(["a", "b", "d"], measured, now=115.9) == {"a", "b", "d"}
    assert wait.waiting(["a", "b", "d"], measured, now=116.0) == set()


def test_a_member_that_left_and_came_back_waits_again():
    wait = LinkWait(6.0)
    assert wait.waiting(["a", "b"], set(), now=100.0) == {"a", "b"}
    assert wait.waiting(["a"], set(), now=107.0) == set()
    assert wait.waiting(["a", "b"], set(), now=108.0) == {"a", "b"}


def test_no_wait_means_plan_at_once():
    assert LinkWait(0.0).waiting(["a", "b"], set(), now=1.0) == set()


@pytest.mark.parametrize("bad", [-1.0, 3600.0, float("nan")])
def test_the_wait_is_bounded(bad):
    with pytest.raises(ConfigError, match="link wait"):
        LinkWait(bad)
