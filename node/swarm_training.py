"""The training half of a node: its tensor transport and its trainer, on the daemon's host.

Imported by ``swarm_node.run_node`` only for a node that trains: this is where torch comes in.
The trainer sees the daemon through ``DaemonView`` (``training.trainer_config.SwarmView``).
"""

import math
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from fusionllm.common.logs import get_logger
from fusionllm.common.run_spec import RunSpec
from fusionllm.dag import OpGraph
from fusionllm.dag.models import registry
from fusionllm.dag.models.hf_tensors import CONFIG, MAX_CONFIG_BYTES, read_json
from fusionllm.dag.planner import Plan
from fusionllm.dht.records import TrainingProgress
from fusionllm.node.control.daemon import NodeDaemon
from fusionllm.node.p2p.framing import FrameHeader
from fusionllm.node.p2p.lane.prober import LaneProber
from fusionllm.node.p2p.reachability import punch_ip
from fusionllm.node.p2p.transport import TensorSpec, Transport
from fusionllm.node.pipeline.compute import pins_frames
from fusionllm.node.pipeline.data import DataError, TokenDataset
from fusionllm.node.pipeline.train_config import (
    TrainConfig,
    build_model,
    load_dataset,
    model_config,
    trace_micro_batch,
)
from fusionllm.node.swarm_config import SwarmNodeConfig
from fusionllm.node.training.export import lora_record, write_model_config
from fusionllm.node.training.trainer import SwarmTrainer, TrainerConfig

logger = get_logger(__name__)

# Seeded init draws from torch's global generator and torch.fx patches globals while it
# traces: two builds in one process (tests run several trainers as threads) must not
# interleave, or their weights differ or a trace breaks.
_ONE_BUILD_AT_A_TIME = threading.Lock()
_NEVER = TensorSpec(dtype=torch.float32, shape=(-1,))
_UNMEASURED_BYTES_PER_S = 12.5e6  # 100 Mbit/s: a link we know nothing of


class DaemonView:
    """What the trainer may see of the daemon (``training.trainer_config.SwarmView``)."""

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

    def publish(
        self,
        replica: int | None,
        step: int,
        loss: float | None,
        finished: bool,
        evaluation: tuple[int, float] | None = None,
    ) -> None:
        if loss is not None and not (math.isfinite(loss) and 0 <= loss <= 1e6):
            loss = None  # a diverged run still reports its step; the record refuses NaN
        if evaluation is not None and not (
            math.isfinite(evaluation[1]) and 0 <= evaluation[1] <= 1e6
        ):
            evaluation = None
        self._daemon.progress = TrainingProgress(replica, step, loss, finished, evaluation)

    def run_finished(self) -> bool:
        return self._daemon.run_finished

    def members(self) -> list[str]:
        return sorted(self._daemon.members)

    def progress(self) -> int:
        records = list(self._daemon.members.values())
        return max((i.training.step for i in records if i.training is not None), default=0)

    def measured(self, digest: str, compute_s: float, own_s: float) -> None:
        self._daemon.measured(digest, compute_s, own_s)

    def witnessed(self, digest: str, ranks: list[tuple[str, int]], timings: list) -> None:
        self._daemon.witnessed(digest, ranks, timings)

    def suspect(self, peer: str, reason: str) -> None:
        self._daemon.suspect(peer, reason)

    def cleared(self, peer: str) -> None:
        self._daemon.cleared(peer)

    def link_bytes_per_s(self, peer: str) -> float:
        daemon = self._daemon
        measured = daemon.book.towards(daemon.peer_id, time.time(), sources={peer})
        info = daemon.members.get(peer)
        return max(measured, default=info.uplink if info is not None else _UNMEASURED_BYTES_PER_S)

    def send_bytes_per_s(self, peer: str) -> float:
        daemon = self._daemon
        measured = daemon.book.towards(peer, time.time(), sources={daemon.peer_id})
        info = daemon.members.get(daemon.peer_id)
        return max(measured, default=info.uplink if info is not None else _UNMEASURED_BYTES_PER_S)


def build_workload(
    run: RunSpec, data_path: Path | None = None, data_dtype: str | None = None
) -> tuple[OpGraph, TokenDataset]:
    """The run's model, on meta, traced at the micro-batch shape, and the corpus: the same in
    every node (seconds of CPU: done when a node first serves, not at start). A corpus whose
    digest is not the run's (the file changed since the node started) is refused."""
    config = TrainConfig.for_run(
        run,
        cuts=(),
        replicas=(1,),
        data_path=None if data_path is None else str(data_path),
        data_dtype=data_dtype,
    )
    example = registry.example_input(run.micro_batch_size, run.seq_len)  # (B, T)
    with _ONE_BUILD_AT_A_TIME:
        # On meta: the graph needs shapes only; a session makes its stage's parameters real.
        graph = trace_micro_batch(build_model(config, meta=True), example)
    dataset = load_dataset(config)
    if run.data_digest and dataset.digest != run.data_digest:
        raise DataError(
            f"{dataset.source} has digest {dataset.digest[:16]}, the run's data "
            f"{run.data_digest[:16]}: it changed since this node started"
        )
    return graph, dataset


def parameter_shapes(run: RunSpec) -> dict[str, tuple[int, ...]]:
    """Every trained canonical parameter's shape (a fine-tune's: the adapters), from the run's
    model built on meta (no memory, no weights read)."""
    with _ONE_BUILD_AT_A_TIME, torch.device("meta"):
        model = build_model(TrainConfig.for_run(run, cuts=(), replicas=(1,)), meta=True)
    return {name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}


def start_training(
    config: SwarmNodeConfig, daemon: NodeDaemon, on_event: Callable[[dict], None]
) -> tuple[Transport, SwarmTrainer]:
    """The node's transport (admitting only what the trainer expects) and its started trainer."""
    trainer: SwarmTrainer | None = None
    # What ``fusionllm export`` reads this work dir's parameters and checkpoints back with.
    train_config = TrainConfig.for_run(config.run, cuts=(), replicas=(1,))
    source = config.run.model_dir
    like = read_json(Path(source) / CONFIG, limit=MAX_CONFIG_BYTES) if source else None
    lora = train_config.lora
    lora = None if lora is None else lora_record(lora, config.run.seed, source)
    lineage = config.run.lineage()
    write_model_config(config.work_dir, model_config(train_config), lineage, like=like, lora=lora)

    def expect(header: FrameHeader) -> TensorSpec:
        return trainer.expect(header) if trainer is not None else _NEVER

    def admit(peer: str) -> bool:
        return trainer is not None and trainer.admits(peer)

    transport = Transport(
        replace(config.node.transport_config(), pin_decoded=pins_frames(config.device)),
        expect=expect,
        admit=admit,
        host=daemon.host,
        public_ip=lambda: punch_ip(daemon.reach.current) if daemon.reach is not None else None,
    ).start()
    daemon.wire_samples = transport.lane_senders.wire_samples
    # Opens a lane to a member the plan does not use, so every link that can carry one is
    # measured on the path tensors would take (lane/prober.py).
    daemon.lane_probe = LaneProber(transport.lane_senders, transport.open_lane)
    daemon.lane_port = lambda: transport.lane_port or 0
    try:
        trainer = _trainer(config, daemon, transport, on_event).start()
    except BaseException:
        transport.close()
        raise
    return transport, trainer


def _trainer(config: SwarmNodeConfig, daemon: NodeDaemon, transport, on_event) -> SwarmTrainer:
    return SwarmTrainer(
        TrainerConfig(
            run=config.run,
            work_dir=config.work_dir,
            step_timeout_s=config.step_timeout_s,
            barrier_grace_s=config.barrier_grace_s,
            checkpoint_every=config.node.settings.checkpoint_every,
            checkpoint_pause_s=config.checkpoint_pause_s,
            fault_stall_after=config.fault_stall_after,
            fault_abandon_after=config.fault_abandon_after,
            fault_under_report=config.fault_under_report,
            fault_late_barrier_s=config.fault_late_barrier_s,
            pin_cores=config.pin_cores,
            device=config.device,
        ),
        peer_id=daemon.peer_id,
        transport=transport,
        workload=lambda: build_workload(config.run, config.data_path, config.data_dtype),
        shapes=parameter_shapes(config.run),
        view=DaemonView(daemon),
        on_event=on_event,
    )
