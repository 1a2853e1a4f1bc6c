"""``fusionllm train --device cuda``'s path on a GPU: stage processes over the real transport.

Marked ``gpu``: skips, saying why, where torch sees no CUDA device (as in CI).
"""

import pytest
import torch

from fusionllm.node.pipeline.compute import Compute
from fusionllm.node.pipeline.launcher import run_swarm
from fusionllm.node.pipeline.local_train import train_local
from fusionllm.node.pipeline.train_config import TrainConfig

pytestmark = [
    pytest.mark.integration,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ATOL = 1e-4


def test_stage_processes_train_on_the_gpu_like_one_process(tmp_path) -> None:
    """``fusionllm train --device cuda``'s path: 2 stage processes over the real transport."""
    config = TrainConfig(stages=2, micro_batches=4, batch_size=2, seq_len=16, steps=4)
    result = run_swarm(config, workdir=tmp_path, device="cuda", start_timeout_s=120.0)
    reference = train_local(config, compute=Compute.of("cuda"))
    gap = max(abs(a - b) for a, b in zip(result.losses, reference.losses, strict=True))
    assert gap < ATOL, (result.losses, reference.losses)
    for name, value in reference.parameters.items():
        torch.testing.assert_close(result.parameters[name], value, atol=ATOL, rtol=0, msg=name)
    assert all(event["peak_device_bytes"] > 0 for event in result.done), result.done
