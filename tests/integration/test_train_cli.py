"""``fusionllm train``: a local swarm of stage processes, run as a user would."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_train_prints_progress_and_leaves_no_process(precision, tmp_path) -> None:
    config = tmp_path / "train.toml"  # some options from a file and the environment
    config.write_text("stages = 2\nsteps = 3\nmicro-batches = 2\n")
    env = {**os.environ, "FUSIONLLM_MICRO_BATCH_SIZE": "2", "FUSIONLLM_JSON": "true"}
    result = subprocess.run(
        [sys.executable, "-m", "fusionllm.node.cli.main", "--log-level", "WARNING", "train",
         "--config", str(config), "--seq-len", "16", "--precision", precision,
         "--device", "cpu"],
        capture_output=True, text=True, timeout=100, check=False, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    steps = [json.loads(line) for line in result.stdout.splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert all(s["loss"] > 0 and s["tokens_per_s"] > 0 for s in steps)


def test_train_rejects_a_bad_configuration() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fusionllm.node.cli.main", "train", "--stages", "2",
         "--replicas", "1", "2", "3"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert "replicas" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize(
    "command", [["train"], ["node", "--key", "KEY"], ["swarm", "--work-dir", "WORK"]]
)
def test_a_gpu_that_is_not_here_is_one_clear_error(tmp_path, command) -> None:
    argv = [str(tmp_path / a) if a in ("KEY", "WORK") else a for a in command]
    result = subprocess.run(
        [sys.executable, "-m", "fusionllm.node.cli.main", *argv, "--device", "cuda:0"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    expected = f"fusionllm {command[0]}: error: device 'cuda:0' asked for, but this torch sees no"
    assert expected in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
