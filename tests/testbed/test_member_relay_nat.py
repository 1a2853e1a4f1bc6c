"""A members-only relay across the testbed's home routers: a member behind a cone router
reserves a slot on a public member's relay, and a member behind a symmetric router (no hole
can be punched to it or from it) reaches it through the relay; a stranger cannot."""

import json
import sys

import pytest

from fusionllm.node.children import JsonChild
from fusionllm.node.p2p.identity import load_or_create_identity, peer_id_of
from fusionllm.testbed.bed import Testbed
from fusionllm.testbed.topology import parse_topology
from tests.support.routers import needs_routers

pytestmark = [pytest.mark.testbed, pytest.mark.timeout(180), needs_routers]

ME = [sys.executable, "-m", "tests.support.relay_main"]
TOPOLOGY = {
    "name": "relay",
    "defaults": {"delay_ms": 10, "rate_mbps": 100},
    "hosts": [
        {"name": "pub"},
        {"name": "cone", "nat": "cone"},
        {"name": "sym", "nat": "symmetric"},
        {"name": "out"},
    ],
}


def _echo(bed: Testbed, host: str, key, relay: str, listener: str) -> dict:
    done = bed.run(host, [*ME, "dialer", str(key), bed.address(host), relay, listener],
                   timeout=90)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_symmetric_home_reaches_a_cone_home_through_a_members_relay(tmp_path):
    keys = {n: tmp_path / f"{n}.key" for n in ("pub", "cone", "sym", "out")}
    ids = {n: peer_id_of(load_or_create_identity(k)) for n, k in keys.items()}
    members = [ids[n] for n in ("pub", "cone", "sym")]
    with Testbed(parse_topology(TOPOLOGY)) as bed:
        relay_argv = [*ME, "relay", str(keys["pub"]), bed.address("pub"), *members]
        with JsonChild(bed.command("pub", relay_argv), stdin=True, name="relay") as relay:
            addr = relay.next_event(60)["addr"]
            argv = [*ME, "listener", str(keys["cone"]), bed.address("cone"), addr]
            with JsonChild(bed.command("cone", argv), stdin=True, name="listener") as home:
                assert home.next_event(60) == {"event": "reserved", "ok": True}
                through = _echo(bed, "sym", keys["sym"], addr, ids["cone"])
                stranger = _echo(bed, "out", keys["out"], addr, ids["cone"])
            relay.close_stdin()
            counts = relay.next_event(20)
    print(through, stranger)
    assert through == {"event": "echo", "answer": "hello", "kind": "relayed"}
    assert "error" in stranger, stranger
    assert counts["refused"] >= 1, counts  # the relay turned the stranger away
