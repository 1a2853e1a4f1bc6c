"""Stages on a CUDA device: the checks of ``test_compute.py`` where tensors really move.

Marked ``gpu``; every test skips, saying why, where torch sees no CUDA device (as in CI).
Run them on a GPU machine with ``python -m pytest -m gpu tests/unit/test_compute_gpu.py``.
"""

import time

import pytest
import torch

from fusionllm.common.errors import ConfigError
from fusionllm.compression import Float16Codec, decode_frame, pack_tensor, parse_frame
from fusionllm.node.pipeline.busy import compute_clock
from fusionllm.node.pipeline.compute import Compute, Staging, resolve_device
from fusionllm.node.pipeline.data import TokenDataset
from fusionllm.node.pipeline.local_train import train_local
from fusionllm.node.pipeline.train_config import TrainConfig
from tests.support.pipeline_threads import ThreadSwarm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ATOL = 1e-4  # the bar on a GPU (fp32, no TF32: torch's matmul default)


@pytest.fixture(scope="module")
def dataset() -> TokenDataset:
    return TokenDataset.from_stdlib(max_bytes=256 << 10)


def _config(**overrides) -> TrainConfig:
    base = dict(stages=3, micro_batches=4, batch_size=2, seq_len=16, steps=3, max_grad_norm=0.5)
    base.update(overrides)
    return TrainConfig(**base)


def test_cuda_names_resolve_to_devices_that_exist() -> None:
    count = torch.cuda.device_count()
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device(f"cuda:{count - 1}") == torch.device("cuda", count - 1)
    with pytest.raises(ConfigError, match=f"only {count} CUDA device"):
        resolve_device(f"cuda:{count}")


def test_staging_reuses_pinned_buffers_and_keeps_every_frame_intact() -> None:
    compute = Compute.of("cuda")
    staging = Staging(compute)
    on_device = torch.arange(1000, dtype=torch.float32, device=compute.device)  # (N,)
    first = staging.to_host("out", on_device)
    assert first.is_pinned()
    torch.testing.assert_close(first, on_device.cpu(), atol=0, rtol=0)
    second = staging.to_host("out", on_device * 2)
    assert second.data_ptr() == first.data_ptr()  # one buffer per key, no allocation per frame
    torch.testing.assert_close(second, (on_device * 2).cpu(), atol=0, rtol=0)
    # Frames overwrite one pinned buffer in turn: each device copy must hold its own frame.
    frames = [torch.full((1 << 20,), float(i)) for i in range(8)]
    copies = [staging.to_device("in", frame) for frame in frames]
    for i, copy in enumerate(copies):
        assert copy.device == compute.device
        assert bool((copy == i).all()), f"frame {i} was overwritten by a later one"


def test_a_pinned_frame_goes_to_the_device_in_one_copy_and_survives_buffer_reuse() -> None:
    """The transport of a CUDA node decodes into pinned memory (pin_decoded): the frame's one
    host copy; Staging sends it on without another. The host tensor is dropped at once and
    the receive buffer overwritten, as the next frames do: every device copy must still hold
    its own frame (torch's pinned cache waits for the copy's event before reusing the block)."""
    staging = Staging(Compute.of("cuda"))
    copies, expected = [], []
    for i in range(8):
        codec = Float16Codec(torch.float16) if i % 2 else None
        body = bytearray(pack_tensor(torch.full((1 << 20,), float(i) * 1e6), codec))
        # float16 links round (1e6 arrives as 999936): the reference is the same bytes decoded
        # into ordinary memory, before the buffer is overwritten
        expected.append(decode_frame(parse_frame(memoryview(bytes(body)))))  # (N,)
        host = decode_frame(parse_frame(memoryview(body)), pin_memory=True)  # (N,)
        assert host.is_pinned()
        copies.append(staging.to_device(("activation", 0), host))
        del host
        body[:] = bytes(len(body))
    assert staging.staged == 0  # no staging copy: the decoded tensor itself went over
    for i, (copy, want) in enumerate(zip(copies, expected, strict=True)):
        assert copy.device.type == "cuda"
        assert bool(want.ne(0).all() or i == 0), f"frame {i}'s reference decoded to zeros"
        torch.testing.assert_close(
            copy.cpu(), want, atol=0, rtol=0, msg=f"frame {i} was overwritten"
        )


def test_a_cuda_pipelines_frames_arrive_pinned_and_are_never_staged(dataset) -> None:
    config = _config(activation_halves=(True, True), gradient_halves=(True, True))
    swarm = ThreadSwarm.trained(config, dataset, compute=Compute.of("cuda"))
    assert swarm.errors() == {}
    assert {role: runner.staging.staged for role, runner in swarm.runners.items()} == {
        role: 0 for role in swarm.runners
    }
    reference = train_local(config, dataset=dataset, compute=Compute.of("cuda"))
    gap = max(abs(a - b) for a, b in zip(swarm.losses(), reference.losses, strict=True))
    assert 0 < gap < 1e-2, (swarm.losses(), reference.losses)  # float16 links round a little


def test_a_cuda_pipeline_matches_one_cuda_process(dataset) -> None:
    config = _config(replicas=(1, 2, 1))
    compute = Compute.of("cuda")
    reference = train_local(config, dataset=dataset, compute=compute)
    swarm = ThreadSwarm.trained(config, dataset, compute=compute)
    assert swarm.errors() == {}
    for runner in swarm.runners.values():
        assert {p.device.type for p in runner.worker.parameters.values()} == {"cuda"}
        states = runner.worker.optimizer.state.values()
        assert {s["exp_avg"].device.type for s in states} == {"cuda"}
    losses = swarm.losses()
    assert max(abs(a - b) for a, b in zip(losses, reference.losses, strict=True)) < ATOL
    params = swarm.parameters()
    for name, value in reference.parameters.items():
        torch.testing.assert_close(params[name], value, atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_half_precision_cuda_pipeline_follows_one_cuda_process(dataset, precision) -> None:
    """Autocast on the GPU; fp16 with the pipeline's loss scale (loss_scale.py)."""
    config = _config(precision=precision, lr=3e-3)
    compute = Compute.of("cuda", precision)
    reference = train_local(config, dataset=dataset, compute=compute)
    swarm = ThreadSwarm.trained(config, dataset, compute=compute)
    assert swarm.errors() == {}
    gap = max(abs(a - b) for a, b in zip(swarm.losses(), reference.losses, strict=True))
    assert gap < 2e-3, (swarm.losses(), reference.losses)
    skipped = {role: [r.skipped for r in run.reports] for role, run in swarm.results.items()}
    assert len(set(map(tuple, skipped.values()))) == 1, skipped  # every stage skips alike


def test_busy_time_counts_the_kernels_not_their_launches():
    """A chain of large matmuls returns to the host long before the GPU finishes them: the
    events' time is the kernels', so it covers the synchronised wall time, not the launch."""
    compute = Compute.of("cuda")
    clock = compute_clock(compute)
    a = torch.randn(4096, 4096, device=compute.device)
    torch.cuda.synchronize()
    began = time.perf_counter()
    mark = clock.start()
    for _ in range(20):
        a = a @ a / 64.0
    assert clock.stop(mark) == 0.0
    launched = time.perf_counter() - began
    busy = clock.settle(0.0)
    finished = time.perf_counter() - began
    assert busy > 0.5 * finished, (busy, launched, finished)
    assert busy > launched
