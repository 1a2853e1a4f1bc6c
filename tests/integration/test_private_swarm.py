"""A private swarm (``--swarm-key``) of two real ``fusionllm node`` processes trains, and nodes
without its key get nothing into it: no connection (so no gossip, probe, tensor or lane), no
record or plan proposal counted, no seat.

Outsiders, all at once while the two train:
- ``stranger``: a node started without the key, on the same run settings;
- ``wrong``: a node started with another key;
- a forger on the DHT that reads raw values with validation off (members' values are sealed:
  nothing in them is readable), then copies a member's record as if it had leaked (the keyed
  settings digest included), makes it its own and signs it with its own key, every second:
  only the seal and tag are missing (the members' DHT nodes refuse to keep it, their
  directories to count it);
- transports without the key, or with the wrong one, dialling a member's host.

A member's ``fusionllm status --swarm-key`` (and its ``--serve`` page) sees the two members.
"""

import dataclasses
import json
import subprocess
import sys
import time
import urllib.request

import pytest

from fusionllm.common.swarm_key import SwarmKey, write_swarm_key
from fusionllm.dht.cipher import MAGIC, RecordCipher
from fusionllm.dht.client import DhtClient, DhtConfig
from fusionllm.dht.envelope import open_envelope, seal
from fusionllm.dht.keys import nodes_key
from fusionllm.dht.records import RecordError
from fusionllm.node.errors import TransportError
from fusionllm.node.local_swarm import TEST_DEVICE, LocalSwarm, wait_for
from fusionllm.node.p2p.peer_host import HostConfig, PeerHost
from fusionllm.node.p2p.transport import Transport, TransportConfig
from tests.support.identities import Identity

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

RUN = {
    "steps": 0,
    "seq-len": 64,
    "micro-batch-size": 2,
    "micro-batches": 4,
    "min-stages": 2,
    "max-stages": 2,
    "max-replicas": 1,
    "threads": 1,
    "dense": True,
    "quiet-stride": 1,
    "checkpoint-every": 0,
}
# The outsiders advertise a device 100x faster: any plan that could seat them would.
FAST_DEVICE = {**TEST_DEVICE, "flops": TEST_DEVICE["flops"] * 100}
WATCH_S = 10.0  # 5 epochs of 2 s of the forger trying (the other outsiders run longer)


def _steps(node) -> int:
    return sum(1 for e in node.snapshot() if e["event"] == "step")


def _outsiders_seen(nodes, outsiders: set[str], since: float) -> list[dict]:
    """Members' epoch events after ``since`` that count or seat an outsider."""
    return [
        e
        for n in nodes
        for e in n.snapshot()
        if e["event"] == "epoch"
        and e["t"] >= since
        and (outsiders & set(e["members"]) or any(outsiders & set(s) for s in e["stages"]))
    ]


def _unreadable(value: bytes) -> bool:
    """Whether a raw DHT value tells a stranger nothing: sealed, no envelope, no address."""
    try:
        open_envelope(value)
    except RecordError:
        return value.startswith(MAGIC) and b"/ip4/" not in value and b"default" not in value
    return False


def _forge(client: DhtClient, forger: Identity, members: set[str], leaked: SwarmKey) -> bool:
    """Store a copy of a member's record as the forger's own, signed by it, neither sealed
    nor tagged; False while it has no member's record to copy. What it reads must be sealed:
    the copy is opened with ``leaked``, the key the forger does not have (a leaked record)."""
    key = nodes_key("default")
    entries = {subkey: value for subkey, value, _ in client.get(key)}
    sealed = [v for s, v in entries.items() if s in members]
    if not sealed:
        return False
    assert all(_unreadable(v) for v in sealed), "a stranger read a member's record"
    info = dataclasses.replace(
        open_envelope(RecordCipher(leaked.records).open(sealed[0])).record,
        peer_id=forger.peer_id,
        addrs=(f"/ip4/127.0.0.1/tcp/9/p2p/{forger.peer_id}",),
        time=time.time(),
    )
    expiration = time.time() + 10
    value = seal(info, key=key, subkey=forger.peer_id, expiration=expiration, sign=forger.sign)
    # The members' DHT nodes refuse to keep it; the stranger's, which has no key, keeps it.
    client.store(key, forger.peer_id, value, expiration)
    return True


def _dial_refused(tmp_path, name: str, addr: str, swarm_key=None) -> bool:
    key = tmp_path / f"{name}.id"
    host = PeerHost(HostConfig(key_path=key, swarm_key=swarm_key, dial_timeout_s=3.0)).start()
    try:
        with Transport(TransportConfig(key_path=key, dial_timeout_s=3.0), host=host) as plain:
            try:
                plain.connect(addr, timeout=3.0)
            except TransportError:  # DeadlineError included: the handshake reads noise
                return True
            return False
    finally:
        host.close()


def test_nodes_without_the_key_get_nothing_into_a_private_swarm_that_trains(tmp_path):
    key_path, wrong_path = tmp_path / "keys" / "ours.swarm", tmp_path / "keys" / "other.swarm"
    swarm_key, wrong_key = write_swarm_key(key_path), write_swarm_key(wrong_path)
    swarm = LocalSwarm(tmp_path, extra=RUN)
    forger = Identity(tmp_path / "forger.id")
    try:
        first = swarm.start("a", extra={"swarm-key": str(key_path)})
        wait_for(lambda: first.last("ready"), 90, "the first node")
        boot = first.dht_addr
        nodes = [first, swarm.start("b", bootstrap=boot, extra={"swarm-key": str(key_path)})]
        outsiders = [
            swarm.start("stranger", bootstrap=boot, device=FAST_DEVICE),
            swarm.start(
                "wrong", bootstrap=boot, device=FAST_DEVICE, extra={"swarm-key": str(wrong_path)}
            ),
        ]
        try:
            wait_for(lambda: all(_steps(n) >= 3 for n in nodes), 240, "the members to train")
            wait_for(lambda: all(o.last("ready") for o in outsiders), 60, "outsiders to start")
        except AssertionError:
            raise AssertionError(swarm.logs()) from None
        steps_before = _steps(nodes[0])
        ids = {o.peer_id for o in outsiders} | {forger.peer_id}
        addr = first.last("ready")["addrs"][0]
        assert _dial_refused(tmp_path, "plain", addr)
        assert _dial_refused(tmp_path, "other", addr, wrong_key)
        assert not _dial_refused(tmp_path, "keyed", addr, swarm_key)  # the check can pass
        # validate_records off: the forger sees every raw value, as the rawest stranger would.
        config = DhtConfig(swarm="default", initial_peers=(boot,), client_mode=True,
                           validate_records=False)  # fmt: skip
        members = {n.peer_id for n in nodes}
        with DhtClient(config) as client:
            # Stored again every second, from its first copy of a member's record on.
            forged = lambda: _forge(client, forger, members, swarm_key) or time.sleep(1.0)  # noqa: E731
            wait_for(forged, 90, "a member's record to copy", poll=0.0)
            shown = time.time()
            while time.time() < shown + WATCH_S:
                _forge(client, forger, members, swarm_key)
                time.sleep(1.0)
        _check_status(tmp_path, boot, key_path, members)
        assert all(n.alive() for n in [*nodes, *outsiders]), swarm.logs()
        assert _outsiders_seen(nodes, ids, since=0.0) == [], swarm.logs()
        # The outsiders never trained a step, never saw the members' plan.
        for outsider in outsiders:
            assert _steps(outsider) == 0
            plans = {e["digest"] for e in outsider.snapshot() if e["event"] == "epoch"}
            members_plans = {e["digest"] for e in nodes[0].snapshot() if e["event"] == "epoch"}
            assert not plans & members_plans
        assert _steps(nodes[0]) > steps_before, "the members stopped training"
        print(
            f"members trained {_steps(nodes[0]) - steps_before} steps in {WATCH_S} s "
            "of outsiders trying"
        )
    finally:
        swarm.close()


def _check_status(tmp_path, boot: str, key_path, members: set[str]) -> None:
    """A member's `fusionllm status --swarm-key` reads the sealed records: both members, no
    outsider; its --serve page too (one read of each)."""
    cli = [sys.executable, "-m", "fusionllm.node.cli.main", "status", "--bootstrap", boot,
           "--swarm-key", str(key_path)]  # fmt: skip
    once = subprocess.run([*cli, "--json", "--timeout", "60"], capture_output=True, text=True,
                          timeout=90, check=False)  # fmt: skip
    assert once.returncode == 0, once.stderr[-3000:]
    assert {p["peer_id"] for p in json.loads(once.stdout)["peers"]} == members
    log = (tmp_path / "status-serve.log").open("w")
    page = subprocess.Popen([*cli, "--serve", "127.0.0.1:0", "--interval", "1"],
                            stdout=subprocess.PIPE, stderr=log, text=True)  # fmt: skip
    try:
        line = page.stdout.readline()  # "status page at URL (...", once its DHT client runs
        assert line.startswith("status page at "), (tmp_path / "status-serve.log").read_text()
        url = line.split()[3]
        wait_for(lambda: _served_peers(url) == members, 90, "the page to show both members")
    finally:
        page.terminate()
        page.wait(timeout=30)
        log.close()


def _served_peers(url: str) -> set[str]:
    with urllib.request.urlopen(url + "api/status", timeout=5) as reply:
        status = json.load(reply)["status"] or {}  # None until the first read
    return {p["peer_id"] for p in status.get("peers", ())}
