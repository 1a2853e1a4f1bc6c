"""A transport_main node process driven from a test, and the checks the transport tests share."""

import sys
import time
from pathlib import Path

import torch

from fusionllm.compression import pack_tensor
from fusionllm.node.children import JsonChild
from fusionllm.node.p2p.framing import FrameHeader
from fusionllm.node.p2p.transport import Transport

# A start takes ~2 s; 15 s was once too short here with the load at 14 on 2 cores (its import
# of torch and py-libp2p alone). The per-test timeouts still bound a test.
_START_S = 30.0
_WAIT_S = 8.0
HEADER = FrameHeader(step=3, micro_batch=1, kind="activation", stage=0)


class NodeProcess:
    """A transport_main process; JSON commands on its stdin, JSON events on its stdout."""

    def __init__(self, key: Path, *args: str) -> None:
        self.child = JsonChild(
            [sys.executable, "-m", "tests.support.transport_main", "--key", str(key), *args],
            stdin=True,
            cwd=Path(__file__).resolve().parents[2],  # the repo root: tests.support imports
        )
        self.proc = self.child.process
        try:
            ready = self.next_event(_START_S)
            assert ready["event"] == "ready", ready
        except BaseException:
            self.child.kill()
            raise
        self.peer_id: str = ready["peer_id"]
        self.addr: str = ready["addrs"][0]
        self.ready = ready

    def next_event(self, timeout: float = _WAIT_S) -> dict:
        try:
            return self.child.next_event(timeout)
        except (TimeoutError, EOFError):
            raise AssertionError(f"node said nothing for {timeout}s") from None

    def command(self, **command) -> dict:
        self.child.send(command)
        return self.next_event()

    def errors_of(self, peer: str) -> dict[str, int]:
        return self.command(cmd="stats")["peers"].get(peer, {}).get("errors", {})

    def wait_for_error(self, peer: str, name: str, count: int = 1) -> dict[str, int]:
        deadline = time.monotonic() + _WAIT_S
        while time.monotonic() < deadline:
            errors = self.errors_of(peer)
            if errors.get(name, 0) >= count:
                return errors
            time.sleep(0.05)
        raise AssertionError(f"node never counted a {name} for {peer}: {errors}")

    def stop(self) -> None:
        self.child.finish(timeout=10)  # the node exits when its stdin closes


def echo(client: Transport, node: NodeProcess, tensor: torch.Tensor, header=HEADER):
    client.send(node.peer_id, header, pack_tensor(tensor), timeout=_WAIT_S)
    received = client.recv(timeout=_WAIT_S)
    assert received.peer == node.peer_id
    assert received.header == header
    return received.tensor


def assert_node_still_echoes(client: Transport, node: NodeProcess) -> None:
    tensor = torch.arange(12, dtype=torch.float32).view(3, 4)
    assert torch.equal(echo(client, node, tensor), tensor)
