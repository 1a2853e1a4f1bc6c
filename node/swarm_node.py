"""A node as its user runs it: the control plane, and the training its adopted plan drives.

The thin composition DESIGN.md asks for: ``control/`` (the daemon) and ``pipeline/`` (the
runtime, through ``training/``) never import each other; this module builds the daemon and,
for a node that trains, ``swarm_training``'s transport and trainer on the node's one py-libp2p
host. Only that half imports torch, so a node run with ``train=False`` never loads it.
"""

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from fusionllm.common.logs import get_logger
from fusionllm.node.control.daemon import NodeDaemon
from fusionllm.node.errors import PipelineError
from fusionllm.node.observe.exporter import MetricsServer
from fusionllm.node.observe.metrics import NodeMetrics
from fusionllm.node.observe.sources import node_sources
from fusionllm.node.swarm_config import SwarmNodeConfig

if TYPE_CHECKING:
    from fusionllm.node.p2p.transport import Transport
    from fusionllm.node.training.trainer import SwarmTrainer

logger = get_logger(__name__)


def run_node(
    config: SwarmNodeConfig,
    *,
    on_event: Callable[[dict], None],
    duration_s: float | None = None,
    stop: threading.Event | None = None,
) -> bool:
    """Join, train what the swarm's plan asks, leave; True if the run reached its end."""
    if config.metrics is None:
        return _run(config, on_event, duration_s, stop, metrics=None)
    # Listening first: a port in use is a clear error before the node joins anything.
    exporter = MetricsServer(NodeMetrics(), *config.metrics)
    try:
        on_event = exporter.metrics.chain(on_event)
        on_event({"event": "metrics", "url": exporter.url, "t": time.time()})
        return _run(config, on_event, duration_s, stop, metrics=exporter.metrics)
    finally:
        exporter.close()


def _run(
    config: SwarmNodeConfig,
    on_event: Callable[[dict], None],
    duration_s: float | None,
    stop: threading.Event | None,
    *,
    metrics: NodeMetrics | None,
) -> bool:
    daemon = NodeDaemon(config.node, on_event=on_event)
    trainer: SwarmTrainer | None = None
    transport: Transport | None = None
    finished = threading.Event()
    serving = None
    try:
        daemon.start()
        if config.train and config.task == "serve":
            serving = _start_serving(config, daemon, on_event)
        elif config.train:
            from fusionllm.node.swarm_training import start_training  # torch: trainers only

            transport, trainer = start_training(config, daemon, on_event)
            finished = trainer.finished
        if metrics is not None:
            metrics.attach(node_sources(daemon, transport, trainer))
        watcher = threading.Thread(
            target=_stop_when, args=(daemon, trainer, finished, stop, on_event), daemon=True
        )
        watcher.start()
        daemon.run(duration_s=duration_s)
        if trainer is not None and trainer.failed:  # left politely (below), then exit 1: a
            # node that exits 0 here reads as one that finished (every member crashed at once)
            raise PipelineError("training stopped on an unexpected error (its traceback above)")
        return finished.is_set()
    finally:
        if trainer is not None:
            trainer.close()
        if serving is not None:
            serving.close()
        daemon.leave()
        if transport is not None:
            transport.close()
        daemon.close()


def _start_serving(config: SwarmNodeConfig, daemon: NodeDaemon, on_event):
    from pathlib import Path

    from fusionllm.node.serve.node_serving import ServingNode  # torch: servers only
    from fusionllm.node.serve.sessions import ServeLimits

    limits = config.serve_limits if config.serve_limits is not None else ServeLimits()
    folder = Path(config.run.model_dir)
    return ServingNode(daemon, folder, limits=limits, on_event=on_event).start()


def _stop_when(daemon: NodeDaemon, trainer, finished: threading.Event, stop, on_event):
    """Stop the daemon when the run ends, or when asked: then the trainer first leaves
    politely (its step, its hand-over) while heartbeats still say we are here."""
    while not finished.wait(0.2):
        if stop is not None and stop.is_set():
            # Said loudly: a node that leaves exits 0 as one that finished does, and a swarm
            # whose nodes were all stopped at once (a stray pkill) looks like a run cut short.
            step = trainer.step if trainer is not None else None
            logger.warning("asked to stop (SIGINT or SIGTERM) at step %s: leaving politely", step)
            on_event({"event": "stopping", "step": step, "t": time.time()})
            if trainer is not None:
                trainer.stop()
                trainer.wait_gone(2 * trainer.config.step_timeout_s + 35.0)
            break
    daemon.stop()
