"""A node as its user runs it: the control plane, and the training its adopted plan drives.

The thin composition DESIGN.md asks for: ``control/`` (the daemon) and ``pipeline/`` (the
runtime, through ``training/``) never import each other; this module builds both on the node's
one py-libp2p host and hands the daemon's adopted plan to the trainer through ``DaemonView``.
"""

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from fusionllm.common.logs import get_logger
from fusionllm.common.run_spec import STDLIB_VOCAB, RunSpec
from fusionllm.dag import OpGraph, trace
from fusionllm.dag.models import gpt2
from fusionllm.dag.planner import Plan
from fusionllm.dht.records import TrainingProgress
from fusionllm.node.control.daemon import NodeConfig, NodeDaemon
from fusionllm.node.p2p.framing import FrameHeader
from fusionllm.node.p2p.transport import TensorSpec, Transport, TransportConfig
from fusionllm.node.pipeline.data import TokenDataset
from fusionllm.node.pipeline.train_config import TrainConfig, build_model, load_dataset
from fusionllm.node.training.trainer import SwarmTrainer, TrainerConfig

logger = get_logger(__name__)

# Seeded init draws from torch's global generator and torch.fx patches globals while it
# traces: two builds in one process (tests run several trainers as threads) must not
# interleave, or their weights differ or a trace breaks.
_ONE_BUILD_AT_A_TIME = threading.Lock()
_NEVER = TensorSpec(dtype=torch.float32, shape=(-1,))


class DaemonView:
    """What the trainer may see of the daemon (``training.trainer.SwarmView``)."""

    def __init__(self, daemon: NodeDaemon) -> None:
        self._daemon = daemon

    def adopted(self) -> tuple[str, Plan] | None:
        adopted = self._daemon.adopted
        return (adopted.digest, adopted.plan) if adopted is not None else None

    def addrs(self, peer: str) -> list[str]:
        info = self._daemon.members.get(peer)
        return list(info.addrs) if info is not None else []

    def is_member(self, peer: str) -> bool:
        return peer in self._daemon.members

    def publish(self, replica: int | None, step: int, loss: float | None, finished: bool) -> None:
        if loss is not None and not (math.isfinite(loss) and 0 <= loss <= 1e6):
            loss = None  # a diverged run still reports its step; the record refuses NaN
        self._daemon.progress = TrainingProgress(replica, step, loss, finished)

    def run_finished(self) -> bool:
        return self._daemon.run_finished

    def members(self) -> list[str]:
        return sorted(self._daemon.members)

    def progress(self) -> int:
        records = list(self._daemon.members.values())
        return max((i.training.step for i in records if i.training is not None), default=0)


@dataclass(frozen=True, kw_only=True)
class SwarmNodeConfig:
    node: NodeConfig
    work_dir: Path
    step_timeout_s: float = 60.0
    checkpoint_pause_s: float = 0.0  # fault injection: sleep between a write and its rename
    train: bool = True  # False: the control plane alone (tests and benchmarks of it)

    @property
    def run(self) -> RunSpec:
        return self.node.settings.run


def build_workload(run: RunSpec) -> tuple[OpGraph, TokenDataset]:
    """The run's seeded model traced at the micro-batch shape, and the corpus: the same in
    every node (seconds of CPU: done when a node first serves, not at start)."""
    config = TrainConfig.for_run(run, cuts=(), replicas=(1,))
    example = torch.zeros(run.micro_batch_size, run.seq_len, dtype=torch.int64)  # (B, T)
    with _ONE_BUILD_AT_A_TIME:
        model = build_model(config)
        graph = trace(model, (example,), meta=False)
    return graph, load_dataset(config)


def parameter_shapes(run: RunSpec) -> dict[str, tuple[int, ...]]:
    """Every canonical parameter's shape, from a model that allocates nothing."""
    with torch.device("meta"):
        model = gpt2(run.model, vocab_size=STDLIB_VOCAB)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def run_node(
    config: SwarmNodeConfig,
    *,
    on_event: Callable[[dict], None],
    duration_s: float | None = None,
    stop: threading.Event | None = None,
) -> bool:
    """Join, train what the swarm's plan asks, leave; True if the run reached its end."""
    daemon = NodeDaemon(config.node, on_event=on_event)
    trainer: SwarmTrainer | None = None
    transport: Transport | None = None

    def expect(header: FrameHeader) -> TensorSpec:
        return trainer.expect(header) if trainer is not None else _NEVER

    def admit(peer: str) -> bool:
        return trainer is not None and trainer.admits(peer)

    finished = threading.Event()
    try:
        daemon.start()
        if config.train:
            transport = Transport(
                TransportConfig(key_path=config.node.key_path, close_timeout_s=2.0),
                expect=expect,
                admit=admit,
                host=daemon.host,
            ).start()
            trainer = _trainer(config, daemon, transport, on_event).start()
            finished = trainer.finished
        watcher = threading.Thread(
            target=_stop_when, args=(daemon, trainer, finished, stop), daemon=True
        )
        watcher.start()
        daemon.run(duration_s=duration_s)
        return finished.is_set()
    finally:
        if trainer is not None:
            trainer.close()
        daemon.leave()
        if transport is not None:
            transport.close()
        daemon.close()


def _trainer(config: SwarmNodeConfig, daemon: NodeDaemon, transport, on_event) -> SwarmTrainer:
    return SwarmTrainer(
        TrainerConfig(
            run=config.run,
            work_dir=config.work_dir,
            step_timeout_s=config.step_timeout_s,
            checkpoint_every=config.node.settings.checkpoint_every,
            checkpoint_pause_s=config.checkpoint_pause_s,
        ),
        peer_id=daemon.peer_id,
        transport=transport,
        workload=lambda: build_workload(config.run),
        shapes=parameter_shapes(config.run),
        view=DaemonView(daemon),
        on_event=on_event,
    )


def _stop_when(daemon: NodeDaemon, trainer, finished: threading.Event, stop):
    """Stop the daemon when the run ends, or when asked: then the trainer first leaves
    politely (its step, its hand-over) while heartbeats still say we are here."""
    while not finished.wait(0.2):
        if stop is not None and stop.is_set():
            if trainer is not None:
                trainer.stop()
                trainer.wait_gone(2 * trainer.config.step_timeout_s + 35.0)
            break
    daemon.stop()
