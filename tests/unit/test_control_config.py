"""ControlConfig validation and the control host's pure parts (token buckets, inbox)."""

import dataclasses
import math
import threading
from pathlib import Path

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.node.errors import DeadlineError, TransportClosedError
from fusionllm.node.p2p.control_host import (
    MAX_GOSSIP_BYTES,
    MAX_PROBE_BYTES,
    ControlConfig,
    GossipMessage,
)
from fusionllm.node.p2p.gossip import Inbox, TokenBuckets


def config(**overrides) -> ControlConfig:
    return ControlConfig(key_path=Path("/nonexistent/key"), **overrides)


def test_defaults_are_valid_and_match_the_interface():
    c = config()
    assert c.listen_host == "127.0.0.1"
    assert c.listen_port == 0
    assert c.dial_timeout_s == 5.0
    assert c.gossip_heartbeat_s == 2.0
    assert c.max_message_bytes == 64 << 10
    assert c.max_messages_per_peer_per_s == 5.0
    assert c.probe_bytes == 1 << 20
    assert c.max_probe_bytes == 4 << 20
    assert c.probe_timeout_s == 5.0
    assert c.max_probes_served_per_peer_per_min == 30
    assert str(c.host_config().listen_multiaddr) == "/ip4/127.0.0.1/tcp/0"


def test_key_path_becomes_a_path_and_config_is_frozen():
    c = ControlConfig(key_path="/tmp/key")  # type: ignore[arg-type]
    assert c.key_path == Path("/tmp/key")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.listen_port = 1  # type: ignore[misc]


def test_keyword_only():
    with pytest.raises(TypeError):
        ControlConfig(Path("/tmp/key"))  # type: ignore[misc]


def test_ipv6_listen_address():
    on_v6 = config(listen_host="::1", listen_port=4001).host_config()
    assert str(on_v6.listen_multiaddr) == "/ip6/::1/tcp/4001"


@pytest.mark.parametrize("host", ["localhost", "", "1.2.3", "example.com"])
def test_listen_host_must_be_an_ip(host):
    with pytest.raises(ConfigError, match="listen_host"):
        config(listen_host=host)


@pytest.mark.parametrize("port", [-1, 65536, 1.5, True])
def test_listen_port_range(port):
    with pytest.raises(ConfigError, match="listen_port"):
        config(listen_port=port)


@pytest.mark.parametrize(
    "name", ["dial_timeout_s", "close_timeout_s", "probe_timeout_s", "gossip_heartbeat_s"]
)
@pytest.mark.parametrize("value", [0, -1.0, math.nan, math.inf, "5"])
def test_durations_must_be_positive_and_finite(name, value):
    with pytest.raises(ConfigError, match=name):
        config(**{name: value})


@pytest.mark.parametrize("value", [0.01, 601.0])
def test_heartbeat_range(value):
    with pytest.raises(ConfigError, match="gossip_heartbeat_s"):
        config(gossip_heartbeat_s=value)


def test_fractional_heartbeat_is_allowed():
    assert config(gossip_heartbeat_s=0.25).gossip_heartbeat_s == 0.25


@pytest.mark.parametrize(
    ("low", "degree", "high"), [(5, 4, 12), (4, 13, 12), (0, 6, 12), (4, 6, 65)]
)
def test_gossip_degrees_must_be_ordered_and_in_range(low, degree, high):
    with pytest.raises(ConfigError, match="gossip_degree"):
        config(gossip_degree_low=low, gossip_degree=degree, gossip_degree_high=high)


@pytest.mark.parametrize("value", [0, MAX_GOSSIP_BYTES + 1, 1.0])
def test_max_message_bytes_range(value):
    with pytest.raises(ConfigError, match="max_message_bytes"):
        config(max_message_bytes=value)


def test_max_message_bytes_upper_bound_is_allowed():
    assert config(max_message_bytes=MAX_GOSSIP_BYTES).max_message_bytes == MAX_GOSSIP_BYTES


@pytest.mark.parametrize("name", ["max_messages_per_peer_per_s", "max_forwards_per_peer_per_s"])
@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf])
def test_rates_must_be_positive_and_finite(name, value):
    with pytest.raises(ConfigError, match=name):
        config(**{name: value})


def test_fractional_rate_is_allowed():
    assert config(max_messages_per_peer_per_s=0.5).max_messages_per_peer_per_s == 0.5


def test_probe_bytes_may_not_exceed_what_we_serve():
    with pytest.raises(ConfigError, match="probe_bytes"):
        config(probe_bytes=2 << 20, max_probe_bytes=1 << 20)
    assert config(probe_bytes=1 << 20, max_probe_bytes=1 << 20).probe_bytes == 1 << 20


@pytest.mark.parametrize("value", [0, MAX_PROBE_BYTES + 1])
def test_max_probe_bytes_range(value):
    with pytest.raises(ConfigError, match="max_probe_bytes"):
        config(max_probe_bytes=value, probe_bytes=1)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("probe_bytes", 0),
        ("max_probes_served_per_peer_per_min", -1),
        ("max_concurrent_probes_served", 0),
        ("inbox_size", 0),
        ("inbox_size", 1 << 21),
    ],
)
def test_counts_in_range(name, value):
    with pytest.raises(ConfigError, match=name):
        config(**{name: value})


def test_zero_probes_per_minute_means_serve_none():
    assert config(max_probes_served_per_peer_per_min=0).max_probes_served_per_peer_per_min == 0


# ----- token buckets --------------------------------------------------------------------------


def test_token_bucket_allows_a_burst_then_the_rate():
    buckets = TokenBuckets(5.0)
    assert [buckets.allow("a", 0.0) for _ in range(6)] == [True] * 5 + [False]
    assert buckets.allow("b", 0.0)  # per peer
    assert not buckets.allow("a", 0.1)  # half a token
    assert buckets.allow("a", 0.2)  # one token refilled
    assert not buckets.allow("a", 0.2)
    assert [buckets.allow("a", 100.0) for _ in range(6)] == [True] * 5 + [False]  # capped


def test_token_bucket_below_one_per_second():
    buckets = TokenBuckets(0.5)
    assert buckets.allow("a", 0.0)
    assert not buckets.allow("a", 1.0)
    assert buckets.allow("a", 2.0)


def test_token_buckets_forget_idle_peers_only(monkeypatch):
    monkeypatch.setattr("fusionllm.node.p2p.gossip._MAX_TRACKED_PEERS", 3)
    buckets = TokenBuckets(1.0)
    for peer in "abc":
        assert buckets.allow(peer, 0.0)
    assert buckets.allow("d", 0.5)  # over the cap, but a, b, c are not refilled yet
    assert len(buckets._buckets) == 4
    assert buckets.allow("e", 1.0)  # a, b, c refilled: forgotten, which changes nothing
    assert set(buckets._buckets) == {"d", "e"}


# ----- inbox ----------------------------------------------------------------------------------


def message(i: int) -> GossipMessage:
    return GossipMessage(topic="t", author="p", data=bytes([i]), received_at=0.0)


def test_inbox_is_fifo_and_drops_the_oldest_when_full():
    inbox = Inbox(2)
    assert inbox.put(message(1))
    assert inbox.put(message(2))
    assert not inbox.put(message(3))
    assert [inbox.get(0).data for _ in range(2)] == [b"\x02", b"\x03"]


def test_inbox_times_out_with_a_deadline_error():
    inbox = Inbox(1)
    with pytest.raises(DeadlineError):
        inbox.get(0.01)
    with pytest.raises(TimeoutError):  # DeadlineError is a TimeoutError too
        inbox.get(0)


def test_inbox_close_wakes_a_blocked_reader_and_keeps_what_is_left():
    inbox = Inbox(4)
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            inbox.get(None)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    inbox.close()
    thread.join(5)
    assert not thread.is_alive()
    assert isinstance(errors[0], TransportClosedError)

    inbox = Inbox(4)
    inbox.put(message(1))
    inbox.close()
    assert inbox.get(0).data == b"\x01"
    with pytest.raises(TransportClosedError):
        inbox.get(0)
