"""A node as its user runs it: the control plane, and the training its adopted plan drives.

The thin composition DESIGN.md asks for: ``control/`` (the daemon) and ``pipeline/`` (the
runtime, through ``training/``) never import each other; this module builds the daemon and,
for a node that trains, ``swarm_training``'s transport and trainer on the node's one py-libp2p
host. Only that half imports torch, so a node run with ``train=False`` never loads it.
"""

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fusionllm.common.logs import get_logger
from fusionllm.common.run_spec import RunSpec
from fusionllm.node.control.daemon import NodeConfig, NodeDaemon

if TYPE_CHECKING:
    from fusionllm.node.p2p.transport import Transport
    from fusionllm.node.training.trainer import SwarmTrainer

logger = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class SwarmNodeConfig:
    node: NodeConfig
    work_dir: Path
    step_timeout_s: float = 60.0
    barrier_grace_s: float = 30.0  # the READY barrier's wait for a member (training/session.py)
    checkpoint_pause_s: float = 0.0  # fault injection: sleep between a write and its rename
    fault_stall_after: int = 0  # fault injection: stop sending after this many steps of a plan
    fault_under_report: float = 1.0  # fault injection: report this many times less compute
    train: bool = True  # False: the control plane alone (tests and benchmarks of it)
    pin_cores: bool = False  # while serving a plan, compute on cores picked by our rank in it
    # This node's copy of the data (RunSpec names it by digest); None: the stdlib source.
    data_path: Path | None = None
    data_dtype: str | None = None  # a token file's element type (default uint16)
    device: str = "cpu"  # where the stages this node serves compute (--device)

    @property
    def run(self) -> RunSpec:
        return self.node.settings.run


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
    finished = threading.Event()
    try:
        daemon.start()
        if config.train:
            from fusionllm.node.swarm_training import start_training  # torch: trainers only

            transport, trainer = start_training(config, daemon, on_event)
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
