"""``benchmarks/generate.py --quick`` end to end at one stage: a real serving node read by a
real client beside local generation, and the JSON the full run writes for the README."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "generate.py"
FIGURES = ("first_token_s", "token_ms_median", "token_ms_p90", "tokens_per_s", "x_local")


def test_the_quick_generation_benchmark_measures_every_configuration(tmp_path) -> None:
    out = tmp_path / "generate.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--stages", "1", "--rounds", "1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=200, check=False,
    )  # fmt: skip
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    report = json.loads(out.read_text())
    assert report["args"]["preset"] == "tiny"  # --quick's, the options given beside it won
    assert report["args"]["stage_counts"] == [1]
    assert report["model"]["blocks"] == 2
    assert report["model"]["parameters"] > 0
    (stages,) = report["results"]
    assert stages["hops"] == {"fp32": 1, "fp16": 1}
    assert set(stages["hop_ms"]) == {"fp32", "fp16"}
    assert 0 < stages["start_s"] < 200
    rows = stages["rows"]
    assert set(rows) == {"local", "fp32", "fp16"}
    for name, row in rows.items():
        assert all(row[f] > 0 for f in FIGURES), (name, row)
        assert row["token_ms_median"] <= row["token_ms_p90"], (name, row)
        assert len(row["ids"]) == 8, (name, row)
    assert rows["local"]["x_local"] == 1.0
    assert rows["fp32"]["ids"] == rows["local"]["ids"]  # greedy through the swarm = local
    assert rows["fp32"]["match"] == rows["fp32"]["prefix"] == 8
    assert "x local" in result.stdout  # the table
