"""links.py: a backed-off probe round wakes up for a member change, not only for the clock."""

import threading
import time

from fusionllm.node.control.bandwidth import BandwidthBook
from fusionllm.node.control.links import LinkMonitor


def monitor(members, stop: threading.Event) -> LinkMonitor:
    link_monitor = LinkMonitor(
        control=None,  # _wait never touches the host
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
    )
    link_monitor.MEMBER_CHECK_S = 0.01
    return link_monitor


def test_a_newcomer_ends_the_wait_early():
    seen = {"a": None, "b": None}
    calls = []

    def members():
        calls.append(1)
        if len(calls) == 3:
            seen["c"] = None  # a newcomer's record shows
        return dict(seen)

    started = time.monotonic()
    stopped = monitor(members, threading.Event())._wait(30.0, frozenset("ab"))
    assert not stopped
    assert time.monotonic() - started < 5.0
    assert len(calls) == 3


def test_the_same_members_wait_the_whole_time_and_stop_ends_it():
    stop = threading.Event()
    link_monitor = monitor(lambda: {"a": None, "b": None}, stop)
    started = time.monotonic()
    assert not link_monitor._wait(0.1, frozenset("ab"))
    assert time.monotonic() - started >= 0.1
    threading.Timer(0.05, stop.set).start()
    started = time.monotonic()
    assert link_monitor._wait(30.0, frozenset("ab"))
    assert time.monotonic() - started < 5.0
