"""Two home nodes behind different NATs (a cone router, a symmetric one) train together on
adjacent stages, every tensor between them through a public node's relay, with no port
forward (issue 30).

The public node only relays (``--no-train``): seated, OP-Fence would rightly put it between
the homes (its links are the fast ones) and the homes would never exchange a tensor. Each
home learns it is private, reserves a slot on the public node's relay (the only member others
can dial) and names the relayed address in its record. The homes reach each other only
through that relay: no hole can be punched to a symmetric NAT (each home tries, and says it
failed once). The test waits until ``fusionllm status`` on the public host shows every link
measured over the path it takes (home to home relayed, the rest direct), then for ``STEPS``
more steps of a plan that seats the homes alone on two adjacent stages; the loss of the last
steps must be below that of the run's first steps; the homes' DHT daemons run as clients (the
public one's daemon dials their LAN addresses no more); and ``fusionllm status`` run behind
the symmetric NAT sees the same swarm. It also checks what test_home_node.py did before it
(each verdict, where members saw each node, status on the public host), which it replaced.
"""

import json
import sys

import pytest

from fusionllm.node.local_swarm import LocalSwarm, last_step, trained_steps, wait_for
from fusionllm.testbed.bed import Testbed
from fusionllm.testbed.topology import parse_topology
from tests.support.routers import needs_routers

pytestmark = [pytest.mark.testbed, pytest.mark.slow, pytest.mark.timeout(420), needs_routers]

STEPS = 30
TOPOLOGY = {
    "name": "nat-train",
    "defaults": {"delay_ms": 5, "rate_mbps": 100},
    "hosts": [
        {"name": "pub"},
        {"name": "cone", "nat": "cone"},
        {"name": "sym", "nat": "symmetric"},
    ],
}
RUN = {
    "steps": 0,  # no end: the test stops the nodes
    "seq-len": 32,
    "micro-batch-size": 2,
    "micro-batches": 2,
    "lr": 3e-3,
    "min-stages": 2,
    "min-peers": 2,
    "threads": 1,
    "step-timeout": 60,
    "dense": True,
    "heartbeat": 2.0,
    "ttl": 10.0,
    "epoch": 4.0,
    "probe-interval": 3.0,
    "probe-kib": 64,
}


def _status(bed: Testbed, bootstrap: str, host: str = "pub") -> dict:
    """``fusionllm status --json`` run on ``host``."""
    argv = [sys.executable, "-m", "fusionllm.node.cli.main", "--log-level", "WARNING",
            "status", "--bootstrap", bootstrap, "--json", "--timeout", "60"]  # fmt: skip
    done = bed.run(host, argv, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _paths(status: dict) -> dict[tuple[str, str], bool]:
    """(src, dst) -> relayed, for every link a member measured."""
    return {(link["src"], link["dst"]): link["relayed"] for link in status["links"]}


def _start(swarm: LocalSwarm, bed: Testbed, name: str, bootstrap: str | None = None, **more):
    extra = {"host": bed.address(name), **more}
    return swarm.start(name, bootstrap=bootstrap, extra=extra, prefix=bed.command(name, []))


def _plans(node) -> list[list[list[str]]]:
    """The seats (peers per stage) of every plan the node trained, in order."""
    return [e["stages"] for e in node.snapshot() if e.get("event") == "train_plan"]


def _dials_to(log_path, ip: str) -> int:
    """Dials of the node's DHT daemon (p2pd) to ``ip`` that failed, as its log tells."""
    return log_path.read_text().count(f"connect to {ip}:")


def test_two_homes_behind_nat_train_with_a_public_node_through_its_relay(tmp_path):
    with Testbed(parse_topology(TOPOLOGY)) as bed:
        swarm = LocalSwarm(tmp_path, extra=RUN)
        try:
            pub = _start(swarm, bed, "pub", **{"no-train": True})
            wait_for(lambda: pub.last("ready"), 90, "the public node to be ready")
            nodes = [pub, *(_start(swarm, bed, n, pub.dht_addr) for n in ("cone", "sym"))]
            wait_for(lambda: all(n.last("ready") for n in nodes), 120, "every node to be ready")
            ids = {n.name: n.peer_id for n in nodes}
            homes = {ids["cone"], ids["sym"]}
            want = {(a, b): a in homes and b in homes
                    for a in ids.values() for b in ids.values() if a != b}  # fmt: skip
            reach = {ids["pub"]: "public", ids["cone"]: "private", ids["sym"]: "private"}
            relays = {ids["pub"]: [], ids["cone"]: [ids["pub"]], ids["sym"]: [ids["pub"]]}
            seen: list[dict] = []

            def settled() -> bool:
                """One status that shows every link measured over its path, each verdict and
                each home's relay. A home's record drops its relay when a slot's renewal
                fails or the relay's record ages past its TTL (relay_use.py), and names it
                again at its next check, 10 s on: at load 25 one snapshot fell between."""
                seen.append(_status(bed, pub.dht_addr))
                paths, peers = _paths(seen[-1]), seen[-1]["peers"]
                return (all(paths.get(link) == relayed for link, relayed in want.items())
                        and {p["peer_id"]: p["reach"] for p in peers} == reach
                        and {p["peer_id"]: p["relays"] for p in peers} == relays)  # fmt: skip

            try:
                wait_for(settled, 180, "each link measured, each home relayed", poll=2.0)
            except AssertionError:
                raise AssertionError(
                    f"status said {seen[-1:]}; want links {want}, reach {reach}, relays {relays}"
                ) from None
            punched = [(x["src"], x["dst"]) for x in seen[-1]["links"] if x.get("punched")]
            assert punched == []  # nothing punches a symmetric NAT, nor between home and pub
            for home in nodes[1:]:  # members saw each home at its router's address
                assert home.last("reachability")["observed"] == [bed.wan_address(home.name)]
            assert pub.last("reachability")["addrs"][0].startswith(bed.address("pub") + ":")
            # The homes' DHT daemons run as clients now: the public one dials their LAN
            # addresses no more (as servers, every store and get that picked one did).
            lan = {home.name: bed.address(home.name) for home in nodes[1:]}
            dials = {name: _dials_to(pub.log_path, ip) for name, ip in lan.items()}
            for home in nodes[1:]:
                assert "restarting the DHT worker as a client" in home.log_path.read_text()
            # STEPS more steps from here, every path in place (a run with no end: --steps 0)
            start = last_step(nodes)
            wait_for(lambda: last_step(nodes) >= start + STEPS, 240, f"{STEPS} more steps")
            assert {name: _dials_to(pub.log_path, ip) for name, ip in lan.items()} == dials
            # the steps ran on a plan that seats the homes alone, on adjacent stages: every
            # activation and gradient crossed the relayed link between them
            seats = _plans(nodes[1])[-1]
            assert seats in ([[ids["cone"]], [ids["sym"]]], [[ids["sym"]], [ids["cone"]]]), seats
            assert _plans(nodes[2])[-1] == seats
            for home, other in ((nodes[1], nodes[2]), (nodes[2], nodes[1])):
                # its frames to the other home went on streams inside the relayed connection
                assert f"no lane to {other.peer_id}" in home.log_path.read_text(), home.name
            merged: dict[int, float] = {}
            for node in nodes:
                merged.update(trained_steps(node))
            assert sorted(merged) == list(range(len(merged))), sorted(merged)  # no gap
            first = sum(merged[s] for s in range(5)) / 5
            last = sum(merged[s] for s in range(start + STEPS - 4, start + STEPS + 1)) / 5
            print(f"loss {first:.3f} over steps 0-4, {last:.3f} over the last 5 of "
                  f"{start + 1}..{start + STEPS} (every path in place)")  # fmt: skip
            assert last < first
            # status works from behind a symmetric NAT too: a DHT client of the public node
            behind = _status(bed, pub.dht_addr, host="sym")
            assert {p["peer_id"] for p in behind["peers"]} == set(ids.values())
            assert any(link["relayed"] for link in behind["links"])
        except BaseException:
            print(swarm.logs()[-20000:])
            raise
        finally:
            swarm.close()
