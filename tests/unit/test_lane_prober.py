"""LaneProber (lane/prober.py) over a real loopback lane: a probe opens a lane only where none
is open, and gives None where none can be had (the stream probe then measures); LaneSenders
marks a punched lane's figure and hands a lane closed under a caller back to the trio path;
LinkMonitor probes a lane at full size where its stream probe would be a quarter."""

import threading
import time
from types import SimpleNamespace

import pytest
import trio

from fusionllm.node.control.bandwidth import BandwidthBook
from fusionllm.node.control.links import LinkMonitor
from fusionllm.node.errors import TransportClosedError
from fusionllm.node.p2p.lane.prober import LANE_OPEN_WAIT_S, LaneProber
from fusionllm.node.p2p.lane.senders import LaneSenders
from fusionllm.node.p2p.lane.stream import BlockingLaneReader
from fusionllm.node.p2p.lane.wire_meter import WireSample
from fusionllm.node.p2p.transport_types import PeerCounters
from tests.support.lanes import KEY, loopback_lane

PEER = "peer"


@pytest.fixture
def lane():
    writer, peer = loopback_lane()
    reader = BlockingLaneReader(peer, KEY)
    # Takes whatever arrives, so a bulk probe's frames drain as on a served lane.
    drain = threading.Thread(target=_drain, args=(reader,), daemon=True)
    drain.start()
    yield writer
    trio.run(writer.close)
    drain.join(timeout=10)
    peer.close()


def _drain(reader: BlockingLaneReader) -> None:
    reader.set_timeout(30.0)
    try:
        while reader.read(1 << 16):
            pass
    except Exception:  # the lane closed under the read: done
        return


def probe_until_figure(prober: LaneProber, tries: int = 20):
    for _ in range(tries):  # a loaded box may leave the queue app-limited: no trusted sample
        sample = prober(PEER, 1 << 20)
        if sample is not None:
            return sample
    raise AssertionError(f"no trusted kernel sample in {tries} bulk probes")


def test_a_lane_is_opened_for_a_probe_only_where_none_is_open(lane):
    senders, asked = LaneSenders(PeerCounters()), []

    def open_lane(peer: str, timeout: float) -> bool:
        asked.append((peer, timeout))
        senders.add(peer, lane)  # what Transport.open_lane leaves behind
        return True

    prober = LaneProber(senders, open_lane)
    sample = probe_until_figure(prober)
    assert sample.bandwidth > 1e6
    assert not sample.punched
    assert asked == [(PEER, LANE_OPEN_WAIT_S)]  # once: later probes found the lane open


def test_no_lane_to_be_had_gives_none_and_no_filler():
    counters = PeerCounters()
    senders = LaneSenders(counters)
    refused = LaneProber(senders, lambda peer, timeout: False, open_wait_s=0.5)
    assert refused(PEER, 1 << 20) is None

    def closed(peer: str, timeout: float) -> bool:
        raise TransportClosedError("transport is not running")

    assert LaneProber(senders, closed)(PEER, 1 << 20) is None
    assert PEER not in counters.snapshot()  # nothing was sent


def test_a_punched_lanes_figure_says_so(lane):
    lane.punched = True
    senders = LaneSenders(PeerCounters())
    senders.add(PEER, lane)
    sample = probe_until_figure(LaneProber(senders, lambda peer, timeout: True))
    assert sample.punched


def test_a_lane_closed_after_a_caller_found_it_sends_the_frame_the_other_way(lane):
    senders = LaneSenders(PeerCounters())
    senders.add(PEER, lane)
    lane.broken = True  # outbound.py's idle close, between the caller's lookup and its lock
    assert senders.try_write(PEER, (b"head", b"body"), 5) is None
    assert not lane.lock.locked()


class StreamProbes:
    """A control host whose stream probe reads a starved Python-paced figure, and what it was
    asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int]] = []

    def publish(self, topic: str, data: bytes) -> None:
        pass  # our links\' gossip: nobody listens here

    def connected_peers(self) -> list[str]:
        return ["b", "c"]

    def probe(self, peer: str, *, nbytes: int):
        self.asked.append((peer, nbytes))
        return SimpleNamespace(bandwidth=3e6, rtt=2e-3, bytes=nbytes, seconds=0.3, relayed=False)


def test_a_lane_probe_is_full_size_where_a_stream_probe_would_be_a_quarter():
    control, lane_asked = StreamProbes(), []

    def lane_probe(peer: str, nbytes: int) -> WireSample | None:
        lane_asked.append((peer, nbytes))
        return WireSample(118e6, 6e-4, time.time()) if peer == "c" else None

    members = {"a": object(), "b": object(), "c": object()}
    monitor = LinkMonitor(
        control=control, book=BandwidthBook(max_age_s=60.0), peer_id="a", swarm="demo",
        topic="t", probe_interval_s=8.0, probe_fanout=2, probe_bytes=1 << 20,
        max_connections=8, members=lambda: members, neighbours=lambda: [],
        stop=threading.Event(), lane_probe=lane_probe,
    )  # fmt: skip
    monitor._probe_round(members)  # neither is a plan neighbour: a quarter by stream
    assert sorted(lane_asked) == [("b", 1 << 20), ("c", 1 << 20)]
    assert control.asked == []  # no lane to b yet: it waits a probe interval for one
    monitor._lane_missed_at["b"] -= 8.0
    monitor._probe_round(members)
    assert control.asked == [("b", 1 << 18)]  # still none: its stream probe follows
