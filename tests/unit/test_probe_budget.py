"""probe_budget.py: probes take at most a share of the uplink's time, after a burst; and
links.py spends it, skipping the links our lanes' own frames measure."""

import itertools
import threading
import time
from types import SimpleNamespace

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.control.bandwidth import BandwidthBook
from fusionllm.node.control.links import LinkMonitor
from fusionllm.node.control.probe_budget import ProbeBudget, ProbeBudgetConfig
from fusionllm.node.p2p.lane.wire_meter import WireSample


def test_a_burst_then_the_share():
    budget = ProbeBudget(ProbeBudgetConfig(share=0.1, burst_s=2.0), now=0.0)
    assert budget.allows(0.0)
    budget.spend(1.5, 0.0)
    assert budget.allows(0.0)  # 0.5 s left of the burst
    budget.spend(1.0, 0.0)  # a probe charged after it ran may overdraw
    assert not budget.allows(0.0)
    assert budget.ready_in(0.0) == pytest.approx(5.0)  # 0.5 s owed at 0.1 s per s
    assert not budget.allows(4.9)
    assert budget.allows(5.1)


def test_one_probe_a_second_of_uplink_comes_every_ten_seconds_at_a_tenth():
    budget = ProbeBudget(ProbeBudgetConfig(share=0.1, burst_s=1.0), now=0.0)
    starts, now = [], 0.0
    while now < 100.0:
        if budget.allows(now):
            starts.append(now)
            budget.spend(1.0, now + 1.0)
        now += 0.5
    # The burst (1 s, and what refills while the first probe runs) lets two through at
    # once; then one each time 1 s was paid back at a tenth of a second per second.
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert starts[0] == 0.0
    assert gaps[0] <= 2.0
    assert all(9.5 <= g <= 10.5 for g in gaps[1:]), gaps
    assert len(starts) == 11


def test_the_bucket_never_holds_more_than_the_burst_and_a_clock_step_back_refills_nothing():
    budget = ProbeBudget(ProbeBudgetConfig(share=0.5, burst_s=1.0), now=100.0)
    budget.spend(3.0, 10_000.0)  # long idle: the bucket was full (1 s), not 4950 s
    assert not budget.allows(10_000.0)
    assert budget.ready_in(10_000.0) == pytest.approx(4.0)
    assert not budget.allows(9_000.0)  # the clock stepped back: still owed


@pytest.mark.parametrize(
    ("share", "burst"), [(0.0, 1.0), (1.5, 1.0), (float("nan"), 1.0), (0.1, 0.0)]
)
def test_config_is_checked(share, burst):
    with pytest.raises(ConfigError):
        ProbeBudgetConfig(share=share, burst_s=burst)


def test_spend_refuses_a_bad_charge():
    budget = ProbeBudget(now=0.0)
    for bad in (-1.0, float("inf")):
        with pytest.raises(ValueError, match="finite and >= 0"):
            budget.spend(bad, 0.0)


class Control:
    def __init__(self, peers):
        self.peers = peers

    def publish(self, topic: str, data: bytes) -> None:
        pass  # our links\' gossip: nobody listens here

    def connected_peers(self):
        return list(self.peers)


def _monitor(peers, probed, wire, budget):
    def lane_probe(peer, nbytes):
        probed.append(peer)
        return WireSample(1e6, 0.01, time.time())  # 1 MB/s: a 1 MiB probe is ~1 s of uplink

    members = {p: SimpleNamespace(peer_id=p, addrs=()) for p in ["a", *peers]}
    return LinkMonitor(
        control=Control(peers),
        book=BandwidthBook(max_age_s=60.0),
        peer_id="a",
        swarm="demo",
        topic="t",
        probe_interval_s=2.0,
        probe_fanout=4,
        probe_bytes=1 << 20,
        max_connections=8,
        members=lambda: members,
        neighbours=lambda: ["b"],
        stop=threading.Event(),
        wire=lambda: wire,
        lane_probe=lane_probe,
        probe_budget=budget,
    ), members


def test_a_round_stops_when_the_budget_is_spent():
    probed = []
    link_monitor, members = _monitor(
        ["b", "c", "d", "e"], probed, {}, ProbeBudgetConfig(burst_s=1.5)
    )
    link_monitor._probe_round(members)
    assert len(probed) == 2  # ~1 s each: the second overdraws the 1.5 s burst, the rest wait
    link_monitor._probe_round(members)
    assert len(probed) == 2  # ~5 s owed at a tenth of the time


def test_links_our_lanes_measure_are_not_probed():
    probed, now = [], time.time()
    wire = {
        "b": WireSample(2e6, 0.02, now - 5.0),  # a training lane, busy 5 s ago: fresh
        "c": WireSample(2e6, 0.02, now - 300.0),  # idle for minutes: probe it
        "d": WireSample(2e6, 0.02, now - 300.0, punched=True),  # punched: never probed
    }
    link_monitor, members = _monitor(["b", "c", "d", "e"], probed, wire, None)
    link_monitor._probe_round(members)
    # b's frames never filled its link: one bulk probe, then its frames go by for a while.
    assert sorted(probed) == ["b", "c", "e"]
    assert link_monitor.book.last_measured("a", time.time()).keys() >= {"b", "c", "e"}
    probed.clear()
    link_monitor._probe_round(members)
    assert sorted(probed) == ["c", "e"]
    # Half the book's max age (30 s) after its last bulk probe, b gets another.
    link_monitor._bulk_at["b"] -= 31.0
    probed.clear()
    link_monitor._probe_round(members)
    assert sorted(probed) == ["b", "c", "e"]


def test_lane_figures_are_filed_once_a_probe_interval_per_link():
    probed, wire = [], {}
    link_monitor, members = _monitor(["b"], probed, wire, None)
    now = time.time()
    wire["b"] = WireSample(2e6, 0.02, now - 0.5)
    assert link_monitor.file_wire(members) == 1
    wire["b"] = WireSample(3e6, 0.02, now - 0.2)  # newer, but within the 2 s interval
    assert link_monitor.file_wire(members) == 0
    link_monitor._filed_at["b"] -= 2.0
    assert link_monitor.file_wire(members) == 1


def test_without_lane_figures_every_link_is_probed():
    probed = []
    link_monitor, members = _monitor(["b", "c", "d"], probed, {}, None)
    link_monitor._probe_round(members)
    assert sorted(probed) == ["b", "c", "d"]


def test_a_round_probes_every_link_never_measured_whatever_the_fanout():
    probed = []
    link_monitor, members = _monitor(["b", "c", "d"], probed, {}, None)
    link_monitor.probe_fanout = 1
    link_monitor._probe_round(members)
    assert sorted(probed) == ["b", "c", "d"]
    probed.clear()
    link_monitor._probe_round(members)
    assert len(probed) == 1  # all measured now: the fanout again
