"""The link prober's lane (lane/prober.py) between a real node process and a real transport on
127.0.0.1: a member with no lane to a peer opens one to probe it and gets a kernel-timed
figure; a peer that refuses lanes (not admitted, or lanes off) gives None, so the stream probe
follows; a lane that carries no frame is closed once idle (outbound.py, LANE_IDLE_S)."""

import time

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from fusionllm.node.p2p import outbound
from fusionllm.node.p2p.identity import peer_id_of
from fusionllm.node.p2p.lane.prober import LaneProber
from fusionllm.node.p2p.lane.wire_meter import WireSample
from fusionllm.node.p2p.transport import Transport, TransportConfig
from tests.support.transport_node import _WAIT_S, assert_node_still_echoes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

PROBE_BYTES = 2 << 20


def probed(prober: LaneProber, peer: str, deadline_s: float = 20.0) -> tuple[WireSample, int]:
    """The first figure the prober got (a loaded box may leave a probe's queue app-limited:
    no trusted sample) and after how many probes."""
    deadline, probes = time.monotonic() + deadline_s, 0
    while time.monotonic() < deadline:
        probes += 1
        sample = prober(peer, PROBE_BYTES)
        if sample is not None:
            return sample, probes
    raise AssertionError(f"no kernel-timed figure in {probes} lane probes")


def bytes_in_from(node, peer: str) -> int:
    return node.command(cmd="stats")["peers"].get(peer, {}).get("bytes_in", 0)


def wait_for_bytes_in(node, peer: str, at_least: int) -> int:
    """The node's count of our bytes once it read ``at_least`` (acked need not mean read)."""
    deadline = time.monotonic() + _WAIT_S
    while (got := bytes_in_from(node, peer)) < at_least:
        assert time.monotonic() < deadline, f"the node read {got} of our {at_least} bytes"
        time.sleep(0.05)
    return got


def test_a_member_without_a_lane_gets_one_opened_and_a_kernel_timed_figure(start_node, client):
    node = start_node("--admit", client.peer_id)  # a member, as trainer.admits lets members
    client.connect(node.addr)
    assert client.outbound_lanes() == []  # no frame sent yet: no lane
    sample, probes = probed(LaneProber(client.lane_senders, client.open_lane), node.peer_id)
    assert client.outbound_lanes() == [node.peer_id]
    assert sample.bandwidth > 1e6
    assert 0 < sample.rtt < 1.0
    assert not sample.punched
    # The filler went to the node over the lane (counted there as ours), and the lane now
    # carries our frames as one a frame opened would.
    wait_for_bytes_in(node, client.peer_id, probes * PROBE_BYTES)
    assert_node_still_echoes(client, node)
    assert client.outbound_lanes() == [node.peer_id]
    assert node.command(cmd="stats")["refusals"].get("lane_not_admitted", 0) == 0


def test_a_peer_that_does_not_admit_us_gives_none_so_the_stream_probe_follows(start_node, client):
    stranger_to_us = peer_id_of(create_new_key_pair())  # it admits someone else only
    node = start_node("--admit", stranger_to_us)
    client.connect(node.addr)
    prober = LaneProber(client.lane_senders, client.open_lane)
    started = time.monotonic()
    assert prober(node.peer_id, PROBE_BYTES) is None
    assert time.monotonic() - started < _WAIT_S
    assert client.outbound_lanes() == []
    assert node.command(cmd="stats")["refusals"].get("lane_not_admitted", 0) >= 1
    assert bytes_in_from(node, client.peer_id) == 0  # no filler went anywhere


def test_a_peer_without_lanes_gives_none(start_node, client):
    node = start_node("--no-lanes")
    client.connect(node.addr)
    assert LaneProber(client.lane_senders, client.open_lane)(node.peer_id, PROBE_BYTES) is None
    assert client.outbound_lanes() == []
    assert_node_still_echoes(client, node)  # its frames go over a stream, as before
    assert client.outbound_lanes() == []


def test_a_sender_without_lanes_opens_none(tmp_path, plain_node):
    config = TransportConfig(key_path=tmp_path / "plain.key", lanes=False)
    with Transport(config) as plain:
        plain.connect(plain_node.addr)
        assert plain.open_lane(plain_node.peer_id, _WAIT_S) is False
        assert LaneProber(plain.lane_senders, plain.open_lane)(plain_node.peer_id, 1 << 16) is None
        assert plain.outbound_lanes() == []


def test_a_lane_that_carries_no_frame_is_closed_once_idle(monkeypatch, plain_node, client):
    monkeypatch.setattr(outbound, "LANE_IDLE_S", 2.0)
    node = plain_node
    client.connect(node.addr)
    assert client.open_lane(node.peer_id, _WAIT_S) is True
    assert client.open_lane(node.peer_id, _WAIT_S) is True  # open already: at once
    assert client.outbound_lanes() == [node.peer_id]
    deadline = time.monotonic() + _WAIT_S
    while client.outbound_lanes() or client.tracked_peers()["outbound"]:  # its writer too
        assert time.monotonic() < deadline, "the idle lane was never closed"
        time.sleep(0.1)
    monkeypatch.setattr(outbound, "LANE_IDLE_S", 300.0)  # the next lane stays while we look
    assert_node_still_echoes(client, node)  # the next frame opens a new lane
    assert client.outbound_lanes() == [node.peer_id]
