"""Which clock times a stage's compute (node/pipeline/busy.py): the wall clock on a CPU, CUDA
events on a GPU (tests/unit/test_compute_gpu.py checks the events where a GPU exists)."""

import time

import torch

from fusionllm.node.pipeline.busy import CudaEventClock, WallClock, compute_clock
from fusionllm.node.pipeline.compute import Compute


def test_a_cpu_stage_keeps_the_wall_clock():
    assert type(compute_clock(Compute())) is WallClock
    assert type(compute_clock(Compute(device=torch.device("cpu"), precision="bf16"))) is WallClock


def test_a_cuda_stage_is_timed_by_events_on_its_device():
    # Choosing needs no GPU: no event is made before the first call is timed.
    for device in ("cuda", "cuda:1"):
        clock = compute_clock(Compute(device=torch.device(device)))
        assert type(clock) is CudaEventClock
        assert clock._device == torch.device(device)
        assert clock.settle(0.0) == 0.0  # nothing timed this step


def test_the_wall_clock_counts_each_call_at_once():
    clock = WallClock()
    mark = clock.start()
    time.sleep(0.01)
    took = clock.stop(mark)
    assert took >= 0.009
    assert clock.settle(took + 1.0) == took + 1.0  # the caller's sum, unchanged
