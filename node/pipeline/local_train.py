"""The reference: the same run in one process on the whole model, no pipeline.

What the pipeline must reproduce: same seeded init, same micro-batches, loss = mean over the
micro-batches of each one's mean token cross-entropy (and the same validation loss at the
same steps), gradients clipped by their global norm
(torch's ``clip_grad_norm_``), one AdamW step per step.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fusionllm.common.logs import get_logger
from fusionllm.dag.models.registry import language_model_loss
from fusionllm.node.pipeline.compute import Compute
from fusionllm.node.pipeline.data import TokenDataset
from fusionllm.node.pipeline.evaluation import is_eval_step
from fusionllm.node.pipeline.loss_scale import LossScale, unscale_or_zero
from fusionllm.node.pipeline.stage import build_adamw
from fusionllm.node.pipeline.train_config import TrainConfig, build_model, load_dataset

logger = get_logger(__name__)


@dataclass(frozen=True)
class LocalRun:
    losses: list[float]  # per step
    parameters: dict[str, torch.Tensor]  # canonical names (a tied parameter once), trained ones
    seconds: float  # wall time of the steps (no setup)
    eval_losses: dict[int, float] = field(default_factory=dict)  # step -> held-out loss before it


def train_local(
    config: TrainConfig,
    *,
    dataset: TokenDataset | None = None,
    on_step: Callable[[int, float], None] | None = None,
    compute: Compute | None = None,
) -> LocalRun:
    """``compute``: device and precision (default: CPU in the config's precision); parameters
    come back on the CPU either way. fp16 scales the loss as the pipeline does (loss_scale.py)."""
    dataset = load_dataset(config) if dataset is None else dataset
    compute = compute if compute is not None else Compute(precision=config.precision)
    model = build_model(config).to(compute.device)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]  # a fine-tune: the adapters
    optimizer = build_adamw(trained, config.optimizer, fused=compute.fused_optimizer)
    losses: list[float] = []
    scaler = LossScale() if compute.precision == "fp16" else None
    started = time.perf_counter()
    eval_losses: dict[int, float] = {}
    for step in range(config.steps):
        if is_eval_step(config, step):
            eval_losses[step] = _validation_loss(model, dataset, config, compute)
        scale = scaler.scale if scaler is not None else 1.0
        step_losses = []
        for mb in range(config.micro_batches):
            idx, targets = (
                t.to(compute.device, non_blocking=True)
                for t in dataset.batch(config.batch, step, mb)
            )  # (B, T) each
            with compute.autocast():
                logits = model(idx)  # (B, T, V)
                loss = language_model_loss(logits, targets)
            (loss.float() / config.micro_batches * scale).backward()
            step_losses.append(loss.detach())
        grads = [p.grad for p in trained if p.grad is not None]
        overflow = scaler is not None and unscale_or_zero(grads, scale)
        if not overflow and 0 < config.max_grad_norm < float("inf"):
            torch.nn.utils.clip_grad_norm_(trained, config.max_grad_norm)
        if not overflow:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.update(overflow)
        losses.append(sum(float(x) for x in step_losses) / config.micro_batches)
        if on_step is not None:
            on_step(step, losses[-1])
    compute.synchronize()
    seconds = time.perf_counter() - started
    parameters = {
        name: p.detach().to("cpu", copy=True)
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    return LocalRun(losses, parameters, seconds, eval_losses)


@torch.no_grad()
def _validation_loss(
    model: torch.nn.Module, dataset: TokenDataset, config: TrainConfig, compute: Compute
) -> float:
    """The mean loss over the validation micro-batches (evaluation.py), dropout off."""
    model.eval()
    try:
        total = 0.0
        for mb in range(config.micro_batches):
            idx, targets = (
                t.to(compute.device) for t in dataset.eval_batch(config.batch, mb)
            )  # (B, T) each
            with compute.autocast():
                logits = model(idx)  # (B, T, V)
            total += float(language_model_loss(logits.float(), targets))
        return total / config.micro_batches
    finally:
        model.train()
