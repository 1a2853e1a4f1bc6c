"""node/control/convergence.py: nodes that adopted different plans for one epoch come together."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fusionllm.common.errors import ConfigError
from fusionllm.dht.records import DeviceInfo, NodeInfo, NodeState
from fusionllm.node.control.convergence import Outvoted, converge, most_followed, tally

A, B, C = ("a" * 64, "b" * 64, "c" * 64)
DEVICE = DeviceInfo(
    name="cpu", kind="cpu", memory_bytes=1 << 30, flops=1e11, memory_bandwidth=1e10,
    op_overhead=0.0, cpu_cores=2, ram_bytes=1 << 30,
)  # fmt: skip


def record(peer: str, adopted: tuple[int, str] | None) -> NodeInfo:
    return NodeInfo(peer_id=peer, swarm="demo", addrs=(), dht_addrs=(), device=DEVICE,
                    uplink=1e7, downlink=1e7, links=(), software="t", config_digest="x",
                    state=NodeState.SERVING, stage=0, adopted=adopted, time=1.0)  # fmt: skip


def test_tally_counts_reports_for_that_epoch_only():
    members = [record("p1", (5, A)), record("p2", (5, B)), record("p3", (5, B)),
               record("p4", (4, A)), record("p5", None)]  # fmt: skip
    assert tally(members, 5) == {A: 1, B: 2}
    assert tally(members, 4) == {A: 1}
    assert tally(members, 6) == {}


def test_most_followed_needs_a_majority_of_all_members():
    three = [record("p1", (5, A)), record("p2", (4, A)), record("p3", None)]
    assert most_followed(three, since_epoch=4) == A
    assert most_followed(three, since_epoch=5) is None  # p2's report is too old to count
    # Two members, one report each way (an honest node and a liar): no majority.
    assert most_followed([record("p1", (5, A)), record("p2", (5, B))], since_epoch=0) is None
    assert most_followed([record("p1", (5, B)), record("p2", None)], since_epoch=0) is None
    assert most_followed([], since_epoch=0) is None


def test_the_minority_follows_the_majority():
    assert converge(A, {A: 1, B: 2}, acceptable={A, B}) == B


def test_the_majority_stays():
    assert converge(B, {A: 1, B: 2}, acceptable={A, B}) is None


def test_equal_camps_stay_put():
    assert converge(A, {A: 2, B: 2}, acceptable={A, B}) is None
    assert converge(B, {A: 2, B: 2}, acceptable={A, B}) is None


def test_a_plan_we_cannot_accept_is_not_followed():
    assert converge(A, {A: 1, B: 3}, acceptable={A}) is None
    # ... the best we can accept is followed instead, if it beats ours.
    assert converge(A, {A: 1, B: 3, C: 2}, acceptable={A, C}) == C


def test_ties_between_others_go_to_the_lowest_digest():
    assert converge(C, {A: 2, B: 2, C: 1}, acceptable={A, B, C}) == A


def test_our_own_vote_may_be_missing():
    assert converge(A, {B: 1}, acceptable={B}) == B
    assert converge(A, {}, acceptable={A, B}) is None
    assert converge(A, {B: 0}, acceptable={B}) is None


@given(votes=st.dictionaries(st.sampled_from([A, B, C]), st.integers(0, 5)),
       order=st.permutations([A, B, C]))  # fmt: skip
def test_every_minority_node_lands_on_the_same_digest(votes, order):
    """All nodes that switch pick the same digest, whatever digest each started from."""
    targets = {converge(own, votes, acceptable=set(order)) for own in order}
    switched = targets - {None}
    assert len(switched) <= 1
    for own in order:
        target = converge(own, votes, acceptable=set(order))
        if target is not None:
            assert votes[target] > votes.get(own, 0)
            assert votes[target] == max(votes.values())


def test_outvoted_holds_for_a_few_epochs():
    held = Outvoted(hold_epochs=2)
    held.add(A, 10)
    assert held.holds(A, 10)
    assert held.holds(A, 12)
    assert not held.holds(A, 13)
    assert not held.holds(B, 10)
    held.add(B, 11)
    held.prune(13)
    assert not held.holds(A, 11)  # pruned: forgotten even for earlier epochs
    assert held.holds(B, 13)


def test_outvoted_needs_a_hold():
    with pytest.raises(ConfigError):
        Outvoted(hold_epochs=0)
