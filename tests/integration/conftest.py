"""Fixtures of the transport tests: node processes (transport_main) and an in-process client."""

import time
from collections.abc import Iterator

import pytest

from fusionllm.node.p2p.transport import Transport, TransportConfig
from tests.support.transport_node import NodeProcess


@pytest.fixture
def start_node(tmp_path) -> Iterator:
    nodes: list[NodeProcess] = []

    def start(*args: str, key: str = "node.key") -> NodeProcess:
        node = NodeProcess(tmp_path / key, *args)
        nodes.append(node)
        return node

    yield start
    for node in nodes:
        node.stop()
        assert node.proc.returncode == 0, f"node exited with {node.proc.returncode}"


@pytest.fixture(scope="module")
def plain_node(tmp_path_factory) -> Iterator[NodeProcess]:
    """One node without flags for a whole module (its start and stop were most of a short
    test's time). Tests meet it as fresh peers (their own client keys and raw hosts), so what
    a test counts against its peers is its own; node-wide counters are read as what the test
    added. Each test still checks the node serves after it; the module, that it exits cleanly."""
    node = NodeProcess(tmp_path_factory.mktemp("plain-node") / "node.key")
    try:
        yield node
    finally:
        node.stop()
    assert node.proc.returncode == 0, f"node exited with {node.proc.returncode}"


@pytest.fixture
def client(tmp_path) -> Iterator[Transport]:
    config = TransportConfig(key_path=tmp_path / "client.key", dial_timeout_s=5.0)
    transport = Transport(config).start()
    yield transport
    started = time.monotonic()
    transport.close()
    assert time.monotonic() - started < config.close_timeout_s + 1
