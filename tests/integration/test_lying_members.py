"""Lying members, proposing strangers and fake bandwidth change no honest node's plan.

Three real ``fusionllm node`` processes agree on a plan; then, one attack per test:

- a member lies: a client signing with a member's key (its real key, so every check of who
  wrote the record passes) publishes the swarm's own plan claiming half its step time;
- non-members propose: a fresh identity without a record, whose stores the DHT refuses, and a
  visible node on other settings, whose slightly better plan the nodes' agreement refuses;
- a stranger gossips that it measured 10^14 B/s towards every member.

Each test checks that the nodes noticed (their counters, or the DHT's refusal) and that every
honest node still follows the plan they agreed on before. One swarm serves the module.
"""

import dataclasses
import json
import time
from pathlib import Path

import pytest

from fusionllm.dht.client import DhtClient, DhtConfig
from fusionllm.dht.envelope import open_envelope, seal
from fusionllm.dht.keys import nodes_key, plans_key
from fusionllm.dht.records import LinkReport, NodeInfo, PlanProposal
from fusionllm.node.control.agreement import epoch_at
from fusionllm.node.control.bandwidth import BandwidthReport
from fusionllm.node.local_swarm import FAST, LocalSwarm, NodeProcess, wait_for
from fusionllm.node.p2p.control_host import ControlConfig, ControlHost
from fusionllm.node.p2p.identity import load_or_create_identity, peer_id_of

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

SWARM = "default"
EPOCH_S = FAST["epoch"]


@dataclasses.dataclass
class Swarm:
    local: LocalSwarm
    nodes: list[NodeProcess]
    digest: str
    root: Path

    def client(self, **config) -> DhtClient:
        bootstrap = (self.nodes[0].dht_addr,)
        return DhtClient(DhtConfig(swarm=SWARM, initial_peers=bootstrap, **config)).start()


def _agreed(nodes: list[NodeProcess], since: float = 0.0) -> dict | None:
    latest = [n.last("epoch") for n in nodes]
    if any(e is None or e["t"] < since or len(e["members"]) != len(nodes) for e in latest):
        return None
    return latest[0] if len({e["digest"] for e in latest}) == 1 else None


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    root = tmp_path_factory.mktemp("lying")
    # Never quiet (node/control/quiet.py): the attacks propose for epochs ahead, and the
    # tests count every node's refusal of them; a quiet node would sit those epochs out.
    local = LocalSwarm(
        root, extra={"max-replicas": 1, "max-stages": 2, "control-only": True, "quiet-stride": 1}
    )
    try:
        first = local.start("n0")
        wait_for(lambda: first.last("ready"), 120, "the first node")
        for i in (1, 2):
            local.start(f"n{i}", bootstrap=first.dht_addr)
        nodes = local.nodes
        agreed = wait_for(lambda: _agreed(nodes), 120, "3 nodes to agree")
        yield Swarm(local, nodes, agreed["digest"], root)
    except AssertionError:
        print(local.logs())
        raise
    finally:
        local.close()


@pytest.fixture(scope="module")
def client(swarm):
    """An honest reader (and the attackers' writer: records are signed, the DHT client that
    carries them does not matter)."""
    dht = swarm.client(client_mode=True)
    yield dht
    dht.close()


def _members_first(client: DhtClient) -> dict[str, NodeInfo]:
    """Node records, read before plans: our validator learns the members from them (it
    refuses plan records of keys it has never seen a record of)."""
    infos = {}
    for _, value, _ in client.get(nodes_key(SWARM)):
        info = open_envelope(value).record
        infos[info.peer_id] = info
    return infos


def _adopted_plan(client: DhtClient, digest: str) -> bytes:
    """The bytes of the plan the swarm follows, as some member last proposed it."""
    epoch = epoch_at(time.time(), EPOCH_S)
    for e in range(epoch, epoch - 4, -1):
        for _, value, _ in client.get(plans_key(SWARM, e)):
            proposal = open_envelope(value).record
            if proposal.digest == digest:
                return proposal.plan
    raise AssertionError(f"no proposal of plan {digest[:12]} in the last epochs")


def _shaded(plan_bytes: bytes, factor: float) -> tuple[bytes, float]:
    """The plan with its step time claimed ``factor`` times what it is."""
    plan = json.loads(plan_bytes)
    plan["estimated_step_time"] *= factor
    return json.dumps(plan, sort_keys=True, separators=(",", ":")).encode(), plan[
        "estimated_step_time"
    ]


def _propose_ahead(client: DhtClient, key_path: Path, plan: bytes, estimate: float) -> list[bool]:
    """Store a proposal signed with ``key_path`` for the next three epochs (outliving, hence
    replacing, what its owner proposes for them); what each store returned."""
    key_pair = load_or_create_identity(key_path)
    proposer = peer_id_of(key_pair)
    stored = []
    epoch = epoch_at(time.time(), EPOCH_S)
    for e in (epoch + 1, epoch + 2, epoch + 3):
        proposal = PlanProposal(swarm=SWARM, epoch=e, proposer=proposer, estimate=estimate,
                                plan=plan)  # fmt: skip
        expiration = time.time() + 15.0  # within the swarm's max record lifetime (20 s)
        value = seal(proposal, key=plans_key(SWARM, e), subkey=proposer, expiration=expiration,
                     sign=key_pair.private_key.sign)  # fmt: skip
        stored.append(client.store(plans_key(SWARM, e), proposer, value, expiration))
    return stored


def _still_agreed(swarm: Swarm, since: float) -> dict:
    """Three epochs after ``since``: every node follows the module's plan, none died."""
    after = wait_for(lambda: _agreed(swarm.nodes, since=since + 3 * EPOCH_S), 60,
                     "epochs after the attack")  # fmt: skip
    assert after["digest"] == swarm.digest
    assert all(n.alive() for n in swarm.nodes)
    adopted = [e["digest"] for n in swarm.nodes for e in n.snapshot()
               if e["event"] == "epoch" and e["t"] >= since]  # fmt: skip
    assert set(adopted) == {swarm.digest}, "a node adopted another plan meanwhile"
    return after


def test_a_member_claiming_half_the_step_time_is_refused(swarm, client):
    _members_first(client)
    honest = _adopted_plan(client, swarm.digest)
    lie, estimate = _shaded(honest, 0.5)
    started = time.time()
    stored = _propose_ahead(client, swarm.root / "n2.key", lie, estimate)
    assert any(stored), "a member's signed proposal should be stored"
    after = _still_agreed(swarm, started)
    counters = [n.last("epoch")["counters"] for n in swarm.nodes]
    assert all(c["proposals_overclaimed"] >= 1 for c in counters), counters
    assert after["estimate"] > estimate * 1.5


def test_non_members_cannot_propose(swarm, client):
    infos = _members_first(client)
    better, estimate = _shaded(_adopted_plan(client, swarm.digest), 0.97)
    started = time.time()
    # 1. A fresh identity with no record at all: the DHT's replicas refuse its stores.
    stored = _propose_ahead(client, swarm.root / "stranger.key", better, estimate)
    assert not any(stored), "plan keys must refuse a key that is no member"
    # 2. A visible node on other settings: its record is stored, so is its plan, and the
    #    nodes' agreement refuses it (a plan 3% better: believable, so only membership).
    visible = load_or_create_identity(swarm.root / "visible.key")
    visible_id = peer_id_of(visible)
    wire = next(iter(infos.values())).to_wire()
    record = NodeInfo.from_wire({**wire, "id": visible_id, "addrs": [], "dht": [],
                                 "cfg": "f" * 16, "t": time.time()})  # fmt: skip
    expiration = time.time() + 15.0
    assert client.store(nodes_key(SWARM), visible_id, seal(
        record, key=nodes_key(SWARM), subkey=visible_id, expiration=expiration,
        sign=visible.private_key.sign), expiration)  # fmt: skip
    _members_first(client)
    assert any(_propose_ahead(client, swarm.root / "visible.key", better, estimate))
    _still_agreed(swarm, started)
    counters = [n.last("epoch")["counters"] for n in swarm.nodes]
    assert all(c["proposals_not_members"] >= 1 for c in counters), counters


def test_a_stranger_cannot_set_a_members_downlink(swarm, client):
    host = ControlHost(
        ControlConfig(key_path=swarm.root / "gossiper.key", max_messages_per_peer_per_s=1000)
    ).start()
    try:
        topic = f"fusionllm/{SWARM}/bandwidth"
        host.subscribe(topic)
        for node in swarm.nodes:
            host.connect(node.last("ready")["addrs"][0])
        wait_for(lambda: len(host.topic_peers(topic)) == 3, 30, "the stranger to see the topic")
        before = [n.last("epoch")["counters"]["gossip_dropped_invalid"] for n in swarm.nodes]
        started = time.time()
        members = [n.peer_id for n in swarm.nodes]
        for _ in range(4):  # a few, under the per-author rate cap
            boast = BandwidthReport(swarm=SWARM, time=time.time(), links=tuple(
                LinkReport(peer=p, bandwidth=1e14, rtt=0.0, age=0.0) for p in members))  # fmt: skip
            host.publish(topic, boast.to_bytes())
            time.sleep(0.3)
        _still_agreed(swarm, started)
        # Heartbeats since the attack carry each node's downlink: none took the stranger's word.
        # (other tests' visible non-members may still have records: only members matter here)
        infos = {p: i for p, i in _members_first(client).items() if p in members}
        assert sorted(infos) == sorted(members)
        assert all(i.time > started + 2 for i in infos.values())
        assert all(i.downlink < 1e13 for i in infos.values()), [i.downlink for i in infos.values()]
        after = [n.last("epoch")["counters"]["gossip_dropped_invalid"] for n in swarm.nodes]
        assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    finally:
        host.close()
