"""A real ``fusionllm node`` behind a home router (cone NAT) and one on a public address:
each learns from the other's dial-back whether peers can dial it, says so in an event and
its record, and ``fusionllm status`` (run on the public host) shows both verdicts.

Two nodes only and no plan (``min-peers`` 3): this checks reachability, not training.
"""

import json
import sys

import pytest

from fusionllm.node.local_swarm import LocalSwarm, wait_for
from fusionllm.testbed.bed import Testbed
from fusionllm.testbed.topology import parse_topology
from tests.support.routers import needs_routers

pytestmark = [pytest.mark.testbed, pytest.mark.timeout(300), needs_routers]

TOPOLOGY = {
    "name": "home",
    "defaults": {"delay_ms": 10},
    "hosts": [{"name": "pub"}, {"name": "home", "nat": "cone", "uplink_mbps": 20}],
}
RUN = {"min-peers": 3, "threads": 1, "heartbeat": 2.0, "ttl": 10.0}


def _verdict(node) -> str | None:
    event = node.last("reachability")
    return event["verdict"] if event else None


def _reach(bed: Testbed, bootstrap: str) -> dict:
    """``fusionllm status`` on the public host: each peer's reach."""
    argv = [sys.executable, "-m", "fusionllm.node.cli.main", "--log-level", "WARNING",
            "status", "--bootstrap", bootstrap, "--json", "--timeout", "60"]  # fmt: skip
    done = bed.run("pub", argv, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return {p["peer_id"]: p["reach"] for p in json.loads(done.stdout)["peers"]}


def test_a_home_node_learns_it_is_private_and_status_says_so(tmp_path):
    with Testbed(parse_topology(TOPOLOGY)) as bed:
        swarm = LocalSwarm(tmp_path, extra=RUN)
        try:
            pub = swarm.start("pub", extra={"host": bed.address("pub")},
                              prefix=bed.command("pub", []))  # fmt: skip
            wait_for(lambda: pub.last("ready"), 90, "the public node to be ready")
            home = swarm.start("home", bootstrap=pub.dht_addr,
                               extra={"host": bed.address("home")},
                               prefix=bed.command("home", []))  # fmt: skip
            wait_for(lambda: _verdict(pub) == "public" and _verdict(home) == "private", 120,
                     "a verdict from each node")  # fmt: skip
            assert home.last("reachability")["observed"] == [bed.wan_address("home")]
            assert pub.last("reachability")["addrs"][0].startswith(bed.address("pub") + ":")
            want = {pub.peer_id: "public", home.peer_id: "private"}
            seen: list[dict] = []  # a status call may read a record written before the verdict
            try:
                wait_for(lambda: seen.append(_reach(bed, pub.dht_addr)) or seen[-1] == want,
                         90, "status to show both verdicts")  # fmt: skip
            except AssertionError:
                raise AssertionError(f"status showed {seen[-3:]}, want {want}") from None
        except BaseException:
            print(swarm.logs())
            raise
        finally:
            swarm.close()
