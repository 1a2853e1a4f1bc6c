"""``benchmarks/testbed.py --quick`` end to end: the experiment CI runs on every change.

Three hosts of topology ``mini`` (two neighbours, a home user on 20 Mbit/s at 40 ms), naive
and OP-Fence + AdaTopK, 20 steps each (--quick alone: 30), real daemons. Checked: both runs
train every step to the end and exit cleanly, every node rehearsed its first stage, the loss
falls, the planner's estimate and the emulated links' bytes are recorded, the tables and plots
are written. The figures themselves
(which method is faster, by how much) are the benchmark's to report, not asserted here.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).parents[2]
STEPS = 20


def test_the_quick_experiment_trains_both_methods_to_the_end(tmp_path):
    out, plots = tmp_path / "quick.json", tmp_path / "plots"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.testbed", "--quick", "--steps", str(STEPS),
         "--json", str(out), "--plots", str(plots)],
        cwd=ROOT, capture_output=True, text=True, timeout=560, check=False,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-5000:])
    report = json.loads(out.read_text())
    (topology,) = report["topologies"]
    assert topology["topology"] == "mini"
    assert [r["method"] for r in topology["runs"]] == ["naive", "opfence"]
    for run in topology["runs"]:
        assert "error" not in run, run
        assert set(run["exit_codes"].values()) == {0}, run["exit_codes"]
        assert len(run["curve"]) == run["steps"] == STEPS
        losses = [loss for _, loss in run["curve"]]
        assert all(math.isfinite(x) for x in losses)
        assert run["last5_loss"] < sum(losses[:5]) / 5, losses  # it learns
        assert run["tokens_per_s"] > 0
        assert run["estimate_s"] > 0
        assert run["plan"]
        assert run["plan_steps"] > 0
        assert run["wire"], "no emulated link carried the run's tensors"
        # every host the plan seats trained (none left in backup by a view difference)
        assert set(run["node_steps"]) == {"n1", "n2", "home"}
        seated = {host for stage in run["plan"] for host in stage}
        assert all(run["node_steps"][h] > 0 for h in seated), (run["plan"], run["node_steps"])
        assert run["status_s"]["call"] > 0  # the mid-run `fusionllm status`, timed
        # every node rehearsed its first stage at start and began from that stretch
        assert set(run["rehearsed"]) == {"n1", "n2", "home"}
        assert all(1.0 <= v <= 64.0 for v in run["rehearsed"].values()), run["rehearsed"]
        # every host's CPU after the warm-up; the seated ones' training threads, per step
        assert set(run["host_cpu"]) == {"n1", "n2", "home"}
        for host in seated:
            cpu = run["host_cpu"][host]
            assert cpu["cores"] > 0, (host, cpu)
            assert cpu["cpu_per_step_s"] > 0, (host, cpu)
            assert 0 <= cpu["throttled"] <= 1, (host, cpu)
            # its node's main thread (the epoch loop) runs beside the training: some CPU
            assert 0 <= cpu["main_thread_per_step_s"] < cpu["cpu_per_step_s"], (host, cpu)
            assert 0 < run["busy_cpu_s"][host] <= run["step_cpu_s"][host], run
    assert "topology mini" in result.stdout
    assert "host CPU after the warm-up (mini" in result.stdout
    assert sorted(p.name for p in plots.iterdir()) == [
        "estimate_vs_measured.png", "loss_vs_time.png", "tokens_per_s.png"
    ]  # fmt: skip
