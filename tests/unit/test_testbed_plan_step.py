"""benchmarks/testbed.py's ``plan_step_s``: the estimated plan's own step time, the figure its
estimate is scored against (a run's ``step_s`` mixes every plan it trained)."""

import pytest

from benchmarks.testbed import plan_step_s


def _times(gaps: list[float]) -> dict[int, float]:
    """Step -> when it was reported, from the intervals between steps (step 0 at t = 0)."""
    times, t = {0: 0.0}, 0.0
    for step, gap in enumerate(gaps, start=1):
        t += gap
        times[step] = t
    return times


def test_a_plan_is_timed_by_its_own_steps_less_its_first_two() -> None:
    # steps 0-4 under another plan (0.1 s); the plan from step 5: the switch and its first
    # step (3 s), a warming second step (1 s), then 0.2, 0.3 and 0.4 s (median of all 0.4)
    times = _times([0.1] * 4 + [3.0, 1.0, 0.2, 0.3, 0.4] + [0.1] * 3)
    assert plan_step_s(times, [(5, 10)]) == pytest.approx(0.3)
    assert plan_step_s(times, [(0, 5), (10, 13)]) == pytest.approx(0.1)


def test_every_span_of_the_plan_counts() -> None:
    # the plan ran steps 0-5 and again 10-15, another plan 6-9 at 1 s a step
    times = _times([0.3] * 5 + [1.0] * 5 + [0.3] * 5)
    assert plan_step_s(times, [(0, 6), (10, 16)]) == pytest.approx(0.3)


def test_too_few_steps_or_missing_reports_give_no_figure() -> None:
    times = _times([0.2] * 10)
    assert plan_step_s(times, [(0, 4)]) is None  # two intervals after the first two
    assert plan_step_s(times, []) is None
    gappy = {s: t for s, t in times.items() if s not in (6, 7)}  # steps nobody reported
    assert plan_step_s(gappy, [(0, 11)]) == pytest.approx(0.2)
