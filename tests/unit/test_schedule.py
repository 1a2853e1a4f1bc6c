"""1F1B order, the round-robin split over replicas, and that no mix of them can deadlock."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fusionllm.common.errors import ConfigError
from fusionllm.node.pipeline.schedule import (
    ideal_bubble,
    one_f_one_b,
    owner,
    replica_micro_batches,
    replica_schedule,
)


def test_one_f_one_b_shapes() -> None:
    assert one_f_one_b(0, 1, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert one_f_one_b(0, 3, 4) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3),
    ]  # fmt: skip
    assert one_f_one_b(2, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    # More stages than micro-batches: all forwards, then all backwards.
    assert one_f_one_b(0, 4, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert replica_schedule(1, 3, 4, 2, 1) == [("F", 1), ("B", 1), ("F", 3), ("B", 3)]


def test_schedule_errors() -> None:
    with pytest.raises(ConfigError):
        one_f_one_b(3, 3, 2)
    with pytest.raises(ConfigError):
        one_f_one_b(0, 3, 0)
    with pytest.raises(ConfigError):
        replica_micro_batches(1, 2, 0)
    with pytest.raises(ConfigError):
        replica_micro_batches(4, 2, 2)


def test_replicas_split_round_robin() -> None:
    assert replica_micro_batches(5, 2, 0) == [0, 2, 4]
    assert replica_micro_batches(5, 2, 1) == [1, 3]
    assert [owner(i, 2) for i in range(5)] == [0, 1, 0, 1, 0]


def _in_flight_peak(order) -> int:
    live, peak = 0, 0
    for kind, _ in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


@given(stages=st.integers(1, 6), micro_batches=st.integers(1, 12), data=st.data())
def test_each_micro_batch_once_forward_before_backward(stages, micro_batches, data) -> None:
    stage = data.draw(st.integers(0, stages - 1))
    order = one_f_one_b(stage, stages, micro_batches)
    assert sorted(order) == sorted([(kind, i) for kind in "FB" for i in range(micro_batches)])
    for i in range(micro_batches):
        assert order.index(("F", i)) < order.index(("B", i))
    assert _in_flight_peak(order) <= min(stages - stage, micro_batches)


@given(stages=st.integers(1, 6), micro_batches=st.integers(1, 12), slack=st.integers(0, 4))
def test_slack_runs_ahead_and_keeps_backward_order(stages, micro_batches, slack) -> None:
    plain = [one_f_one_b(s, stages, micro_batches) for s in range(stages)]
    ahead = [one_f_one_b(s, stages, micro_batches, slack=slack) for s in range(stages)]
    for s in range(stages):
        assert sorted(ahead[s]) == sorted(plain[s])
        # Gradients accumulate in the same micro-batch order: the result is bit-identical.
        assert [op for op in ahead[s] if op[0] == "B"] == [op for op in plain[s] if op[0] == "B"]
        extra = slack if s < stages - 1 else 0
        assert _in_flight_peak(ahead[s]) == min(stages - s + extra, micro_batches)


def test_slack_shapes_and_errors() -> None:
    assert one_f_one_b(0, 2, 4, slack=1) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3),
    ]  # fmt: skip
    assert one_f_one_b(1, 2, 3, slack=5) == one_f_one_b(1, 2, 3)  # the last stage: no change
    with pytest.raises(ConfigError, match="slack"):
        one_f_one_b(0, 2, 4, slack=-1)


def test_local_warmup_on_a_replica_would_deadlock() -> None:
    """Why replicas filter the stage's order instead of running 1F1B over their share."""
    assert not _runs_to_completion([1, 3, 1], 4, schedule=_naive_replica_schedule)
    assert _runs_to_completion([1, 3, 1], 4)


def _naive_replica_schedule(stage, stages, micro_batches, replicas, replica):
    mine = replica_micro_batches(micro_batches, replicas, replica)
    order = one_f_one_b(stage, stages, len(mine))
    return [(kind, mine[i]) for kind, i in order]


def _runs_to_completion(
    replicas: list[int], micro_batches: int, schedule=replica_schedule, slack: int = 0
) -> bool:
    """Execute every process's schedule with unbounded mailboxes; False on a deadlock."""
    stages = len(replicas)
    procs = [
        (
            s,
            r,
            schedule(
                s, stages, micro_batches, replicas[s], r, **({"slack": slack} if slack else {})
            ),
        )
        for s in range(stages)
        for r in range(replicas[s])
    ]
    done: set[tuple[str, int, int]] = set()  # (kind, stage, micro-batch)
    cursor = [0] * len(procs)
    progressed = True
    while progressed:
        progressed = False
        for p, (s, _, order) in enumerate(procs):
            while cursor[p] < len(order):
                kind, mb = order[cursor[p]]
                if kind == "F":
                    need = None if s == 0 else ("F", s - 1, mb)
                else:  # the last stage's backward needs its own forward (the loss)
                    need = ("F", s, mb) if s == stages - 1 else ("B", s + 1, mb)
                if need is not None and need not in done:
                    break
                done.add((kind, s, mb))
                cursor[p] += 1
                progressed = True
    return all(cursor[p] == len(order) for p, (_, _, order) in enumerate(procs))


@given(
    replicas=st.lists(st.integers(1, 3), min_size=1, max_size=5),
    extra=st.integers(0, 6),
    slack=st.integers(0, 3),
)
def test_replicated_stages_never_deadlock(replicas, extra, slack) -> None:
    assert _runs_to_completion(replicas, max(replicas) + extra, slack=slack)


@given(stages=st.integers(1, 8), micro_batches=st.integers(1, 32), each_s=st.floats(0.001, 10))
def test_equal_stages_leave_the_textbook_bubble(stages, micro_batches, each_s) -> None:
    got = ideal_bubble([each_s] * stages, micro_batches)
    assert got == pytest.approx((stages - 1) / (micro_batches + stages - 1), abs=1e-12)


def test_an_uneven_cut_leaves_more_bubble_the_more_uneven_it_is() -> None:
    # 8 micro-batches, 2 stages: per micro-batch 0.375 and 0.125; 7 x 0.375 + 0.5 = 3.125.
    assert ideal_bubble([3.0, 1.0], 8) == pytest.approx(1 - 4.0 / (2 * 3.125))
    even, mild, steep = (ideal_bubble(c, 8) for c in ([2.0, 2.0], [2.2, 1.8], [3.0, 1.0]))
    assert even < mild < steep


def test_an_ideal_bubble_needs_sane_inputs() -> None:
    for compute, micro_batches in (([], 8), ([1.0], 0), ([1.0, -0.1], 8)):
        with pytest.raises(ConfigError, match="ideal bubble"):
            ideal_bubble(compute, micro_batches)
