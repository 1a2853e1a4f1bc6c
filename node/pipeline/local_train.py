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
from fusionllm.node.pipeline.data import TokenDataset
from fusionllm.node.pipeline.evaluation import is_eval_step
from fusionllm.node.pipeline.stage import build_adamw
from fusionllm.node.pipeline.train_config import TrainConfig, build_model, load_dataset

logger = get_logger(__name__)


@dataclass(frozen=True)
class LocalRun:
    losses: list[float]  # per step
    parameters: dict[str, torch.Tensor]  # canonical names (a tied parameter once)
    seconds: float  # wall time of the steps (no setup)
    eval_losses: dict[int, float] = field(default_factory=dict)  # step -> held-out loss before it


def train_local(
    config: TrainConfig,
    *,
    dataset: TokenDataset | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> LocalRun:
    dataset = load_dataset(config) if dataset is None else dataset
    model = build_model(config)
    model.train()
    optimizer = build_adamw(model.parameters(), config.optimizer)
    losses: list[float] = []
    started = time.perf_counter()
    eval_losses: dict[int, float] = {}
    for step in range(config.steps):
        if is_eval_step(config, step):
            eval_losses[step] = _validation_loss(model, dataset, config)
        total = 0.0
        for mb in range(config.micro_batches):
            idx, targets = dataset.batch(config.batch, step, mb)  # (B, T) each
            logits = model(idx)  # (B, T, V)
            loss = language_model_loss(logits, targets)
            (loss / config.micro_batches).backward()
            total += float(loss.detach())
        if 0 < config.max_grad_norm < float("inf"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total / config.micro_batches)
        if on_step is not None:
            on_step(step, losses[-1])
    seconds = time.perf_counter() - started
    parameters = {name: p.detach().clone() for name, p in model.named_parameters()}
    return LocalRun(losses, parameters, seconds, eval_losses)


@torch.no_grad()
def _validation_loss(model: torch.nn.Module, dataset: TokenDataset, config: TrainConfig) -> float:
    """The mean loss over the validation micro-batches (evaluation.py), dropout off."""
    model.eval()
    try:
        total = 0.0
        for mb in range(config.micro_batches):
            idx, targets = dataset.eval_batch(config.batch, mb)  # (B, T) each
            logits = model(idx)  # (B, T, V)
            total += float(language_model_loss(logits, targets))
        return total / config.micro_batches
    finally:
        model.train()
