"""Announced addresses: parsing, the multiaddrs each plane announces, the reachability warning."""

import logging
from pathlib import Path

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.dht.client import DhtConfig
from fusionllm.node.control.node_config import NodeConfig
from fusionllm.node.p2p.announce import (
    AnnounceAddr,
    announced_multiaddrs,
    bootstrap_is_public,
    warn_if_unreachable,
)
from fusionllm.node.p2p.peer_host import HostConfig


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("203.0.113.7", "203.0.113.7", None),
        ("203.0.113.7:4001", "203.0.113.7", 4001),
        (" 10.0.0.1:1 ", "10.0.0.1", 1),
        ("2001:db8::1", "2001:db8::1", None),
        ("[2001:db8::1]:65535", "2001:db8::1", 65535),
        ("[::1]", "::1", None),
    ],
)
def test_an_address_parses_with_or_without_a_port(text, host, port):
    assert AnnounceAddr.parse(text) == AnnounceAddr(host=host, port=port)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("example.org:4001", r"announce address must be an IP address, got 'example.org'"),
        ("1.2.3.4:http", r"port 'http' is not a number"),
        ("1.2.3.4:0", r"announce port must be an integer in \[1, 65535\], got 0"),
        ("1.2.3.4:70000", r"announce port must be an integer in \[1, 65535\], got 70000"),
        ("[::1", r"expected \[IPv6\]:PORT"),
        ("[::1]4001", r"expected \[IPv6\]:PORT"),
        ("", r"must be an IP address, got ''"),
    ],
)
def test_a_bad_address_is_refused(text, match):
    with pytest.raises(ConfigError, match=match):
        AnnounceAddr.parse(text)


def test_each_address_keeps_its_port_or_takes_the_planes():
    addrs = [AnnounceAddr.parse("203.0.113.7:4001"), AnnounceAddr.parse("2001:db8::1")]
    assert announced_multiaddrs(addrs, 5000) == (
        "/ip4/203.0.113.7/tcp/4001",
        "/ip6/2001:db8::1/tcp/5000",
    )
    assert announced_multiaddrs([], 0) == ()
    assert announced_multiaddrs(addrs[:1], 0) == ("/ip4/203.0.113.7/tcp/4001",)
    with pytest.raises(
        ConfigError, match=r"announced port must be an integer in \[1, 65535\], got 0"
    ):
        announced_multiaddrs(addrs, 0)


def _node(tmp_path: Path, **fields) -> NodeConfig:
    return NodeConfig(key_path=tmp_path / "k", **fields)


def test_the_dht_announces_each_ip_at_its_own_port(tmp_path):
    announce = (AnnounceAddr.parse("203.0.113.7:4001"), AnnounceAddr.parse("198.51.100.2"))
    node = _node(tmp_path, announce=announce, dht_port=4002)
    assert node.dht_announce_maddrs() == ("/ip4/203.0.113.7/tcp/4002", "/ip4/198.51.100.2/tcp/4002")
    forwarded = _node(tmp_path, announce=announce, dht_port=4002, announce_dht_port=9002)
    assert forwarded.dht_announce_maddrs()[0] == "/ip4/203.0.113.7/tcp/9002"
    assert node.host_config().announce == announce
    assert _node(tmp_path, announce_lane_port=9003).transport_config().lane_announce_port == 9003
    assert _node(tmp_path).dht_announce_maddrs() == ()


def test_announcing_needs_a_fixed_dht_port(tmp_path):
    announce = (AnnounceAddr.parse("203.0.113.7"),)
    with pytest.raises(ConfigError, match=r"need a fixed dht_port \(or announce_dht_port\)"):
        _node(tmp_path, announce=announce)
    assert _node(tmp_path, announce=announce, announce_dht_port=1).dht_announce_maddrs()


def test_configs_refuse_bad_announcements(tmp_path):
    with pytest.raises(ConfigError, match=r"announce must hold AnnounceAddr values"):
        HostConfig(key_path=tmp_path / "k", announce=("1.2.3.4",))
    with pytest.raises(ConfigError, match=r"announce_lane_port must be an integer"):
        _node(tmp_path, announce_lane_port=-1)
    for bad in ("/ip4/1.2.3.4/tcp/0", "/dns/x/tcp/1", "1.2.3.4:5", "/ip4/1.2.3.4/udp/5"):
        with pytest.raises(ConfigError, match=r"announce_maddrs: expected /ip4\|ip6/IP/tcp/PORT"):
            DhtConfig(swarm="s", announce_maddrs=(bad,))
    good = DhtConfig(swarm="s", announce_maddrs=["/ip4/1.2.3.4/tcp/5"])
    assert good.worker_config()["announce"] == ["/ip4/1.2.3.4/tcp/5"]


def test_public_bootstrap_peers_are_recognised():
    assert bootstrap_is_public(["/ip4/8.8.8.8/tcp/1/p2p/Qm"])
    assert bootstrap_is_public(["/ip4/127.0.0.1/tcp/1", "/ip6/2606:4700::1/tcp/1"])
    assert not bootstrap_is_public(
        ["/ip4/192.168.1.2/tcp/1", "/ip4/10.0.0.1/tcp/2", "/dns/x/tcp/1"]
    )
    assert not bootstrap_is_public(["garbage", "/ip4/not-an-ip/tcp/1", ""])


def test_only_private_addresses_with_public_bootstrap_peers_warn(caplog):
    log = logging.getLogger("test_announce")
    public_peer = ["/ip4/8.8.8.8/tcp/1"]
    with caplog.at_level(logging.WARNING, logger="test_announce"):
        assert warn_if_unreachable(log, ["192.168.1.5"], public_peer)
        assert "advertises only private addresses (192.168.1.5)" in caplog.text
        caplog.clear()
        assert not warn_if_unreachable(log, ["192.168.1.5", "203.0.114.1"], public_peer)
        assert not warn_if_unreachable(log, ["192.168.1.5"], ["/ip4/192.168.1.1/tcp/1"])
        assert not warn_if_unreachable(log, ["0.0.0.0"], public_peer)  # every interface
        assert not warn_if_unreachable(log, ["127.0.0.1"], [])
    assert caplog.text == ""
