"""The serving half of a node (``fusionllm node --task serve``): a ``StageServer`` on the
daemon's host, following the span each adopted plan gives this node.

Imported by ``swarm_node`` only for a node that serves (torch comes in here). The daemon's
agreement decides members, stages and replicas as for training; ``layout.serving_route``
turns the adopted plan into spans of blocks, the same on every node and client.
"""

import threading
from collections.abc import Callable
from pathlib import Path

from fusionllm.common.logs import get_logger
from fusionllm.dag.models.pretrained import read_config
from fusionllm.node.control.daemon import NodeDaemon
from fusionllm.node.serve.layout import serving_route, span_of
from fusionllm.node.serve.server import StageServer
from fusionllm.node.serve.sessions import ServeLimits
from fusionllm.node.serve.wire import PROTOCOL

logger = get_logger(__name__)
_WATCH_S = 0.5


class ServingNode:
    def __init__(
        self,
        daemon: NodeDaemon,
        folder: Path,
        *,
        limits: ServeLimits,
        on_event: Callable[[dict], None],
    ) -> None:
        self.daemon = daemon
        self.layers = read_config(folder).num_hidden_layers
        self.server = StageServer(folder, limits=limits, name=folder.name)
        self._on_event = on_event
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="serve-plan", daemon=True)
        self._digest: str | None = None

    def start(self) -> "ServingNode":
        self.daemon.host.set_stream_handler(PROTOCOL, self.server.handle)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self.daemon.host is not None:
            self.daemon.host.remove_stream_handler(PROTOCOL)

    def _watch(self) -> None:
        while not self._stop.wait(_WATCH_S):
            adopted = self.daemon.adopted
            if adopted is None or adopted.digest == self._digest:
                continue
            plan = adopted.plan
            route = serving_route([s.peers for s in plan.stages], self.layers, plan.backup)
            stage = span_of(route, self.daemon.peer_id)
            try:
                self.server.follow(stage)
            except Exception:  # a folder that changed under us: say so, keep the node up
                logger.exception("could not load the span of plan %s", adopted.digest[:12])
                continue
            self._digest = adopted.digest
            self._on_event(
                {
                    "event": "serve_plan",
                    "digest": adopted.digest,
                    "stage": None if stage is None else stage.index,
                    "blocks": None if stage is None else [stage.start, stage.stop],
                    "stages": len(route),
                }
            )
