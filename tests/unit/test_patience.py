"""Frame deadlines from a step's measured rhythm (node/pipeline/patience.py)."""

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.pipeline.patience import (
    SLOW_LINK_BYTES_PER_S,
    SLOW_LINK_RTT_S,
    Patience,
    PatienceConfig,
)


def _steps(patience: Patience, intervals: list[float], first: int = 0) -> None:
    now = 100.0
    patience.step_started(first, now)
    for i, gap in enumerate(intervals, start=first + 1):
        now += gap
        patience.step_started(i, now)


def test_the_step_timeout_holds_until_a_few_steps_are_measured():
    patience = Patience(PatienceConfig(cap_s=60.0, min_steps=3))
    _steps(patience, [0.5, 0.5])
    assert patience.rhythm_s() is None
    assert patience.wait_s(1000) == 60.0
    _steps(patience, [0.5], first=2)
    assert patience.rhythm_s() == pytest.approx(0.5)
    assert patience.wait_s(1000) == 15.0  # the floor, far above 4 x 0.5 s


def test_slow_steps_wait_a_multiple_of_the_slowest_recent_interval():
    patience = Patience(PatienceConfig(cap_s=60.0, floor_s=5.0, factor=4.0))
    _steps(patience, [1.0, 3.0, 2.0, 1.0])  # a checkpoint step took 3 s
    assert patience.wait_s(0) == pytest.approx(12.0)
    _steps(patience, [20.0, 20.0, 20.0], first=4)
    assert patience.wait_s(0) == 60.0  # never above the configured step timeout


def test_a_large_frame_gets_what_a_slow_wan_link_needs():
    patience = Patience(PatienceConfig(cap_s=600.0, floor_s=5.0))
    _steps(patience, [0.1, 0.1, 0.1])
    frame = 40_000_000  # 40 MB: 40 s at 8 Mbit/s
    expected = SLOW_LINK_RTT_S + frame / SLOW_LINK_BYTES_PER_S
    assert patience.wait_s(frame) == pytest.approx(expected)
    # A faster measured link does not shorten it; a slower one lengthens it.
    assert patience.wait_s(frame, link_bytes_per_s=1e9) == pytest.approx(expected)
    slower = patience.wait_s(frame, link_bytes_per_s=SLOW_LINK_BYTES_PER_S / 2)
    assert slower == pytest.approx(SLOW_LINK_RTT_S + 2 * frame / SLOW_LINK_BYTES_PER_S)


def test_a_broken_rhythm_is_not_an_interval():
    patience = Patience(PatienceConfig(cap_s=60.0, floor_s=1.0, min_steps=1))
    patience.step_started(5, 0.0)
    patience.step_started(5, 50.0)  # the same step again (a failed step retried)
    patience.step_started(9, 90.0)  # a jump (a plan switch)
    assert patience.rhythm_s() is None
    patience.step_started(10, 90.5)
    assert patience.rhythm_s() == pytest.approx(0.5)


def test_the_grace_for_other_members_notes_follows_the_rhythm():
    patience = Patience(PatienceConfig(cap_s=60.0))
    assert patience.grace_s() == 15.0  # no rhythm yet: a quarter of the step timeout
    _steps(patience, [0.2, 0.2, 0.2])
    assert patience.grace_s() == 5.0
    _steps(patience, [4.0], first=3)
    assert patience.grace_s() == pytest.approx(8.0)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"cap_s": 10.0, "floor_s": 20.0}, "floor_s"),
        ({"floor_s": 0.0}, "floor_s"),
        ({"factor": 0.5}, "factor"),
        ({"min_steps": 40, "window": 32}, "min_steps"),
    ],
)
def test_config_is_checked(options, match):
    with pytest.raises(ConfigError, match=match):
        PatienceConfig(**options)
