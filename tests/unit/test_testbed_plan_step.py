"""benchmarks/testbed.py's ``plan_step_s``: the estimated plan's own step time, the figure its
estimate is scored against (a run's ``step_s`` mixes every plan it trained)."""

import pytest

from benchmarks.testbed import _plans, plan_step_s


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


def test_host_cpu_is_read_between_the_warm_ups_end_and_the_last_step() -> None:
    from benchmarks.testbed import _host_cpu
    from fusionllm.testbed.cgroups import CpuUsage

    # 20 steps in 2 s: the seated host used 0.9 CPU-s (0.45 cores, 45 ms a step) and ran out
    # of quota in 15 of 20 periods; the idle one 0.1 CPU-s and never ran out
    cpu = {
        5: {"a": CpuUsage(10.0, 3.0, 100, 40), "b": CpuUsage(10.0, 1.0, 100, 0)},
        29: {"a": CpuUsage(12.0, 3.9, 120, 55), "b": CpuUsage(12.0, 1.1, 120, 0)},
    }
    counters = {5: {"step": 9}, 29: {"step": 29}}
    # a's node's main thread planned for 0.1 CPU-s of them; b's node is gone at the end
    main = {5: {"a": 1.0, "b": 0.5}, 29: {"a": 1.1, "b": None}}
    out = _host_cpu(cpu, counters, 5, 30, main)
    assert out["a"] == pytest.approx({"cores": 0.45, "cpu_per_step_s": 0.045, "throttled": 0.75,
                                      "main_thread_per_step_s": 0.005})  # fmt: skip
    assert out["b"] == pytest.approx({"cores": 0.05, "cpu_per_step_s": 0.005, "throttled": 0.0,
                                      "main_thread_per_step_s": None})  # fmt: skip
    assert _host_cpu({5: cpu[5]}, counters, 5, 30) == {}  # the run ended before its last mark
    cpu[29]["b"] = CpuUsage(12.0, 0.2, 120, 0)  # b's node was killed: its CPU is gone
    assert _host_cpu(cpu, counters, 5, 30)["b"] == {
        "cores": None, "cpu_per_step_s": None, "throttled": 0.0, "main_thread_per_step_s": None
    }  # fmt: skip


def test_a_nodes_main_thread_cpu_is_read_and_a_gone_process_is_none() -> None:
    import os
    import subprocess
    import sys

    from benchmarks.testbed import main_thread_cpu_s

    ours = main_thread_cpu_s(os.getpid())
    assert ours is not None
    assert ours > 0  # this process's main thread imported pytest and torch: CPU seconds
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert main_thread_cpu_s(gone.pid) is None


class _Node:
    def __init__(self, events: list[dict]) -> None:
        self.events = events

    def snapshot(self) -> list[dict]:
        return self.events


def _epoch(epoch: int, digest: str, estimate: float, retimed: float, stages, ranges) -> dict:
    return {"event": "epoch", "epoch": epoch, "digest": digest, "estimate": estimate,
            "retimed": retimed, "stages": stages, "ranges": ranges}  # fmt: skip


def test_a_plan_re_proposed_under_new_figures_is_one_layout_with_its_latest_estimate() -> None:
    """The swarm re-proposes the plan it trains under a new digest once the members published
    their stretches: the same layout, estimated afresh. Its steps and its latest estimate go
    together; another layout (the same hosts the other way round) is another plan."""
    ab, ba, cuts = [["a"], ["b"]], [["b"], ["a"]], [[0, 5], [5, 9]]
    events = [
        _epoch(1, "d1", 0.06, 0.06, ab, cuts),
        {"event": "train_plan", "digest": "d1", "start_step": 0, "stages": ab, "ranges": cuts},
        _epoch(2, "d1", 0.06, 0.09, ab, cuts),  # retimed once the stretches were in
        _epoch(3, "d2", 0.10, 0.10, ab, cuts),  # re-proposed: same layout, new figures
        {"event": "train_plan", "digest": "d2", "start_step": 20, "stages": ab, "ranges": cuts},
        _epoch(4, "d3", 0.11, 0.11, ba, cuts),
        {"event": "train_plan", "digest": "d3", "start_step": 30, "stages": ba, "ranges": cuts},
    ]
    steps = [{"event": "step", "step": s, "t": 0.1 * s, "loss": 1.0} for s in range(40)]
    got = _plans([_Node(events + steps)], {"a": "A", "b": "B"})
    assert (got["plans_trained"], got["layouts_trained"]) == (3, 2)
    assert got["plan"] == [["A"], ["B"]]
    assert got["plan_steps"] == 30
    assert (got["estimate_s"], got["adopted_estimate_s"]) == (0.10, 0.06)
    assert got["plan_step_s"] == pytest.approx(0.1)
    each = [(p["start"], p["steps"], p["estimate_s"]) for p in got["each_plan"]]
    assert each == [(0, 20, 0.06), (20, 10, 0.10), (30, 10, 0.11)]
    assert all(p["step_s"] == pytest.approx(0.1) for p in got["each_plan"])


def test_an_epoch_after_the_last_step_does_not_set_the_estimate() -> None:
    """C, session 17: the members re-timed the plan after the run ended (their stretches
    moved once more), 0.176 s, where the steps had run under 0.215."""
    ab, cuts = [["a"], ["b"]], [[0, 5], [5, 9]]
    events = [
        {**_epoch(1, "d1", 0.24, 0.215, ab, cuts), "t": 1.0},
        {"event": "train_plan", "digest": "d1", "start_step": 0, "stages": ab, "ranges": cuts},
        {**_epoch(2, "d1", 0.24, 0.176, ab, cuts), "t": 4.5},  # after step 39 (t = 3.9)
    ]
    steps = [{"event": "step", "step": s, "t": 0.1 * s, "loss": 1.0} for s in range(40)]
    got = _plans([_Node(events + steps)], {"a": "A", "b": "B"})
    assert got["estimate_s"] == 0.215
