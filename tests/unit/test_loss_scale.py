"""fp16's dynamic loss scale: the pure rule, and a pipeline whose stages skip a step together."""

import pytest
import torch

from fusionllm.common.errors import ConfigError
from fusionllm.node.errors import PipelineError
from fusionllm.node.pipeline.compute import Compute
from fusionllm.node.pipeline.data import TokenDataset
from fusionllm.node.pipeline.local_train import train_local
from fusionllm.node.pipeline.loss_scale import (
    LossScale,
    LossScaleConfig,
    ScaleState,
    unscale_or_zero,
)
from fusionllm.node.pipeline.mailbox import Role
from fusionllm.node.pipeline.summary import SUMMARY_LEN, Summary, combine
from fusionllm.node.pipeline.train_config import TrainConfig
from tests.support.pipeline_threads import ThreadSwarm

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dataset() -> TokenDataset:
    return TokenDataset.from_stdlib(max_bytes=256 << 10)


def test_the_scale_halves_on_overflow_and_doubles_after_a_run_of_good_steps() -> None:
    scale = LossScale(LossScaleConfig(init_scale=8.0, growth_interval=3))
    scale.update(False)
    scale.update(False)
    assert scale.scale == 8.0
    scale.update(True)  # an overflow resets the run of good steps
    assert (scale.scale, scale.good_steps) == (4.0, 0)
    for _ in range(3):
        scale.update(False)
    assert scale.scale == 8.0
    floor = LossScale(LossScaleConfig(init_scale=1.0))
    floor.update(True)
    assert floor.scale == 1.0  # never below 1
    with pytest.raises(ConfigError, match="power of two"):
        LossScaleConfig(init_scale=3.0)
    with pytest.raises(ConfigError, match="growth_interval"):
        LossScaleConfig(growth_interval=0)


def test_unscale_or_zero_divides_or_zeroes_everything() -> None:
    grads = [torch.full((3,), 8.0), torch.full((2, 2), -4.0)]
    assert unscale_or_zero(grads, 4.0) is False
    assert grads[0].tolist() == [2.0, 2.0, 2.0]
    assert grads[1].flatten().tolist() == [-1.0] * 4
    for bad in (float("inf"), float("nan")):
        grads = [torch.ones(3), torch.ones(2)]
        grads[1][0] = bad
        assert unscale_or_zero(grads, 4.0) is True
        assert all(bool((g == 0).all()) for g in grads)  # finite again: sendable to peers


def test_the_summary_carries_the_overflow_and_refuses_a_bad_flag() -> None:
    parts = [Summary(1.0, 2.0, 1, 0.5), Summary(2.0, 3.0, 1, 0.25, overflow=True)]
    for part in parts:
        assert Summary.from_tensor(part.to_tensor(), step=0, sender="x") == part
    totals = combine(parts)
    assert (totals.sq, totals.loss_sum, totals.loss_count) == (3.0, 5.0, 2)
    assert totals.votes == (0.5, 0.25)
    assert totals.overflow
    assert not combine(parts[:1]).overflow
    bad = parts[0].to_tensor()
    bad[4] = 0.5
    with pytest.raises(PipelineError, match=r"step 3: bad summary .* from x"):
        Summary.from_tensor(bad, step=3, sender="x")
    assert len(bad) == SUMMARY_LEN


@pytest.mark.parametrize(
    ("scale", "good"), [(3.0, 0), (0.5, 0), (2.0**121, 0), (float("nan"), 0), (4.0, -1), (4.0, 0.5)]
)
def test_a_scale_state_from_a_file_or_a_peer_is_checked(scale, good) -> None:
    with pytest.raises(ValueError, match=r"loss scale|good steps"):
        ScaleState.checked(scale, good)


def test_a_restored_scale_continues_where_it_was_saved() -> None:
    saved = LossScale(LossScaleConfig(growth_interval=3))
    for overflow in (False, False, False, True, False, False):
        saved.update(overflow)
    restored = LossScale(LossScaleConfig(growth_interval=3))
    restored.restore(ScaleState.checked(*saved.state()))
    assert restored.state() == saved.state() == ScaleState(2.0**16, 2)
    restored.update(False)  # the third good step in a row: doubles, as the saved one would
    assert restored.scale == 2.0**17


def _config(**overrides) -> TrainConfig:
    base = dict(stages=3, micro_batches=4, batch_size=2, seq_len=16, steps=4, lr=3e-3,
                precision="fp16")  # fmt: skip
    base.update(overrides)
    return TrainConfig(**base)


@pytest.mark.parametrize("halves", [(), (True, True)])
def test_an_fp16_pipeline_follows_one_fp16_process(dataset, halves) -> None:
    """Also with half links: the loss-scaled gradients travel as scaled float16."""
    config = _config(activation_halves=halves, gradient_halves=halves)
    reference = train_local(config, dataset=dataset)
    swarm = ThreadSwarm.trained(config, dataset, compute=Compute(precision="fp16"))
    assert swarm.errors() == {}
    losses = swarm.losses()
    assert losses[-1] < losses[0]
    assert max(abs(a - b) for a, b in zip(losses, reference.losses, strict=True)) < 2e-3
    for run in swarm.results.values():
        assert [r.loss_scale for r in run.reports] == [2.0**16] * config.steps
        assert not any(r.skipped for r in run.reports)


@pytest.mark.parametrize("where", ["parameter", "link"])
def test_an_overflow_on_one_stage_skips_the_step_on_every_stage(dataset, where) -> None:
    """One stage sees an inf in step 1, in a parameter's gradient (the middle stage) or in the
    gradient it sends on (the last stage: it sends zeros instead, peers refuse non-finite
    frames): every stage skips step 1, halves the scale, and applies the other steps."""
    config = _config()
    swarm = ThreadSwarm(config, dataset, compute=Compute(precision="fp16"))
    worker = swarm.runners[Role(1, 0) if where == "parameter" else Role(2, 0)].worker
    backward = worker.backward

    def overflowing(step, micro_batch, output_grads=None):
        grads = backward(step, micro_batch, output_grads)
        if step == 1 and micro_batch == 0:
            if where == "parameter":
                next(iter(worker.parameters.values())).grad.view(-1)[0] = float("inf")
            else:
                next(iter(grads.values())).view(-1)[0] = float("inf")
        return grads

    worker.backward = overflowing
    try:
        swarm.run()
    finally:
        swarm.close()
    assert swarm.errors() == {}
    for role, run in swarm.results.items():
        assert [r.skipped for r in run.reports] == [False, True, False, False], role
        scales = [r.loss_scale for r in run.reports]
        assert scales == [2.0**16, 2.0**16, 2.0**15, 2.0**15], role
        states = swarm.runners[role].worker.optimizer.state.values()
        assert {int(state["step"]) for state in states} == {3}, role  # 4 steps, 1 skipped
