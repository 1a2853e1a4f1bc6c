"""transfer.TransferWait: a state's bytes at the measured rate, with a floor and a cap."""

import math

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.training.transfer import HAND_OVER, TransferWait


def test_a_small_state_or_an_unmeasured_link_waits_the_floor():
    wait = TransferWait(floor_s=30.0)
    assert wait.seconds(0, 1e6) == 30.0
    for unmeasured in (0.0, -1.0, math.inf, math.nan):
        assert wait.seconds(10**9, unmeasured) == 30.0


def test_the_wait_grows_with_the_bytes_at_the_measured_rate():
    wait = TransferWait(floor_s=30.0, slack=3.0)
    # GPT-2 small's middle stage (~170 MB of parameters and AdamW moments) at 8 Mbit/s: the
    # loopback figure (30 s) would give up after a sixth of it.
    assert wait.seconds(170_000_000, 1e6) == pytest.approx(30.0 + 3 * 170.0)
    assert wait.seconds(2_000_000, 1e6) < wait.seconds(4_000_000, 1e6)
    assert wait.seconds(4_000_000, 2e6) == pytest.approx(wait.seconds(2_000_000, 1e6))


def test_a_link_measured_far_too_slow_waits_the_cap():
    assert HAND_OVER.seconds(10**12, 1.0) == HAND_OVER.cap_s


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"floor_s": 0.0}, "floor_s"),
        ({"floor_s": 60.0, "cap_s": 30.0}, "floor_s"),
        ({"floor_s": 1.0, "slack": 0.5}, "slack"),
    ],
)
def test_a_wait_is_validated(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        TransferWait(**kwargs)


def test_negative_bytes_are_refused():
    with pytest.raises(ValueError, match="nbytes"):
        HAND_OVER.seconds(-1, 1e6)
