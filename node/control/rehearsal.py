"""Time a few real training steps of the run's first stage before the swarm plans anything.

A fresh swarm's first plan is made on the cost model alone (stretch.py measures a step's own
work only once a plan trains), and on topology B that model read 0.46-0.90 of the first
plan's steps (sessions 18-20). What it misses is partly the host: a whole-model step of the
testbed's run in a 0.45-core cgroup took 1.37-1.50x its device's figures scaled by the share,
and 0.93-1.05x unconfined (session 21). The quota's periods cost the CPU work itself ~35%
more (57 ms of thread CPU a step against 43): a probe that keeps its fastest short repeat
(probe.py) fits in one period and never sees it; steps sustained over many periods do.

So a node times its run's own work at its run's micro-batch shape: the first stage of the
model (the whole model where its parameters fit ``max_stage_bytes``; else the first of as
many compute-balanced stages as it takes), every micro-batch forward and backward, then the
clipped update, for ``seconds`` after one step of warm-up. What comes back is the stage's
extent and its wall time a step; the node sets that against its advertised device's model of
the same work (``stretch.rehearsed_stretch``) and publishes it as a provisional stretch until
its own steps measure one. Weights are a seeded draw: timing needs shapes, not a folder's
values. Runs in the facts child (facts_main.py), which has torch.
"""

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from fusionllm.common.errors import ConfigError
from fusionllm.dag.cuts import cut_problem
from fusionllm.dag.models import registry
from fusionllm.dag.models.materialise import SeededInit
from fusionllm.dag.tracing import trace
from fusionllm.node.control.stretch import Rehearsal
from fusionllm.node.pipeline.compute import Compute
from fusionllm.node.pipeline.layout import PipelineLayout, balanced_cuts
from fusionllm.node.pipeline.stage import OptimizerConfig, StageWorker


@dataclass(frozen=True, kw_only=True)
class RehearsalConfig:
    seconds: float = 1.5  # timed, after the warm-up step: ~15 CFS periods of 100 ms
    batch: int = 1  # sequences per micro-batch (the run's)
    seq_len: int = 64
    micro_batches: int = 1
    max_stage_bytes: int = 256 << 20  # the rehearsed stage's parameters, float32

    def __post_init__(self) -> None:
        if not 0 < self.seconds <= 60:
            raise ConfigError(f"seconds must be in (0, 60], got {self.seconds}")
        for name in ("batch", "seq_len", "micro_batches"):
            if not 1 <= getattr(self, name) <= 1 << 16:
                raise ConfigError(f"{name} must be in [1, 65536], got {getattr(self, name)}")
        if self.max_stage_bytes < 1 << 20:
            raise ConfigError(f"max_stage_bytes must be >= 1 MiB, got {self.max_stage_bytes}")


def rehearse(architecture: Any, config: RehearsalConfig, compute: Compute) -> Rehearsal:
    """Time ``config.seconds`` of training steps of the first stage of ``architecture`` (a
    registry config) on ``compute``."""
    with torch.device("meta"):
        model = registry.build(architecture)
    example = registry.example_input(config.batch, config.seq_len)  # (B, T)
    graph = trace(model, (example,), meta=True)
    parameter_bytes = sum(p.numel() for p in model.parameters()) * 4
    cuts = sum(cut_problem(graph, c) is None for c in range(1, len(graph.node_ids)))
    stages = min(cuts + 1, max(1, math.ceil(parameter_bytes / config.max_stage_bytes)))
    layout = PipelineLayout(graph, balanced_cuts(graph, stages) if stages > 1 else ())
    worker = StageWorker(
        layout, 0, optimizer=OptimizerConfig(), micro_batches=config.micro_batches,
        compute=compute, weights=SeededInit(architecture, 0),
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, architecture.vocab_size, (config.batch, config.seq_len + 1),
                        generator=generator)  # (B, T + 1)  # fmt: skip
    inputs = {layout.graph.input_names[0]: ids[:, :-1]}
    targets = ids[:, 1:]  # (B, T)
    _step(worker, 0, inputs, targets)  # warm-up: allocations, the optimizer's state
    compute.synchronize()
    steps, started = 0, time.perf_counter()
    while True:
        steps += 1
        _step(worker, steps, inputs, targets)
        compute.synchronize()
        elapsed = time.perf_counter() - started
        if elapsed >= config.seconds:
            break
    return Rehearsal(
        stop=len(layout.stages[0]), batch=config.batch, micro_batches=config.micro_batches,
        steps=steps, step_s=float(elapsed / steps),
    )  # fmt: skip


def _step(
    worker: StageWorker, step: int, inputs: dict[str, torch.Tensor], targets: torch.Tensor
) -> None:
    """One step as the runner does it: every micro-batch forward and backward (the gradients
    of a cut's values drawn at random), then the clipped update."""
    for mb in range(worker.micro_batches):
        out = worker.forward(step, mb, inputs, targets if worker.is_last else None)
        grads = None if worker.is_last else {k: torch.randn_like(v) for k, v in out.items()}
        worker.backward(step, mb, grads)
    worker.clip_and_step(math.sqrt(worker.local_grad_sq_norm()))
