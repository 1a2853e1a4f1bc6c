"""A stage process that dies mid-run fails the whole run promptly and leaves no process."""

import os
import time

import psutil
import pytest

from fusionllm.node.errors import PipelineError
from fusionllm.node.pipeline.launcher import run_swarm
from fusionllm.node.pipeline.train_config import TrainConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _stage_processes() -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(os.getpid()).children(recursive=True)
        if "fusionllm.node.pipeline.stage_main" in " ".join(p.cmdline())
    ]


def test_a_dead_stage_fails_the_run_and_every_process_is_reaped(tmp_path) -> None:
    config = TrainConfig(stages=3, micro_batches=2, batch_size=2, seq_len=16, steps=500)
    killed: list[int] = []

    def kill_the_middle_stage(event: dict) -> None:
        if event["step"] == 3 and not killed:
            (middle,) = [p for p in _stage_processes() if "--stage 1" in " ".join(p.cmdline())]
            killed.append(middle.pid)
            middle.kill()

    started = time.monotonic()
    with pytest.raises(PipelineError, match=r"exited early|failed"):
        run_swarm(config, workdir=tmp_path, step_timeout_s=10, on_step=kill_the_middle_stage)
    assert killed
    assert time.monotonic() - started < 90
    assert _stage_processes() == []
