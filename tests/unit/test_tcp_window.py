"""tcp_window.py and its use in simulate.py: a frame on a connection idle past its
retransmission timeout restarts from a smaller window and slow-starts."""

import pytest

from fusionllm.dag.simulate import PipelineTimes, simulate
from fusionllm.dag.tcp_window import (
    INITIAL_WINDOW_BYTES,
    RTO_MIN_S,
    rto,
    send_time,
    window_after_idle,
)

MB = 1e6


def test_a_warm_window_sends_at_the_links_rate():
    assert send_time(131072, MB, 0.08, MB * 0.08) == pytest.approx(0.131072)


def test_from_the_initial_window_a_frame_waits_round_trips():
    # 1 MB/s, 80 ms: three rounds of 14.5, 29 and 58 KB, then the rest at the rate
    sent = INITIAL_WINDOW_BYTES * (1 + 2 + 4)
    expected = 3 * 0.08 + (131072 - sent) / MB
    assert send_time(131072, MB, 0.08, INITIAL_WINDOW_BYTES) == pytest.approx(expected)
    assert expected > 2 * 0.131  # what the estimate missed on topology C


def test_a_small_frame_or_a_fast_link_pays_nothing():
    assert send_time(10_000, MB, 0.08, INITIAL_WINDOW_BYTES) == pytest.approx(0.01)
    # 1 Gbit/s at 0.5 ms: the initial window is 0.9 of the path, one round
    lan = send_time(131072, 125 * MB, 0.0005, INITIAL_WINDOW_BYTES)
    assert lan < 0.0025


def test_the_window_halves_once_per_timeout_of_silence_beyond_the_first():
    bdp = MB * 0.08  # 80 KB
    timeout = rto(0.08)
    assert timeout == pytest.approx(0.08 + RTO_MIN_S)
    assert window_after_idle(0.9 * timeout, 0.08, MB) == bdp
    assert window_after_idle(1.5 * timeout, 0.08, MB) == bdp / 2
    assert window_after_idle(2.5 * timeout, 0.08, MB) == bdp / 4
    assert window_after_idle(1e9, 0.08, MB) == INITIAL_WINDOW_BYTES


def test_bad_figures_are_refused():
    for args in [(1.0, 0.0, 0.1, 1.0), (1.0, 1.0, -0.1, 1.0), (1.0, 1.0, 0.1, 0.0)]:
        with pytest.raises(ValueError, match="bad link or frame"):
            send_time(*args)


def _two_stages(m: int, compute: float, nbytes=()) -> PipelineTimes:
    frame = 131072 / MB  # 128 KiB at 1 MB/s
    return PipelineTimes(forward=(compute, compute), backward=(compute, compute),
                         send_forward=(frame,), send_backward=(frame,),
                         latency_forward=(0.04,), latency_backward=(0.04,), micro_batches=m,
                         bytes_forward=nbytes, bytes_backward=nbytes)  # fmt: skip


def test_frames_further_apart_than_the_timeout_pay_the_restart():
    # 0.4 s of compute between frames: every frame meets a connection idle past 0.28 s
    plain = simulate(_two_stages(4, 0.4)).step_time
    restarted = simulate(_two_stages(4, 0.4, (131072.0,))).step_time
    # ~0.14 s more for each restarted frame on the critical path (the first test's figures)
    assert restarted > plain + 2 * 0.14


def test_the_step_summary_keeps_a_connection_warm_for_the_next_steps_first_frame():
    # One micro-batch: stage 0 sends one activation a step, ~0.9 s apart, but its summary
    # leaves on that connection as its schedule ends, and the next activation 1 ms of compute
    # later: it starts warm, so counting the forward link's bytes changes nothing.
    base = _two_stages(1, 0.3, (131072.0,))
    times = PipelineTimes(**{**base.__dict__, "forward": (0.001, 0.3), "backward": (0.001, 0.3)})
    backward_only = PipelineTimes(**{**times.__dict__, "bytes_forward": ()})
    assert simulate(times).step_time > 0.9
    assert simulate(times).step_time == pytest.approx(simulate(backward_only).step_time)


def test_back_to_back_frames_keep_the_window():
    # compute far below a frame's time: the connection never idles within the step, and the
    # step's first frame follows the last one of the step before by less than the timeout
    plain = simulate(_two_stages(8, 0.001)).step_time
    assert simulate(_two_stages(8, 0.001, (131072.0,))).step_time == pytest.approx(plain)
