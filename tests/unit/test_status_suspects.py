"""``fusionllm status`` shows observers, suspected members, why, and whether they are kept out."""

import collections

from fusionllm.dht.records import NodeState, Suspicion
from fusionllm.node.control.status import acting_epochs, describe, followed_plan, format_status
from tests.unit.test_epochs import T0, record


def _swarm():
    late = (Suspicion("c", T0 + 20, "barrier", 2),)
    return {
        "a": record("a", state=NodeState.SERVING, suspects=late),
        "b": record("b", state=NodeState.SERVING, suspects=late),
        "c": record("c", state=NodeState.SERVING),
        "w": record("w", observer=True),
    }


def test_status_names_the_suspect_its_accusers_and_the_time_left():
    status = describe("demo", _swarm(), None, collections.Counter(), now=T0 + 5, skipped=0)
    (suspect,) = status["suspected"]
    assert suspect["peer_id"] == "c"
    assert suspect["excluded"] is True
    assert [a["peer_id"] for a in suspect["by"]] == ["a", "b"]
    assert suspect["by"][0] == {"peer_id": "a", "reason": "barrier", "strikes": 2, "left_s": 15.0}
    assert [p["observer"] for p in status["peers"]] == [False, False, False, True]
    text = format_status(status)
    assert "suspected c (kept out of plans):" in text
    assert "by a: barrier, strike 2, 15 s left" in text
    assert "observer" in text.splitlines()[[p["peer_id"] for p in status["peers"]].index("w") + 2]


def test_status_says_when_one_accusation_is_not_enough():
    members = _swarm()
    members["b"] = record("b", state=NodeState.SERVING)
    members["d"] = record("d", state=NodeState.SERVING)
    status = describe("demo", members, None, collections.Counter(), now=T0 + 5, skipped=0)
    assert status["suspected"][0]["excluded"] is False  # 1 of 3 others serving
    assert "not enough to keep it out" in format_status(status)


def test_an_expired_suspicion_is_not_shown():
    status = describe("demo", _swarm(), None, collections.Counter(), now=T0 + 20, skipped=0)
    assert status["suspected"] == []


def test_status_shows_the_plan_most_members_follow_whatever_epoch_each_adopted_it_at():
    """Off loopback members adopt one plan epochs apart: three follow "aa" (adopted at epochs
    7, 8, 8), one adopted "bb" at epoch 9; counting (epoch, digest) pairs picked "bb"."""
    aa, bb = "aa" * 32, "bb" * 32
    votes = collections.Counter({(7, aa): 1, (8, aa): 2, (9, bb): 1})
    assert followed_plan(votes) == (aa, [8, 7])
    assert followed_plan(collections.Counter({(3, aa): 1, (4, bb): 1})) == (bb, [4])
    assert followed_plan(collections.Counter()) is None


def test_status_looks_for_a_quiet_plan_where_its_nodes_store_it():
    """Members stamp the plan they follow with every epoch; quiet ones store its proposal only
    in epochs that are multiples of their stride (a power of two): those are looked at too."""
    assert acting_epochs([35]) == [35, 34, 32, 0]
    assert acting_epochs([40, 39]) == [40, 39, 38, 36, 32, 0]
    assert acting_epochs([]) == []
