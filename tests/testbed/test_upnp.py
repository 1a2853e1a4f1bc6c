"""A home node behind a router that maps ports on request (UPnP-IGD: Debian's miniupnpd in
the router's namespace, testbed/igd.py) is ``mapped``, not relayed (issue 30).

Two real ``fusionllm node`` processes (``--no-train``: nothing here needs a model): a public
one and a home behind a cone router running miniupnpd. The home's members find it private
first; it maps its port on the router and is dialled back there: verdict ``mapped``, its
record names the router's address first and no relay. From the public host a fresh TCP
connection to that address meets the home's libp2p host (multistream-select answers). When
the home node stops (SIGTERM), its mapping is gone from the router.

The testbed's "internet" is a global block here: miniupnpd, like the node, refuses to map
behind a private WAN address (a second NAT).
"""

import json
import signal
import sys

import pytest

from fusionllm.node.local_swarm import LocalSwarm, wait_for
from fusionllm.testbed.bed import Testbed, TestbedConfig
from fusionllm.testbed.igd import RouterIgd, unavailable
from fusionllm.testbed.nat import home_lan
from fusionllm.testbed.topology import parse_topology
from tests.support.routers import needs_routers

pytestmark = [
    pytest.mark.testbed,
    pytest.mark.timeout(300),
    needs_routers,
    pytest.mark.skipif(unavailable() is not None, reason=f"no IGD in the testbed: {unavailable()}"),
]

SUBNET = "11.250.0"  # global, as the router's WAN address must be (module docstring)
TOPOLOGY = {
    "name": "upnp",
    "defaults": {"delay_ms": 5},
    "hosts": [{"name": "pub"}, {"name": "home", "nat": "cone"}],
}
OPTIONS = {"no-train": True, "heartbeat": 1.0, "ttl": 5.0}
MULTISTREAM = b"/multistream/1.0.0\n"

# Run on the public host: dial ADDR:PORT and speak multistream-select's first line; prints
# what came back (a libp2p host answers with the same protocol id).
_DIAL = f"""
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
s.sendall(bytes([{len(MULTISTREAM)}]) + {MULTISTREAM!r})
s.settimeout(5)
print(s.recv(64))
"""


def _home_port(node) -> int:
    return int(node.last("ready")["addrs"][0].split("/tcp/")[1].split("/")[0])


def test_a_home_behind_a_upnp_router_is_mapped_dialled_directly_and_unmapped_on_leave(tmp_path):
    topology = parse_topology(TOPOLOGY)
    with Testbed(topology, TestbedConfig(subnet=SUBNET)) as bed:
        lan = home_lan(bed.config.lan_prefix, 1)
        with RouterIgd(bed.router_netns("home"), lan, tmp_path) as igd:
            swarm = LocalSwarm(tmp_path, extra=OPTIONS)
            try:
                _run(bed, swarm, igd)
            except BaseException:
                print(swarm.logs()[-12000:], igd.log[-3000:])
                raise
            finally:
                swarm.close()


def _run(bed: Testbed, swarm: LocalSwarm, igd: RouterIgd) -> None:
    pub = swarm.start("pub", extra={"host": bed.address("pub")}, prefix=bed.command("pub", []))
    wait_for(lambda: pub.last("ready"), 90, "the public node to be ready")
    home = swarm.start("home", bootstrap=pub.dht_addr, extra={"host": bed.address("home")},
                       prefix=bed.command("home", []))  # fmt: skip
    wait_for(lambda: home.last("ready"), 90, "the home node to be ready")
    port, wan = _home_port(home), bed.wan_address("home")
    reach = wait_for(lambda: home.last("reachability"), 60, "the home's verdict")
    assert reach["verdict"] == "mapped", reach
    assert reach["upnp"] is True
    assert reach["addrs"] == [f"{wan}:{port}"]  # the public node dialled it back there
    assert f"dport {port} dnat ip to {bed.address('home')}:{port}" in igd.mappings()
    # the public host meets the home's libp2p host at the router's address, no relay between
    dial = bed.run("pub", [sys.executable, "-c", _DIAL, wan, str(port)], timeout=30)
    assert MULTISTREAM.rstrip().decode() in dial.stdout, (dial.stdout, dial.stderr[-2000:])
    # its record (what peers dial) names the mapped address first, and no relayed one
    record = _record_of(bed, pub, home, f"/ip4/{wan}/tcp/{port}/p2p/{home.peer_id}")
    assert record["reach"] == "mapped", record
    assert record["relays"] == []
    # SIGTERM: the home leaves and takes its mapping with it
    home.kill(signal.SIGTERM)
    assert home.process.returncode == 0, swarm.logs()[-4000:]
    assert f"dport {port} " not in igd.mappings()
    assert "UPnP mappings removed: the node leaves" in home.log_path.read_text()


def _record_of(bed: Testbed, pub, home, want: str) -> dict:
    """The home's entry in ``fusionllm status --json`` run on the public host, once it names
    ``want`` first (its record after the verdict)."""
    argv = [sys.executable, "-m", "fusionllm.node.cli.main", "--log-level", "WARNING",
            "status", "--bootstrap", pub.dht_addr, "--json", "--timeout", "30"]  # fmt: skip
    seen: list[dict] = []

    def named() -> dict | None:
        done = bed.run("pub", argv, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        seen[:] = [p for p in json.loads(done.stdout)["peers"] if p["peer_id"] == home.peer_id]
        return seen[0] if seen and seen[0]["addrs"][:1] == [want] else None

    try:
        return wait_for(named, 60, f"status to show the home at {want}", poll=1.0)
    except AssertionError:
        raise AssertionError(f"status said {seen}") from None
