"""The emulator's routing and shaping on a fake clock, with pipes standing in for TUN fds."""

import os
import struct

import pytest

from fusionllm.testbed.bed import TestbedConfig, emulator_config
from fusionllm.testbed.emulator import Emulator, EmulatorConfig, HostWire, LinkWire
from fusionllm.testbed.topology import MIN_QUEUE_BYTES, parse_topology
from fusionllm.testbed.vnet import VNET_HDR

A, B = "10.250.0.1", "10.250.0.2"


def _frame(dst: str, payload: int, gso_size: int = 0) -> bytes:
    tcp = struct.pack("!HHIIBBHHH", 1, 2, 0, 0, 5 << 4, 0x10, 512, 0, 0)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40 + payload, 1, 0, 64, 6, 0,
                     bytes(map(int, A.split("."))), bytes(map(int, dst.split("."))))  # fmt: skip
    vnet = VNET_HDR.pack(1, 1 if gso_size else 0, 40, gso_size, 20, 16)
    return vnet + ip + tcp + b"x" * payload


@pytest.fixture
def pipes():
    made = [os.pipe() for _ in range(2)]
    for read, write in made:  # a full pipe is a write error, as a full TUN queue would be
        os.set_blocking(read, False)
        os.set_blocking(write, False)
    yield made
    for pair in made:
        for fd in pair:
            os.close(fd)


def _emulator(pipes, *, rate=None, delay=0.0, loss=0.0) -> Emulator:
    hosts = tuple(
        HostWire(name=n, fd=w, addr=addr, up_rate=None, up_limit=MIN_QUEUE_BYTES,
                 down_rate=None, down_limit=MIN_QUEUE_BYTES)
        for n, addr, (_r, w) in zip("ab", (A, B), pipes, strict=True)
    )  # fmt: skip
    links = tuple(
        LinkWire(src=s, dst=d, rate=rate, limit=MIN_QUEUE_BYTES, delay_s=delay, loss=loss)
        for s, d in (("a", "b"), ("b", "a"))
    )
    return Emulator(EmulatorConfig(hosts=hosts, links=links, seed=1))


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 20)
    except BlockingIOError:
        return b""


def test_a_frame_reaches_its_destination_after_its_bytes_at_rate_and_the_delay(pipes):
    emulator = _emulator(pipes, rate=1000.0, delay=0.01)
    frame = _frame(B, 60)  # 100 wire bytes: 0.1 s at 1000 B/s
    emulator.receive(0.0, pipes[0][1], frame)
    emulator.run_due(0.105)
    assert _read(pipes[1][0]) == b""
    assert emulator.next_due() == pytest.approx(0.11)
    emulator.run_due(0.11)
    assert _read(pipes[1][0]) == frame
    assert _read(pipes[0][0]) == b""


def test_what_cannot_be_routed_or_parsed_is_counted_and_dropped(pipes):
    emulator = _emulator(pipes)
    emulator.receive(0.0, pipes[0][1], _frame("10.9.9.9", 10))
    emulator.receive(0.0, pipes[0][1], b"\0" * 12)
    assert emulator.counts == {"frames": 2, "malformed": 1, "unroutable": 1, "write_errors": 0}
    assert _read(pipes[1][0]) == b""


def test_a_lossy_link_loses_single_wire_packets_of_a_burst(pipes):
    emulator = _emulator(pipes, loss=0.2)
    for _ in range(50):
        emulator.receive(0.0, pipes[0][1], _frame(B, 10 * 1000, gso_size=1000))
    link = emulator.stats()["fifos"]["link:a>b"]
    assert link["packets"] + link["lost"] == 500  # 50 bursts of 10 packets, each its own
    assert link["lost"] == pytest.approx(100, abs=30)


def test_a_topology_becomes_the_emulators_rates_and_queues():
    topo = parse_topology({
        "hosts": [{"name": "a", "uplink_mbps": 80}, {"name": "b", "downlink_mbps": 8}],
        "links": [{"hosts": ["a", "b"], "delay_ms": 20, "rate_mbps": 100, "queue_ms": 50}],
    })  # fmt: skip
    config = emulator_config(topo, {"a": 5, "b": 6}, TestbedConfig(subnet="10.7.0"))
    a, b = config.hosts
    assert (a.fd, a.addr, a.up_rate, a.down_rate) == (5, "10.7.0.1", 1e7, None)
    assert a.up_limit == 1e7 * 0.1  # 100 ms of queue at 80 Mbit/s
    assert (b.addr, b.down_limit) == ("10.7.0.2", MIN_QUEUE_BYTES)  # 100 ms at 8: too short
    ab = next(link for link in config.links if (link.src, link.dst) == ("a", "b"))
    assert (ab.rate, ab.delay_s, ab.limit) == (12.5e6, 0.02, 625_000)
    assert EmulatorConfig.from_json(config.to_json()) == config
