"""``benchmarks/gpu.py`` end to end on the CPU: the GPU check must not first fail on a GPU.

Its phases (each a child process with a time limit) at the smallest sizes: one process and 2
stage processes in bf16, the fp32 pipeline against one process, the table and the JSON.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(400)]

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "gpu.py"


def test_the_gpu_check_runs_every_phase_on_a_cpu(tmp_path) -> None:
    out = tmp_path / "gpu.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--models", "tiny", "--steps", "3",
         "--warmup", "1", "--fp32-steps", "2", "--threads", "1", "--seq-len", "16",
         "--micro-batch-size", "2", "--micro-batches", "2", "--no-daemons", "--json", str(out)],
        capture_output=True, text=True, timeout=360, check=False,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    report = json.loads(out.read_text())
    assert report["errors"] == {}
    assert set(report["phases"]) == {
        "env", "local/tiny/bf16", "pipeline/tiny/bf16", "local/tiny/fp32", "pipeline/tiny/fp32"
    }  # fmt: skip
    for phase, row in report["phases"].items():
        if phase != "env":
            assert row["tokens_per_s"] > 0, phase
            assert len(row["losses"]) == (3 if phase.endswith("bf16") else 2), phase
    assert report["fp32_equal"]["equal"], report["fp32_equal"]
    assert "fp32 pipeline vs one process: losses max |diff|" in result.stdout
    assert "tiny bf16: 2 processes / one process tokens/s = " in result.stdout
