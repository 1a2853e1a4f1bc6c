"""links.py: a backed-off probe round wakes up for a member change, not only for the clock."""

import threading
import time
from types import SimpleNamespace

from fusionllm.node.control.bandwidth import BandwidthBook, LinkSample
from fusionllm.node.control.links import LinkMonitor
from fusionllm.node.errors import TransportError


class FakeControl:
    """What _wait asks the control host: who we are connected to; connect() reaches the
    addresses in ``alive``."""

    def __init__(self, *peers: str, alive: tuple[str, ...] = ()) -> None:
        self.peers = list(peers)
        self.alive = alive

    def publish(self, topic: str, data: bytes) -> None:
        pass  # our links\' gossip: nobody listens here

    def connected_peers(self) -> list[str]:
        return list(self.peers)

    def connect(self, addr: str) -> None:
        if addr not in self.alive:
            raise TransportError(f"connection refused: {addr}")


def rec(peer: str, *, beat: int = 1) -> SimpleNamespace:
    """The fields of a NodeInfo that _wait reads."""
    return SimpleNamespace(peer_id=peer, beat=beat, time=1.0, addrs=(f"/ip4/{peer}",))


def monitor(members, stop: threading.Event, control=None, wakes=None, suspects=None) -> LinkMonitor:
    link_monitor = LinkMonitor(
        control=control or FakeControl("b"),
        book=BandwidthBook(max_age_s=60.0),
        peer_id="a",
        swarm="demo",
        topic="t",
        probe_interval_s=8.0,
        probe_fanout=2,
        probe_bytes=1 << 16,
        max_connections=8,
        members=members,
        neighbours=list,
        stop=stop,
        wake=(wakes if wakes is not None else []).append,
        suspect=lambda peer, since: (suspects if suspects is not None else []).append(peer),
    )
    link_monitor.MEMBER_CHECK_S = 0.01
    return link_monitor


def test_a_newcomer_ends_the_wait_early():
    seen = {"a": rec("a"), "b": rec("b")}
    calls = []

    def members():
        calls.append(1)
        if len(calls) == 3:
            seen["c"] = rec("c")  # a newcomer's record shows
        return dict(seen)

    started = time.monotonic()
    stopped = monitor(members, threading.Event())._wait(30.0, frozenset("ab"))
    assert not stopped
    assert time.monotonic() - started < 5.0
    assert len(calls) == 3


def test_the_same_members_wait_the_whole_time_and_stop_ends_it():
    stop = threading.Event()
    link_monitor = monitor(lambda: {"a": rec("a"), "b": rec("b")}, stop)
    started = time.monotonic()
    assert not link_monitor._wait(0.1, frozenset("ab"))
    assert time.monotonic() - started >= 0.1
    threading.Timer(0.05, stop.set).start()
    started = time.monotonic()
    assert link_monitor._wait(30.0, frozenset("ab"))
    assert time.monotonic() - started < 5.0


def test_a_stranger_or_a_lost_member_wakes_a_quiet_node_once():
    stop = threading.Event()
    control, wakes = FakeControl("b"), []
    link_monitor = monitor(lambda: {"a": rec("a"), "b": rec("b")}, stop, control, wakes)
    assert not link_monitor._wait(0.05, frozenset("ab"))
    assert wakes == []  # connected to a member: nothing new
    control.peers = ["b", "stranger"]  # a newcomer connects to probe us
    assert not link_monitor._wait(0.05, frozenset("ab"))
    assert wakes == [True]  # once, however long it stays
    control.peers = ["stranger"]  # b's connection dropped: it may have crashed
    assert not link_monitor._wait(0.05, frozenset("ab"))
    assert wakes == [True, True]
    assert not link_monitor._wait(0.05, frozenset("ab"))
    assert wakes == [True, True]


def test_a_quiet_member_that_vanished_is_suspected_unless_it_answers():
    members = {"a": rec("a"), "quiet": rec("quiet", beat=4), "loud": rec("loud"),
               "back": rec("back", beat=4)}  # fmt: skip
    control = FakeControl("quiet", "loud", "back", alive=("/ip4/back",))
    wakes, suspects = [], []
    link_monitor = monitor(lambda: members, threading.Event(), control, wakes, suspects)
    assert not link_monitor._wait(0.05, frozenset(members))
    control.peers = []  # all three connections dropped
    assert not link_monitor._wait(0.05, frozenset(members))
    assert wakes == [True]
    # A loud member's record is suspected after the usual silence anyway; "back" took a
    # new connection: only the quiet one that cannot be reached is out now.
    assert suspects == ["quiet"]


def _connects_later(control: FakeControl, peer: str, after_calls: int):
    seen = {p: rec(p) for p in "abc"}
    calls = []

    def members():
        calls.append(1)
        if len(calls) == after_calls:
            control.peers.append(peer)  # connected since the last round (over a relay, say)
        return dict(seen)

    return members


def test_a_member_connected_since_the_round_and_never_measured_ends_the_wait():
    control = FakeControl("b")
    link_monitor = monitor(_connects_later(control, "c", 3), threading.Event(), control)
    link_monitor._probeable = frozenset({"b"})  # what the last round could probe
    started = time.monotonic()
    assert not link_monitor._wait(30.0, frozenset("abc"))
    assert time.monotonic() - started < 5.0


def test_a_member_connected_since_the_round_but_measured_waits_the_whole_time():
    control = FakeControl("b")
    link_monitor = monitor(_connects_later(control, "c", 3), threading.Event(), control)
    link_monitor._probeable = frozenset({"b"})
    link_monitor.book.record("a", "c", LinkSample(1e6, 0.01, time.time()), now=time.time())
    started = time.monotonic()
    assert not link_monitor._wait(0.3, frozenset("abc"))
    assert time.monotonic() - started >= 0.3


class NoLaneControl(FakeControl):
    """Connected to b over a relay: no lane ever opens; the stream probe works."""

    def __init__(self) -> None:
        super().__init__("b")
        self.probed: list[str] = []

    def probe(self, peer: str, *, nbytes: int):
        self.probed.append(peer)
        return SimpleNamespace(bandwidth=2e6, rtt=0.05, bytes=nbytes, seconds=0.1, relayed=True)


def test_a_link_that_waited_for_a_lane_ends_the_wait_once_its_patience_is_over():
    seen = {p: rec(p) for p in "ab"}
    control = NoLaneControl()
    link_monitor = monitor(lambda: dict(seen), threading.Event(), control)
    link_monitor.lane_patience_s = 0.3
    link_monitor._probe_round(seen)
    assert control.probed == []  # it waits for a lane first (a member not training yet)
    # A backed-off round would come minutes on (CI: two homes' relayed link unmeasured 3
    # minutes into a run); the wait ends once the patience is over, not before.
    started = time.monotonic()
    assert not link_monitor._wait(30.0, frozenset(seen))
    assert 0.3 <= time.monotonic() - started < 5.0
    link_monitor._probe_round(seen)
    assert control.probed == ["b"]
    assert link_monitor.book.last_measured("a", time.time()).keys() == {"b"}
    # Measured now, and its patience spent: the next wait is the whole wait.
    started = time.monotonic()
    assert not link_monitor._wait(0.3, frozenset(seen))
    assert time.monotonic() - started >= 0.3
