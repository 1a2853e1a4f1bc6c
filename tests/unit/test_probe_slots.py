"""Probe slots (control/probe_slots.py): one sender at a time into each member."""

import pytest

from fusionllm.node.control.probe_slots import MIN_SLOT_S, cycle_seconds, next_slot, slot_seconds

MEMBERS = ["a", "b", "c", "d", "e"]


def test_in_every_slot_each_member_is_in_one_probe_at_most():
    for members in (MEMBERS, MEMBERS[:4], MEMBERS[:2]):
        slots: dict[float, list[tuple[str, str]]] = {}
        for src in members:
            for dst in members:
                if src != dst:
                    start, end = next_slot(1000.0, src, dst, members, 2.0)
                    assert end - start == 2.0
                    slots.setdefault(start, []).append((src, dst))
        m = len(members) + len(members) % 2
        assert len(slots) == 2 * (m - 1)  # every ordered pair once a cycle, no slot idle
        for pairs in slots.values():
            ends = [x for pair in pairs for x in pair]
            assert len(ends) == len(set(ends)), pairs  # nobody in two probes at once
        starts = sorted(slots)
        assert starts[-1] - starts[0] == (2 * (m - 1) - 1) * 2.0  # within one cycle


def test_a_slot_half_gone_is_passed_up_for_the_next_cycle():
    start, end = next_slot(1000.0, "a", "e", MEMBERS, 2.0)
    assert next_slot(start + 0.9, "a", "e", MEMBERS, 2.0) == (start, end)
    assert next_slot(start + 1.1, "a", "e", MEMBERS, 2.0) == (start + 20.0, end + 20.0)


def test_the_same_view_gives_the_same_slots_whatever_the_order():
    shuffled = ["d", "b", "e", "a", "c"]
    assert next_slot(77.0, "b", "d", shuffled, 1.0) == next_slot(77.0, "b", "d", MEMBERS, 1.0)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="two of the members"):
        next_slot(1.0, "z", "a", MEMBERS, 1.0)
    with pytest.raises(ValueError, match="two of the members"):
        next_slot(1.0, "a", "a", MEMBERS, 1.0)
    with pytest.raises(ValueError, match="finite"):
        next_slot(float("nan"), "a", "b", MEMBERS, 1.0)
    with pytest.raises(ValueError, match="probe_bytes"):
        slot_seconds(0)


def test_a_cycle_gives_every_ordered_pair_its_slot_once():
    for members in (2, 3, 4, 5, 6):
        peers = [f"p{i}" for i in range(members)]
        cycle = cycle_seconds(members, 1.0)
        starts = {next_slot(0.0, a, b, peers, 1.0)[0] for a in peers for b in peers if a != b}
        assert len(starts) == members * (members - 1) // (members // 2)  # pairs a slot
        assert max(starts) < cycle
    assert (cycle_seconds(1, 2.0), cycle_seconds(4, 2.0), cycle_seconds(5, 2.0)) == (0, 12, 20)
    with pytest.raises(ValueError, match="must be >= 0"):
        cycle_seconds(-1, 1.0)


def test_slots_scale_with_the_probe():
    assert slot_seconds(1 << 20) == 2.0
    assert slot_seconds(64 << 10) == MIN_SLOT_S


def _slotted_monitor(lane_probe, *, slot_s: float, fanout: int = 4, stop=None, publish=None):
    """A LinkMonitor of member "a" among MEMBERS, connected to all, its rounds in slots."""
    import threading
    from types import SimpleNamespace

    from fusionllm.node.control.bandwidth import BandwidthBook
    from fusionllm.node.control.links import LinkMonitor

    members = {p: SimpleNamespace(peer_id=p, addrs=()) for p in MEMBERS}
    control = SimpleNamespace(
        connected_peers=lambda: [p for p in MEMBERS if p != "a"],
        publish=publish or (lambda topic, data: None),
    )
    monitor = LinkMonitor(
        control=control, book=BandwidthBook(max_age_s=60.0), peer_id="a", swarm="demo",
        topic="t", probe_interval_s=2.0, probe_fanout=fanout, probe_bytes=1 << 20,
        max_connections=8, members=lambda: members, neighbours=lambda: [],
        stop=stop or threading.Event(), lane_probe=lane_probe, probe_slot_s=slot_s,
    )  # fmt: skip
    return monitor, members


def test_a_probe_round_probes_each_target_inside_its_slot():
    import time

    from fusionllm.node.p2p.lane.wire_meter import WireSample

    started: list[tuple[str, float]] = []

    def lane_probe(peer: str, nbytes: int) -> WireSample:
        started.append((peer, time.time()))
        return WireSample(1e6, 0.01, time.time())

    monitor, members = _slotted_monitor(lane_probe, slot_s=0.1)
    monitor._probe_round(members)
    assert sorted(p for p, _ in started) == ["b", "c", "d", "e"]
    for peer, at in started:
        start, _ = next_slot(at, "a", peer, MEMBERS, 0.1)
        assert start <= at <= start + 0.05 + 0.03, (peer, at, start)  # a little lateness


def test_a_probe_round_waiting_for_a_slot_ends_when_the_node_stops():
    import threading
    import time

    from fusionllm.node.p2p.lane.wire_meter import WireSample

    stop, probed = threading.Event(), []
    monitor, members = _slotted_monitor(
        lambda peer, nbytes: probed.append(peer) or WireSample(1e6, 0.01, time.time()),
        slot_s=3600.0,
        stop=stop,
    )
    threading.Timer(0.2, stop.set).start()
    began = time.monotonic()
    monitor._probe_round(members)
    assert time.monotonic() - began < 5.0
    assert len(probed) <= 1  # at most one whose slot was already open


def test_a_link_measured_for_the_first_time_is_gossiped_at_once_not_as_the_round_ends():
    import time

    from fusionllm.node.control.bandwidth import BandwidthReport
    from fusionllm.node.p2p.lane.wire_meter import WireSample

    events: list[tuple[str, object]] = []

    def lane_probe(peer: str, nbytes: int) -> WireSample:
        events.append(("probe", peer))
        return WireSample(1e6, 0.01, time.time())

    def publish(topic: str, data: bytes) -> None:
        events.append(("gossip", sorted(x.peer for x in BandwidthReport.from_bytes(data).links)))

    monitor, members = _slotted_monitor(lane_probe, slot_s=0.05, fanout=1, publish=publish)
    monitor._probe_round(members)
    # Each new figure goes out before the next slot's probe, with those measured before it.
    probes = [peer for kind, peer in events if kind == "probe"]
    assert sorted(probes) == ["b", "c", "d", "e"]
    assert events == [
        item
        for k, peer in enumerate(probes)
        for item in (("probe", peer), ("gossip", sorted(probes[: k + 1])))
    ]
    events.clear()
    monitor._probe_round(members)  # every link measured: the round's end gossips them
    assert [kind for kind, _ in events] == ["probe"]
