"""Home routers as plans: topology keys, LAN addresses, the nftables rules per NAT kind."""

import pytest

from fusionllm.testbed.bed import Testbed, TestbedConfig
from fusionllm.testbed.errors import TestbedError
from fusionllm.testbed.nat import NAT_KINDS, home_lan, ruleset
from fusionllm.testbed.topology import TopologyError, load_topology, parse_topology

HOMES = {
    "name": "h",
    "hosts": [{"name": "pub"}, {"name": "c", "nat": "cone"}, {"name": "s", "nat": "symmetric"}],
}


def test_a_home_gets_a_lan_of_its_own_by_its_index():
    lan = home_lan("192.168", 2)
    assert (lan.router, lan.node, lan.network, lan.prefix_len) == (
        "192.168.3.1", "192.168.3.2", "192.168.3.0", 24,
    )  # fmt: skip
    assert home_lan("10.77", 0).node == "10.77.1.2"


@pytest.mark.parametrize(
    ("prefix", "index", "match"),
    [("192.168.1", 0, "two octets"), ("192.300", 0, "two octets"), ("10.0", 255, "index 255")],
)
def test_a_lan_that_cannot_be_is_refused(prefix, index, match):
    with pytest.raises(ValueError, match=match):
        home_lan(prefix, index)


def test_the_router_masquerades_its_lan_and_drops_what_comes_in_unasked():
    lan = home_lan("192.168", 0)
    cone, symmetric = ruleset("cone", lan), ruleset("symmetric", lan)
    for rules in (cone, symmetric):
        assert 'oifname "wan0" ip saddr 192.168.1.0/24 masquerade' in rules
        assert "hook forward priority filter; policy drop;" in rules
        assert "ct state established,related accept" in rules
        assert 'iifname "wan0" drop' in rules  # nothing new reaches the router itself
    assert "fully-random" in symmetric
    assert "random" not in cone  # port-preserving: a socket keeps its port for every peer
    with pytest.raises(ValueError, match="'full-cone'"):
        ruleset("full-cone", lan)


def test_a_topology_names_the_nat_a_host_sits_behind():
    topo = parse_topology(HOMES)
    assert [h.nat for h in topo.hosts] == [None, "cone", "symmetric"]
    bad = {"hosts": [{"name": "a", "nat": "upnp"}]}
    with pytest.raises(TopologyError, match=r"host a: nat 'upnp' not one of"):
        parse_topology(bad)
    shipped = load_topology("homes")
    assert {h.nat for h in shipped.hosts} == {None, *NAT_KINDS}


def test_a_home_binds_its_lan_address_and_is_reached_at_its_routers():
    bed = Testbed(parse_topology(HOMES), TestbedConfig(subnet="10.9.0", lan_prefix="10.66"))
    assert bed.address("pub") == bed.wan_address("pub") == "10.9.0.1"
    assert (bed.address("c"), bed.wan_address("c")) == ("10.66.2.2", "10.9.0.2")
    assert (bed.address("s"), bed.wan_address("s")) == ("10.66.3.2", "10.9.0.3")
    assert bed.router_netns("s") == f"{bed.tag}-s.nat"  # '.': in no host's name
    assert bed.netns("s") == f"{bed.tag}-s"  # where the home's processes run
    with pytest.raises(TestbedError, match="pub is not behind NAT"):
        bed.router_netns("pub")
    with pytest.raises(ValueError, match="lan_prefix"):
        TestbedConfig(lan_prefix="192.168.0")
