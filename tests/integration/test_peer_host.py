"""One py-libp2p host per node: the control plane and the data plane on one PeerHost.

Nodes here are in this process: a ``PeerHost`` carrying a ``ControlHost`` (gossip, probes) and
a ``Transport`` (tensor frames). Two such nodes use both planes over their one connection;
either plane detaches without taking the host or the other plane along; and a ``NodeDaemon``'s
host carries a Transport next to its control plane, at the addresses its record announces.
"""

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import trio
from libp2p.peer.id import ID

from fusionllm.common.errors import ConfigError
from fusionllm.dht.records import DeviceInfo
from fusionllm.node.control.daemon import NodeConfig, NodeDaemon
from fusionllm.node.control.swarm_settings import SwarmSettings
from fusionllm.node.errors import (
    ControlError,
    ProbeRefusedError,
    TransportClosedError,
    TransportError,
)
from fusionllm.node.local_swarm import TEST_DEVICE
from fusionllm.node.p2p.control_host import ControlConfig, ControlHost
from fusionllm.node.p2p.framing import FrameHeader
from fusionllm.node.p2p.peer_host import HostConfig, PeerHost
from fusionllm.node.p2p.transport import TensorSpec, Transport, TransportConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TOPIC = "fusionllm/test"
HEADER = FrameHeader(step=1, micro_batch=0, kind="activation", stage=0)
SPEC = TensorSpec(torch.float32, (3, 4))
_WAIT_S = 8.0
_THREADS = ("fusionllm-host", "fusionllm-control", "fusionllm-transport")


@dataclass
class Node:
    host: PeerHost
    control: ControlHost
    transport: Transport

    @property
    def peer_id(self) -> str:
        return self.host.peer_id


@pytest.fixture(autouse=True)
def _no_leftover_host_threads():
    yield
    leftovers = [t.name for t in threading.enumerate() if t.name in _THREADS]
    assert not leftovers, f"host threads still running: {leftovers}"


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Callable[[str], Node]]:
    """Start nodes (host, then both planes on it); closed planes first, then hosts."""
    with contextlib.ExitStack() as stack:

        def start(name: str) -> Node:
            key = tmp_path / f"{name}.key"
            host = stack.enter_context(PeerHost(HostConfig(key_path=key)))
            control_config = ControlConfig(key_path=key, max_messages_per_peer_per_s=100.0)
            control = stack.enter_context(ControlHost(control_config, host=host))
            transport_config = TransportConfig(key_path=key)
            transport = stack.enter_context(
                Transport(transport_config, expect=lambda _header: SPEC, host=host)
            )
            return Node(host, control, transport)

        yield start


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {_WAIT_S}s"
        time.sleep(0.02)


def _send_fails(sender: Transport, peer: str) -> bool:
    try:
        sender.send_tensor(peer, HEADER, torch.zeros(3, 4), timeout=3)
    except TransportError:
        return True
    return False


def tensor_crosses(sender: Transport, receiver: Transport, value: float) -> None:
    tensor = torch.full((3, 4), value)
    sender.send_tensor(receiver.peer_id, HEADER, tensor, timeout=_WAIT_S)
    got = receiver.recv(timeout=_WAIT_S)
    assert (got.peer, got.header) == (sender.peer_id, HEADER)
    assert torch.equal(got.tensor, tensor)


def gossip_crosses(sender: ControlHost, receiver: ControlHost, data: bytes) -> None:
    sender.publish(TOPIC, data)
    got = receiver.recv(timeout=_WAIT_S)
    assert (got.topic, got.author, got.data) == (TOPIC, sender.peer_id, data)


def subscribe_and_mesh(a: ControlHost, b: ControlHost) -> None:
    for control in (a, b):
        control.subscribe(TOPIC)
    wait_until(lambda: a.mesh_peers(TOPIC) == [b.peer_id], "a meshed with b")
    wait_until(lambda: b.mesh_peers(TOPIC) == [a.peer_id], "b meshed with a")


def connections(host: PeerHost, peer: str) -> int:
    peer_id = ID.from_base58(peer)
    return host.call_sync(lambda: len(host.libp2p.get_network().get_connections(peer_id)))


def test_gossip_probes_and_tensors_share_one_host_and_one_connection(nodes):
    a, b = nodes("a"), nodes("b")
    for node in (a, b):
        assert node.control.peer_id == node.transport.peer_id == node.peer_id
        assert node.control.listen_addrs == node.transport.addrs == node.host.addrs
        assert len(node.host.addrs) == 1
        assert node.host.addrs[0].endswith(f"/p2p/{node.peer_id}")
    threads = [t.name for t in threading.enumerate() if t.name in _THREADS]
    assert threads == ["fusionllm-host"] * 2, threads  # one trio thread per node, no more

    assert b.transport.connect(a.host.addrs[0]) == a.peer_id  # dialled by the data plane...
    subscribe_and_mesh(a.control, b.control)  # ...used by the control plane
    gossip_crosses(a.control, b.control, b"from a")
    gossip_crosses(b.control, a.control, b"from b")
    result = b.control.probe(a.peer_id, nbytes=64 << 10)
    assert result.bytes == 64 << 10
    assert result.bandwidth > 0
    assert 0 < result.rtt < 1.0
    assert a.control.stats().probes_served == 1
    tensor_crosses(a.transport, b.transport, 1.0)
    tensor_crosses(b.transport, a.transport, 2.0)

    assert a.host.connected_peers() == [b.peer_id]
    assert b.host.connected_peers() == [a.peer_id]
    assert connections(a.host, b.peer_id) == connections(b.host, a.peer_id) == 1
    assert a.transport.stats()[b.peer_id].errors == {}


def test_a_plane_that_closes_leaves_the_host_and_the_other_plane_running(nodes):
    a, b = nodes("a"), nodes("b")
    b.host.connect(a.host.addrs[0])
    subscribe_and_mesh(a.control, b.control)

    a.control.close()
    assert a.host.running
    with pytest.raises(TransportClosedError):
        a.control.publish(TOPIC, b"after close")
    with pytest.raises(TransportClosedError):
        a.control.recv(timeout=1)
    with pytest.raises(ControlError):  # a's host no longer speaks the probe protocol
        b.control.probe(a.peer_id, nbytes=1000)
    # a's gossip streams were reset; py-libp2p's pubsub notices at its next write to a.
    b.control.publish(TOPIC, b"to a closed plane")
    wait_until(lambda: b.control.mesh_peers(TOPIC) == [], "b to drop a from its mesh")
    tensor_crosses(a.transport, b.transport, 3.0)
    tensor_crosses(b.transport, a.transport, 4.0)

    # Its protocols are free again: a new control plane attaches where the old one was.
    key = a.host.config.key_path
    with ControlHost(ControlConfig(key_path=key), host=a.host) as again:
        assert b.control.probe(a.peer_id, nbytes=1000).bandwidth > 0
        assert again.stats().probes_served == 1

    a.transport.close()
    assert a.host.running
    with pytest.raises(TransportClosedError):
        a.transport.recv(timeout=1)
    with pytest.raises(TransportClosedError):
        a.transport.send_tensor(b.peer_id, HEADER, torch.zeros(3, 4))
    # a's host no longer speaks the tensor protocol. Frames carry no acknowledgement, so a
    # send into b's open lane or stream to a succeeds (the kernel buffers it) until b has seen
    # a's side close; under load that takes a moment. Within the wait, sends must fail.
    wait_until(lambda: _send_fails(b.transport, a.peer_id), "b's sends to a to fail")
    assert a.host.connected_peers() == [b.peer_id]


def test_one_host_takes_one_plane_of_each_kind_with_its_own_key(nodes, tmp_path):
    a, b = nodes("a"), nodes("b")
    key = a.host.config.key_path
    with pytest.raises(TransportError, match="already has a handler"):
        ControlHost(ControlConfig(key_path=key), host=a.host).start()
    with pytest.raises(TransportError, match="already has a handler"):
        Transport(TransportConfig(key_path=key), host=a.host).start()
    with pytest.raises(ConfigError, match="key_path"):
        Transport(TransportConfig(key_path=tmp_path / "other.key"), host=a.host)
    # The refused ones took nothing from the planes already there.
    b.host.connect(a.host.addrs[0])
    subscribe_and_mesh(a.control, b.control)
    gossip_crosses(b.control, a.control, b"still here")
    assert b.control.probe(a.peer_id, nbytes=1000).bandwidth > 0
    tensor_crosses(b.transport, a.transport, 5.0)


def test_a_control_plane_attached_after_peers_connected_meshes_with_them(tmp_path):
    with contextlib.ExitStack() as stack:
        hosts = [
            stack.enter_context(PeerHost(HostConfig(key_path=tmp_path / f"{name}.key")))
            for name in "ab"
        ]
        hosts[1].connect(hosts[0].addrs[0])  # before either has a control plane
        a, b = (
            stack.enter_context(ControlHost(ControlConfig(key_path=h.config.key_path), host=h))
            for h in hosts
        )
        subscribe_and_mesh(a, b)
        gossip_crosses(a, b, b"hello")


def test_a_daemon_host_carries_a_transport_at_the_addresses_it_announces(nodes, tmp_path):
    key = tmp_path / "daemon.key"
    events: list[dict] = []
    daemon = NodeDaemon(
        NodeConfig(settings=SwarmSettings(), key_path=key, device=DeviceInfo(**TEST_DEVICE)),
        on_event=events.append,
    )
    try:
        daemon.start()
        transport = Transport(
            TransportConfig(key_path=key), expect=lambda _header: SPEC, host=daemon.host
        ).start()
        announced = daemon.directory.members()[daemon.peer_id]
        assert list(announced.addrs) == daemon.host.addrs
        assert next(e for e in events if e["event"] == "ready")["addrs"] == daemon.host.addrs
        assert daemon.control.listen_addrs == transport.addrs == daemon.host.addrs
        assert transport.peer_id == daemon.host.peer_id == daemon.peer_id

        # A node with both planes on its own one host reaches both of the daemon's at that address.
        peer = nodes("peer")
        assert peer.host.connect(announced.addrs[0]) == daemon.peer_id
        assert peer.control.probe(daemon.peer_id, nbytes=64 << 10).bandwidth > 0
        tensor_crosses(peer.transport, transport, 6.0)
        tensor_crosses(transport, peer.transport, 7.0)
    finally:
        daemon.close()
    assert daemon.host is not None
    assert not daemon.host.running
    with pytest.raises(TransportClosedError):  # it ended with the daemon's host
        transport.recv(timeout=1)
    transport.close()


@contextlib.asynccontextmanager
async def _failing_setup() -> AsyncIterator[None]:
    async with trio.open_nursery():
        raise ProbeRefusedError("setup failed")  # inside a nursery: wrapped in a group
    yield  # pragma: no cover


@contextlib.asynccontextmanager
async def _failing_later(fail: trio.Event, stopped: list[str]) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:

        async def fail_on_cue() -> None:
            await fail.wait()
            raise RuntimeError("a service bug")

        nursery.start_soon(fail_on_cue)
        try:
            yield "entered"
        finally:
            stopped.append("torn down")


def test_the_bridge_is_typed_before_start_after_close_and_around_failing_services(tmp_path):
    host = PeerHost(HostConfig(key_path=tmp_path / "key"))
    assert host.addrs == []
    assert not host.running
    for attempt in (
        lambda: host.call(trio.sleep, 0),
        lambda: host.call_sync(lambda: None),
        lambda: host.run_sync_soon(lambda: None),
        host.connected_peers,
    ):
        with pytest.raises(TransportClosedError):
            attempt()
    with host:
        with pytest.raises(TransportError, match="already started"):
            host.start()
        assert host.call(trio.sleep, 0) is None
        assert host.call_sync(lambda x: x + 1, 1) == 2
        # A setup that fails reaches the caller as itself, not as an exception group.
        with pytest.raises(ProbeRefusedError, match="setup failed"):
            host.start_service(_failing_setup, name="broken")
        # One that fails later is logged and ends; the host and its other services go on.
        fail, stopped = trio.Event(), []
        service = host.start_service(_failing_later, fail, stopped, name="flaky")
        assert (service.value, service.running) == ("entered", True)
        host.run_sync_soon(fail.set)
        wait_until(lambda: not service.running, "the failing service to end")
        assert stopped == ["torn down"]
        service.stop()  # idempotent once ended
        calm = host.start_service(_failing_later, trio.Event(), stopped, name="calm")
        calm.stop()
        assert not calm.running
        assert stopped == ["torn down"] * 2
        assert host.call_sync(lambda: 42) == 42
    assert not host.running
    with pytest.raises(TransportClosedError):
        host.call_sync(lambda: None)
    service.stop()  # after close: the service ended with the host, nothing to do
    host.close()  # idempotent


def test_a_fixed_port_in_use_is_refused(tmp_path):
    with PeerHost(HostConfig(key_path=tmp_path / "a")) as first:
        port = int(first.addrs[0].split("/tcp/")[1].split("/")[0])
        second = PeerHost(HostConfig(key_path=tmp_path / "b", listen_port=port))
        with pytest.raises(TransportError, match="cannot listen"):
            second.start()
        control = ControlHost(ControlConfig(key_path=tmp_path / "c", listen_port=port))
        with pytest.raises(TransportError, match="cannot listen"):  # its own host, same check
            control.start()
