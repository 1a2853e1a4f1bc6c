"""Lanes' kernel-timed figures reach the links table: a lane over real loopback TCP measures
itself while it carries frames, and LinkMonitor files its figure beside the probes'."""

import threading
import time
from types import SimpleNamespace

import pytest
import trio

from fusionllm.node.control.bandwidth import BandwidthBook, LinkSample
from fusionllm.node.control.links import LinkMonitor
from fusionllm.node.p2p.blocking_framing import read_exactly_blocking
from fusionllm.node.p2p.lane.senders import LaneSenders
from fusionllm.node.p2p.lane.stream import BlockingLaneReader
from fusionllm.node.p2p.lane.wire_meter import WireSample
from fusionllm.node.p2p.transport_types import PeerCounters
from tests.support.lanes import KEY, loopback_lane

FRAME = 2 << 20


@pytest.fixture
def tcp_lane():
    writer, peer = loopback_lane()
    senders = LaneSenders(PeerCounters())
    senders.add("b", writer)
    yield senders, writer, BlockingLaneReader(peer, KEY)
    peer.close()
    trio.run(writer.close)


def test_a_lane_carrying_frames_is_timed_by_the_kernel(tcp_lane):
    senders, writer, reader = tcp_lane
    assert senders.wire_samples() == {}  # nothing sent, nothing known
    body = bytes(FRAME)
    deadline = time.monotonic() + 20
    frames = 0
    while "b" not in senders.wire_samples() and time.monotonic() < deadline:
        drain = threading.Thread(target=read_exactly_blocking, args=(reader, 1 + FRAME),
                                 kwargs={"stall_timeout_s": 10})  # fmt: skip
        drain.start()
        writer.write_frame((b"h", body), timeout=10)
        drain.join(timeout=10)
        frames += 1
    sample = senders.wire_samples().get("b")
    assert sample is not None, f"no kernel figure after {frames} frames of {FRAME} bytes"
    print(f"lane: {sample.bandwidth / 1e6:.0f} MB/s, rtt {sample.rtt * 1e6:.0f} us")
    assert sample.bandwidth > 1e6  # loopback carries hundreds of MB/s; a loaded box less
    assert 0 < sample.rtt < 1.0
    assert abs(sample.measured_at - time.time()) < 60


class NoControl:
    def connected_peers(self) -> list[str]:
        return []


def monitor(book: BandwidthBook, wire: dict[str, WireSample]) -> LinkMonitor:
    return LinkMonitor(
        control=NoControl(), book=book, peer_id="a", swarm="demo", topic="t",
        probe_interval_s=8.0, probe_fanout=2, probe_bytes=1 << 16, max_connections=8,
        members=dict, neighbours=list, stop=threading.Event(), wire=lambda: dict(wire),
    )  # fmt: skip


def test_a_busy_lanes_figure_prices_the_link_a_starved_probe_read_low():
    book = BandwidthBook(max_age_s=60.0)
    now = time.time()
    # A probe on a host whose CPU share training took: 3 MB/s of a 125 MB/s link.
    book.record("a", "b", LinkSample(3e6, 2e-3, now - 2), now=now, window=LinkMonitor.PROBE_WINDOW)
    wire = {"b": WireSample(118e6, 6e-4, now - 1)}
    members = {"a": object(), "b": object()}
    assert monitor(book, wire).file_wire(members) == 1
    (link,) = [v for v in book.link_table([_info("a"), _info("b")], now=now) if v.src == "a"]
    assert (link.bandwidth, link.rtt, link.measured) == (118e6, 6e-4, True)
    # The same figure again is not a new sample.
    assert monitor(book, wire).file_wire(members) == 0


def test_only_members_lanes_are_filed():
    book = BandwidthBook(max_age_s=60.0)
    now = time.time()
    wire = {"x": WireSample(50e6, 1e-3, now), "a": WireSample(50e6, 1e-3, now)}
    assert monitor(book, wire).file_wire({"a": object(), "b": object()}) == 0
    assert book.last_measured("a", now) == {}


def test_a_stale_lane_figure_is_not_filed():
    book = BandwidthBook(max_age_s=60.0)
    wire = {"b": WireSample(50e6, 1e-3, time.time() - 600)}
    assert monitor(book, wire).file_wire({"a": object(), "b": object()}) == 0


def _info(peer: str) -> SimpleNamespace:
    """The fields of a NodeInfo that link_table reads."""
    return SimpleNamespace(peer_id=peer, uplink=1e6, downlink=1e6)
