"""Home routers in the testbed: a node behind NAT dials out, nobody dials in, and the two
router kinds map ports as a cone and a symmetric NAT do.

Three public hosts and three homes (two ``nat = "cone"``, one ``"symmetric"``), plain sockets
(the netcheck tools). This is what the NAT traversal work (issue 30) is tested against.
"""

import pytest

from fusionllm.testbed import paths
from fusionllm.testbed.bed import Testbed, leftovers
from fusionllm.testbed.topology import parse_topology
from tests.support.routers import needs_routers

pytestmark = [pytest.mark.testbed, pytest.mark.timeout(120), needs_routers]

DIAL_IN_TIMEOUT_S = 2.0
TOPOLOGY = {
    "name": "nat",
    "defaults": {"delay_ms": 5},
    "hosts": [
        {"name": "pub1"},
        {"name": "pub2"},
        {"name": "pub3"},
        {"name": "cone", "nat": "cone", "uplink_mbps": 20},
        {"name": "cone2", "nat": "cone"},
        {"name": "sym", "nat": "symmetric"},
    ],
}


@pytest.fixture(scope="module")
def bed():
    with Testbed(parse_topology(TOPOLOGY)) as testbed:
        yield testbed
    assert leftovers(testbed.tag) == []  # routers' namespaces too


@pytest.mark.parametrize("home", ["cone", "sym"])
def test_a_home_node_dials_out_and_is_seen_at_its_routers_address(bed, home):
    assert bed.address(home).startswith("192.168.")
    assert bed.address(home) != bed.wan_address(home)
    seen = paths.mappings(bed, home, ["pub1"])["seen"]
    assert [s["addr"] for s in seen] == [bed.wan_address(home)]


def test_a_cone_router_keeps_a_sockets_port_for_every_destination(bed):
    result = paths.mappings(bed, "cone", ["pub1", "pub2", "pub3"])
    print(result)
    ports = [s["port"] for s in result["seen"]]
    assert ports == [result["local_port"]] * 3  # the port a peer saw works for any other
    assert {s["addr"] for s in result["seen"]} == {bed.wan_address("cone")}


def test_a_symmetric_router_gives_each_destination_a_port_of_its_own(bed):
    result = paths.mappings(bed, "sym", ["pub1", "pub2", "pub3"])
    print(result)
    ports = [s["port"] for s in result["seen"]]
    assert len(set(ports)) == 3, ports  # random per connection: a punched port is useless
    assert {s["addr"] for s in result["seen"]} == {bed.wan_address("sym")}


@pytest.mark.parametrize("home", ["cone", "sym"])
def test_nothing_outside_a_home_can_dial_in(bed, home):
    server, port = paths.listen(bed, home)  # on the home node's LAN address
    try:
        inside = paths.dial(bed, home, bed.address(home), port, timeout=DIAL_IN_TIMEOUT_S)
        assert inside["connected"], inside  # the server is there
        paths.mappings(bed, home, ["pub1"])  # an outbound connection opens no door
        for outsider in ("pub1", "cone" if home == "sym" else "sym"):
            for addr in (bed.wan_address(home), bed.address(home)):
                tried = paths.dial(bed, outsider, addr, port, timeout=DIAL_IN_TIMEOUT_S)
                print(f"{outsider} -> {home} at {addr}: {tried}")
                assert not tried["connected"], (outsider, addr, tried)
    finally:
        server.kill()
        server.wait()


def test_a_homes_traffic_leaves_through_its_routers_shaped_uplink(bed):
    result = paths.stream(bed, "cone", "pub1", seconds=3.0, warmup=1.0)
    print(f"cone -> pub1 (20 Mbit/s uplink): {result}")
    assert result["mbps"] <= 20 * 1.02
    assert paths.link_bound_mbps(result) >= 20 * 0.8  # the sink's rate would read the CPU too


PUNCH_TIMEOUT_S = 8.0


def test_two_cone_homes_punch_a_tcp_hole_but_a_symmetric_one_cannot(bed):
    both = paths.punch(bed, "cone", "cone2", ports=(41001, 41002), timeout=PUNCH_TIMEOUT_S)
    print(f"cone <-> cone2: {both}")
    assert all(side["connected"] for side in both), both
    # the symmetric router maps sym's port 41004 to a random one: cone dials a closed door,
    # and sym's SYN reaches cone from a port cone's router never saw
    mixed = paths.punch(bed, "cone", "sym", ports=(41003, 41004), timeout=PUNCH_TIMEOUT_S)
    print(f"cone <-> sym: {mixed}")
    assert not any(side["connected"] for side in mixed), mixed
