"""A link whose lane was punched through NATs (node/p2p/lane/punch.py) is known as such from
the lane's figures to the record and ``fusionllm status``, and is not probed over the relay."""

import collections
import threading
import time
from types import SimpleNamespace

import msgpack
import pytest

from fusionllm.dht.records import LinkReport, NodeState, RecordError
from fusionllm.node.control.bandwidth import BandwidthBook
from fusionllm.node.control.links import LinkMonitor
from fusionllm.node.control.status import describe, format_status
from fusionllm.node.p2p.lane.senders import LaneSenders
from fusionllm.node.p2p.lane.wire_meter import WireSample
from fusionllm.node.p2p.transport_types import PeerCounters
from tests.unit.test_epochs import record


def test_a_punched_link_says_so_in_its_fifth_field():
    punched = LinkReport(peer="b", bandwidth=5e6, rtt=0.02, age=1.0, punched=True)
    assert punched.to_wire() == ["b", 5e6, 0.02, 1.0, 2]
    assert LinkReport.from_wire(msgpack.unpackb(msgpack.packb(punched.to_wire()))) == punched
    with pytest.raises(RecordError, match=r"must be 1 \(2: punched\), got 3"):
        LinkReport.from_wire(["b", 5e6, 0.02, 1.0, 3])
    with pytest.raises(RecordError, match="relayed or punched, not both"):
        LinkReport(peer="b", bandwidth=5e6, rtt=0.02, age=1.0, relayed=True, punched=True)


def _lane(punched: bool, sample: WireSample):
    return SimpleNamespace(punched=punched, meter=SimpleNamespace(latest=lambda: sample))


def test_a_punched_lanes_figures_are_marked_punched():
    now = time.time()
    senders = LaneSenders(PeerCounters())
    senders.add("b", _lane(True, WireSample(9e6, 0.02, now)))
    senders.add("c", _lane(False, WireSample(50e6, 0.001, now)))
    samples = senders.wire_samples()
    assert {peer: s.punched for peer, s in samples.items()} == {"b": True, "c": False}
    assert samples["b"].bandwidth == 9e6


class ProbingControl:
    """Connected to b and c; records whom it probed."""

    def __init__(self) -> None:
        self.probed: list[str] = []

    def publish(self, topic: str, data: bytes) -> None:
        pass  # our links\' gossip: nobody listens here

    def connected_peers(self) -> list[str]:
        return ["b", "c"]

    def probe(self, peer: str, nbytes: int):
        self.probed.append(peer)
        return SimpleNamespace(bandwidth=2e6, rtt=0.05, bytes=nbytes, seconds=0.1, relayed=True)


def test_a_punched_link_is_priced_by_its_lane_and_shown_direct_punched():
    now = time.time()
    book, control = BandwidthBook(max_age_s=60.0), ProbingControl()
    wire = {"b": WireSample(9e6, 0.02, now - 1, punched=True)}
    links = LinkMonitor(
        control=control, book=book, peer_id="a", swarm="demo", topic="t",
        probe_interval_s=8.0, probe_fanout=2, probe_bytes=1 << 16, max_connections=8,
        members=dict, neighbours=list, stop=threading.Event(), wire=lambda: dict(wire),
    )  # fmt: skip
    members = {p: record(p, state=NodeState.SERVING) for p in ("a", "b", "c")}
    links._probe_round(members)  # no lane to c: it waits a probe interval for one
    links._lane_missed_at["c"] -= 8.0
    links._probe_round(members)
    assert control.probed == ["c"]  # b's traffic takes its punched lane, not the relay
    assert links.file_wire(members) == 1
    report = book.own_report("a", "demo", now=now)
    paths = {link.peer: (link.relayed, link.punched) for link in report.links}
    assert paths == {"b": (False, True), "c": (True, False)}
    members["a"] = record("a", state=NodeState.SERVING, links=report.links)
    status = describe("demo", members, None, collections.Counter(), now=now + 1, skipped=0)
    lines = {line.split(" -> ")[1].split()[0]: line for line in
             format_status(status).splitlines() if " -> " in line}  # fmt: skip
    assert lines["b"].endswith("direct (punched)")
    assert lines["c"].endswith("relayed")
