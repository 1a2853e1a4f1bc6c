"""Device and precision on the CPU: --device parsing, bf16 training, staging, runners in bf16.

The same checks on a CUDA device are in ``test_compute_gpu.py`` (marked ``gpu``).
"""

import statistics

import pytest
import torch

from fusionllm.common.errors import ConfigError
from fusionllm.common.run_spec import RunSpec
from fusionllm.node.errors import PipelineError
from fusionllm.node.pipeline.compute import Compute, Staging, resolve_device
from fusionllm.node.pipeline.data import TokenDataset
from fusionllm.node.pipeline.local_train import train_local
from fusionllm.node.pipeline.stage import StageWorker
from fusionllm.node.pipeline.train_config import TrainConfig, build_layout, build_model
from tests.support.pipeline_threads import ThreadSwarm

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def dataset() -> TokenDataset:
    return TokenDataset.from_stdlib(max_bytes=256 << 10)


def test_device_names_resolve_or_are_refused_with_the_reason() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    expected_auto = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == expected_auto
    for bad in ("gpu", "cuda:x", "cuda:-1", "", "mps:0", "cpu:0"):
        with pytest.raises(ConfigError, match="device must be one of auto"):
            resolve_device(bad)


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    for name in ("cuda", "cuda:0", "cuda:3"):
        with pytest.raises(ConfigError, match="sees no CUDA device"):
            resolve_device(name)


def test_precision_is_validated_and_part_of_the_run() -> None:
    with pytest.raises(ConfigError, match="precision must be one of"):
        Compute(precision="fp8")
    with pytest.raises(ConfigError, match="precision must be one of"):
        RunSpec(precision="half")
    with pytest.raises(ConfigError, match="precision must be one of"):
        TrainConfig(precision="float16")
    # A run in another precision is another run: its lineage (and the settings digest) differ.
    assert RunSpec(precision="bf16").lineage() != RunSpec().lineage()
    config = TrainConfig.for_run(RunSpec(precision="bf16"), cuts=(), replicas=(1,))
    assert config.precision == "bf16"
    assert TrainConfig.from_json(config.to_json()) == config


def test_autocast_is_off_in_fp32_and_on_in_bf16() -> None:
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)  # (B, C)
    with Compute(precision="fp32").autocast():
        assert layer(x).dtype == torch.float32
    with Compute(precision="bf16").autocast():
        assert layer(x).dtype == torch.bfloat16


def test_staging_on_the_cpu_hands_tensors_through() -> None:
    staging = Staging(Compute())
    x = torch.randn(5)
    assert staging.to_host("k", x) is x
    assert staging.to_device("k", x) is x


def test_a_bf16_stage_keeps_fp32_master_weights_and_sends_fp32(dataset) -> None:
    config = TrainConfig(stages=2, micro_batches=1, batch_size=2, seq_len=16, precision="bf16")
    layout = build_layout(config, build_model(config))
    compute = Compute(precision="bf16")
    first = StageWorker(layout, 0, optimizer=config.optimizer, micro_batches=1, compute=compute)
    last = StageWorker(layout, 1, optimizer=config.optimizer, micro_batches=1, compute=compute)
    idx, targets = dataset.batch(config.batch, 0, 0)  # (B, T) each
    sent = first.forward(0, 0, {"idx": idx})
    flat = layout.links[0].pack(sent)
    assert flat.dtype == torch.float32  # the wire stays float32 until links carry halves
    loss = last.forward(0, 0, layout.links[0].unpack(flat), targets)["loss"]
    assert loss.dtype == torch.float32
    assert loss.shape == ()
    grads = last.backward(0, 0)
    first.backward(0, 0, grads)
    for worker in (first, last):
        assert {p.dtype for p in worker.parameters.values()} == {torch.float32}
        assert all(
            p.grad is not None and p.grad.dtype == torch.float32 for p in worker.parameters.values()
        )
    assert {g.dtype for g in grads.values()} == {torch.float32}


@pytest.mark.slow  # ~45 s: six runs of 200 steps
def test_bf16_on_cpu_trains_tiny_to_within_two_percent_of_fp32(dataset) -> None:
    """The issue's bar: 200 steps of GPT-2 tiny, the mean of the last 20 losses, averaged over
    seeds 0, 1 and 2. One seed is a coin toss: bf16 and fp32 runs part ways within a few steps,
    and with the per-parameter seeded init their gap measured +2.9%, -0.3% and +1.9% of fp32
    for seeds 0, 1, 2 (+1.6% on average)."""
    ends: dict[str, list[float]] = {"fp32": [], "bf16": []}
    for seed in (0, 1, 2):
        for precision in ("fp32", "bf16"):
            config = TrainConfig(
                stages=1, micro_batches=2, batch_size=4, seq_len=32, steps=200, lr=3e-3,
                precision=precision, seed=seed,
            )  # fmt: skip
            run = train_local(config, dataset=dataset)
            assert run.losses[-1] < run.losses[0] - 2.0, (precision, run.losses[0], run.losses[-1])
            ends[precision].append(statistics.mean(run.losses[-20:]))
    mean = {precision: statistics.mean(values) for precision, values in ends.items()}
    assert abs(mean["bf16"] - mean["fp32"]) <= 0.02 * mean["fp32"], ends
    assert ends["bf16"] != ends["fp32"], "bf16 computed exactly like fp32: autocast is not on"


def test_bf16_runners_match_one_bf16_process(dataset) -> None:
    """A cut converts bf16 activations to float32 and back, both exact, so the pipeline in bf16
    follows the one-process bf16 run closely (not to fp32's 1e-5: summation order differs
    inside bf16 kernels)."""
    config = TrainConfig(
        stages=3, micro_batches=4, batch_size=2, seq_len=16, steps=3, max_grad_norm=0.5,
        precision="bf16",
    )  # fmt: skip
    reference = train_local(config, dataset=dataset)
    fp32 = train_local(TrainConfig(**{**config.__dict__, "precision": "fp32"}), dataset=dataset)
    swarm = ThreadSwarm.trained(config, dataset, compute=Compute(precision="bf16"))
    assert swarm.errors() == {}
    losses = swarm.losses()
    gap = max(abs(a - b) for a, b in zip(losses, reference.losses, strict=True))
    assert gap < 2e-3, (losses, reference.losses)
    # ... and not merely fp32 under another name: bf16 moves the losses more than that.
    assert max(abs(a - b) for a, b in zip(reference.losses, fp32.losses, strict=True)) > gap


def test_a_runner_refuses_a_precision_other_than_the_runs(dataset) -> None:
    config = TrainConfig(stages=2, micro_batches=2, batch_size=2, seq_len=16, precision="bf16")
    with pytest.raises(PipelineError, match="the run computes in bf16, this process in fp32"):
        ThreadSwarm(config, dataset, compute=Compute(precision="fp32"))
