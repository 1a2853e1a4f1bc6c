"""One node's metrics over HTTP: prometheus-client's own server on ``--metrics HOST:PORT``.

It listens before the node joins anything, so a port in use or an address this machine does
not have is a clear error at start, not a node that trains unwatched.
"""

from prometheus_client import start_http_server

from fusionllm.common.errors import FusionError
from fusionllm.common.logs import get_logger
from fusionllm.node.observe.listen import url_of
from fusionllm.node.observe.metrics import NodeMetrics

logger = get_logger(__name__)


class MetricsServer:
    def __init__(self, metrics: NodeMetrics, host: str, port: int) -> None:
        self.metrics = metrics
        try:
            self._server, self._thread = start_http_server(
                port, addr=host, registry=metrics.registry
            )
        except OSError as exc:  # address in use, not ours, or a name that does not resolve
            raise FusionError(f"--metrics {host}:{port}: cannot listen there: {exc}") from exc
        self.url = url_of(host, self._server.server_port, "/metrics")
        logger.info("metrics at %s", self.url)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)
