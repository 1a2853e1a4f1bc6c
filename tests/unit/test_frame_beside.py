"""A frame's cost beside compute (issue 25, session 19): the arithmetic of paired rounds, the
probe's config, and that the real probe (lane over loopback TCP, a reader thread) returns a
figure and leaves nothing running. What it reads on this machine is benchmarks/frame_cost.py's."""

import logging
import math
import threading

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.control import frame_beside
from fusionllm.node.control.frame_beside import (
    BesideConfig,
    measure_frame_beside_compute,
    per_side_beside,
)


def test_the_median_pair_difference_is_spread_over_the_frames_and_halved():
    # Three pairs of 10 slices: the frames added 0.020, 0.010 and 0.060 s of CPU.
    alone = [0.100, 0.110, 0.090]
    with_frames = [0.120, 0.120, 0.150]
    assert per_side_beside(alone, with_frames, 10) == pytest.approx(0.020 / 10 / 2)
    # One disturbed pair moves the median no further than the next pair's figure.
    assert per_side_beside([*alone, 0.5], [*with_frames, 0.1], 10) == pytest.approx(0.015 / 10 / 2)


def test_noise_that_turns_the_difference_negative_reads_zero_not_a_negative_cost():
    assert per_side_beside([0.2, 0.2, 0.2], [0.19, 0.18, 0.21], 4) == 0.0


@pytest.mark.parametrize(
    ("alone", "with_frames", "frames"),
    [([], [], 4), ([0.1], [0.1, 0.2], 4), ([0.1], [0.2], 0), ([math.nan], [0.2], 4),
     ([0.1], [-0.2], 4), ([0.1], [math.inf], 4)],
)  # fmt: skip
def test_rounds_that_do_not_pair_or_are_not_cpu_seconds_are_refused(alone, with_frames, frames):
    with pytest.raises(ValueError, match="need"):
        per_side_beside(alone, with_frames, frames)


def test_the_config_is_checked():
    with pytest.raises(ConfigError, match="shape must be"):
        BesideConfig(shape=(0, 4))
    with pytest.raises(ConfigError, match="rounds and iterations must be >= 1"):
        BesideConfig(rounds=0)
    with pytest.raises(ConfigError, match="rounds and iterations must be >= 1"):
        BesideConfig(iterations=0)
    with pytest.raises(ConfigError, match="budget_s must be in"):
        BesideConfig(budget_s=0)


def test_the_probe_reads_a_finite_cost_and_stops_its_reader():
    figure = measure_frame_beside_compute(BesideConfig(shape=(4, 16, 16), rounds=2, iterations=3))
    assert 0 <= figure < math.inf
    assert not [t for t in threading.enumerate() if t.name == "frame-beside"]


def test_without_loopback_tcp_the_probe_falls_back_to_a_socket_pair_and_says_so(
    monkeypatch, caplog
):
    def down() -> None:
        raise OSError("Network is unreachable")

    monkeypatch.setattr(frame_beside, "_loopback_pair", down)
    with caplog.at_level(logging.WARNING):
        figure = measure_frame_beside_compute(BesideConfig(shape=(4, 16), rounds=1, iterations=2))
    assert 0 <= figure < math.inf
    assert "no loopback TCP (Network is unreachable)" in caplog.text
