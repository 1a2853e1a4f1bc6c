"""A rogue peer attacks a running 3-node swarm through the DHT and gossip; nothing changes.

The rogue runs a real DHT worker with validation switched off (so its own node keeps whatever
it stores) and a real control host. Honest nodes must refuse its forged, misattributed and
malformed records, drop and count its junk and oversize gossip, ignore its fake plan, and keep
the plan they agreed on. Then ``fusionllm status`` describes the swarm as the nodes see it.
"""

import json
import subprocess
import sys
import time

import msgpack
import pytest

from fusionllm.dht.client import DhtClient, DhtConfig
from fusionllm.dht.envelope import _signed_bytes, open_envelope, seal
from fusionllm.dht.keys import nodes_key, plans_key
from fusionllm.dht.records import LinkReport, NodeInfo, PlanProposal, RecordError
from fusionllm.node.control.agreement import epoch_at
from fusionllm.node.control.bandwidth import BandwidthReport
from fusionllm.node.control.status import acting_epochs
from fusionllm.node.local_swarm import FAST, LocalSwarm, wait_for
from fusionllm.node.p2p.control_host import ControlConfig, ControlHost
from fusionllm.node.p2p.identity import load_or_create_identity, peer_id_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SWARM = "default"


def _agreed(nodes, since=0.0):
    latest = [n.last("epoch") for n in nodes]
    if any(e is None or e["t"] < since or len(e["members"]) != len(nodes) for e in latest):
        return None
    return latest[0] if len({e["digest"] for e in latest}) == 1 else None


def _forged_envelope(body_wire: dict, *, key: str, subkey: str, expiration: float, sign) -> bytes:
    """An envelope whose body we choose freely (seal() only writes valid records)."""
    body = msgpack.packb(body_wire, use_bin_type=True)
    signature = sign(_signed_bytes("node", key, subkey, expiration, body))
    envelope = {"v": 1, "kind": "node", "key": key, "sub": subkey, "exp": expiration,
                "body": body, "sig": signature}  # fmt: skip
    return msgpack.packb(envelope, use_bin_type=True)


def test_a_rogue_peer_changes_nothing_and_status_shows_the_swarm(tmp_path) -> None:
    swarm = LocalSwarm(tmp_path, extra={"max-replicas": 1, "max-stages": 2, "control-only": True})
    rogue_dht = rogue_host = None
    try:
        first = swarm.start("n0")
        wait_for(lambda: first.last("ready"), 120, "the first node")
        for i in (1, 2):
            swarm.start(f"n{i}", bootstrap=first.dht_addr)
        nodes = swarm.nodes
        agreed = wait_for(lambda: _agreed(nodes), 150, "3 nodes to agree")
        digest = agreed["digest"]
        victim = nodes[1]

        # ---- the DHT: forged, misattributed, malformed and junk records; a fake plan
        rogue_key = load_or_create_identity(tmp_path / "rogue.key")
        rogue_id = peer_id_of(rogue_key)
        sign = rogue_key.private_key.sign
        rogue_dht = DhtClient(
            DhtConfig(
                swarm=SWARM,
                initial_peers=(first.dht_addr,),
                identity_path=tmp_path / "rogue.key",
                validate_records=False,
            )
        ).start()
        key = nodes_key(SWARM)
        honest = DhtClient(
            DhtConfig(swarm=SWARM, initial_peers=(first.dht_addr,), client_mode=True)
        ).start()
        victim_entry = next(v for s, v, _ in honest.get(key) if s == victim.peer_id)
        victim_info = open_envelope(victim_entry).record
        wire = victim_info.to_wire()
        # Within the swarm's max record lifetime, so only signature/schema checks can refuse.
        exp = time.time() + 10
        # 1. The victim's record, changed, under the victim's subkey, signed by the rogue.
        forged = {**wire, "dev": {**wire["dev"], "mem": 1 << 20}}
        rogue_dht.store(key, victim.peer_id, _forged_envelope(
            forged, key=key, subkey=victim.peer_id, expiration=exp, sign=sign), exp)  # fmt: skip
        # 2. The rogue's own, correctly signed record, under the victim's subkey.
        own = NodeInfo.from_wire({**wire, "id": rogue_id})
        rogue_dht.store(key, victim.peer_id, seal(own, key=key, subkey=rogue_id, expiration=exp,
                                                  sign=sign), exp)  # fmt: skip
        # 3. A correctly signed record with a bad schema, under the rogue's own subkey.
        bad = {**wire, "id": rogue_id, "up": "fast", "extra": 1}
        rogue_dht.store(key, rogue_id, _forged_envelope(
            bad, key=key, subkey=rogue_id, expiration=exp, sign=sign), exp)  # fmt: skip
        # 4. Bytes that are not an envelope at all.
        rogue_dht.store(key, "junk", b"\x00" * 100, exp)
        # 5. A fake plan for the current epoch with an unbeatable estimate: every stage on
        #    the rogue, who is not a member of the swarm (plan keys take members only: honest
        #    replicas refuse it; only the rogue's own node keeps it).
        epoch = epoch_at(time.time(), FAST["epoch"])
        # A quiet swarm (control-only: nobody trains) stores its plan only in the epochs its
        # nodes act in, the multiples of their stride: the rogue copies it from there.
        copies = (_rogue_plan_json(honest, e, rogue_id) for e in acting_epochs([epoch, epoch - 1]))
        plan_json = next((p for p in copies if p is not None), None)
        assert plan_json is not None, "could not read a plan to imitate"
        fake_epochs = [epoch, epoch + 1, epoch + 2]
        for e in fake_epochs:
            proposal = PlanProposal(swarm=SWARM, epoch=e, proposer=rogue_id, estimate=1e-9,
                                    plan=plan_json)  # fmt: skip
            plan_exp = time.time() + 10
            proposal_bytes = seal(proposal, key=plans_key(SWARM, e), subkey=rogue_id,
                                  expiration=plan_exp, sign=sign)  # fmt: skip
            rogue_dht.store(plans_key(SWARM, e), rogue_id, proposal_bytes, plan_exp)
        for e in fake_epochs:  # what honest readers get: the honest proposals, not the rogue's
            proposers = {open_envelope(v).record.proposer for _, v, _ in
                         honest.get(plans_key(SWARM, e))}  # fmt: skip
            assert rogue_id not in proposers

        # What an honest reader gets: three valid node records, the victim's unchanged.
        entries = honest.get(key)
        infos = []
        for subkey, value, _ in entries:
            try:
                infos.append(open_envelope(value).record)
            except RecordError:
                pytest.fail(f"an honest DHT node served an invalid record under {subkey!r}")
        assert sorted(i.peer_id for i in infos) == sorted(n.peer_id for n in nodes)
        served = next(i for i in infos if i.peer_id == victim.peer_id)
        assert served.device == victim_info.device
        honest.close()

        # ---- gossip: junk, oversize, another swarm's report, and a boastful report
        rogue_host = ControlHost(
            ControlConfig(
                key_path=tmp_path / "rogue.key",
                max_message_bytes=256 << 10,
                max_messages_per_peer_per_s=1000,
            )
        ).start()
        topic = f"fusionllm/{SWARM}/bandwidth"
        rogue_host.subscribe(topic)
        for node in nodes:
            rogue_host.connect(node.last("ready")["addrs"][0])
        wait_for(lambda: len(rogue_host.topic_peers(topic)) == 3, 30, "the rogue to see the topic")
        boasts = tuple(LinkReport(peer=n.peer_id, bandwidth=1e14, rtt=0.0, age=0.0) for n in nodes)
        boast = BandwidthReport(swarm=SWARM, time=time.time(), links=boasts)
        other_swarm = BandwidthReport(swarm="elsewhere", time=time.time(), links=())
        attack_at = time.time()
        attack = [b"\xc1junk", b"x" * (100 << 10), b"\x92\x01", b"y" * (100 << 10),
                  other_swarm.to_bytes(), b"z" * (100 << 10), boast.to_bytes()]  # fmt: skip
        for message in attack:
            rogue_host.publish(topic, message)
            time.sleep(0.3)  # under the per-author rate cap: each must meet its own check

        # A few epochs later: same plan everywhere, the attack counted, nobody crashed.
        after = wait_for(lambda: _agreed(nodes, since=attack_at + 3 * FAST["epoch"]), 60,
                         "epochs after the attack")  # fmt: skip
        assert after["digest"] == digest
        assert all(n.alive() for n in nodes)
        counters = [n.last("epoch")["counters"] for n in nodes]
        assert sum(c["gossip_dropped_invalid"] for c in counters) >= 3, counters
        assert sum(c["gossip_dropped_oversize"] for c in counters) >= 3, counters
        # The rogue's plan never reached the nodes' agreement: refused inside the DHT.
        assert all(c["proposals_not_members"] == 0 for c in counters), counters

        # ---- status, as a user runs it
        result = subprocess.run(
            [sys.executable, "-m", "fusionllm.node.cli.main", "status", "--bootstrap",
             first.dht_addr, "--json"],
            capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-2000:]
        status = json.loads(result.stdout)
        assert sorted(p["peer_id"] for p in status["peers"]) == sorted(n.peer_id for n in nodes)
        assert status["plan"]["digest"] == digest
        serving = {p for s in status["plan"]["stages"] for p in s["peers"]}
        assert serving | set(status["plan"]["backup"]) == {n.peer_id for n in nodes}
        assert status["links"], "nodes should have published measured links"
        assert {p["device"] for p in status["peers"]} == {"test-cpu"}
        timing = status["timing"]  # where a slow call's time went
        assert timing["attempts"] >= 1
        assert 0 < timing["start_s"] < 90
        assert 0 < timing["read_s"] < 90
    except AssertionError:
        print(swarm.logs())
        raise
    finally:
        if rogue_host is not None:
            rogue_host.close()
        if rogue_dht is not None:
            rogue_dht.close()
        swarm.close()


def _rogue_plan_json(client: DhtClient, epoch: int, rogue_id: str) -> bytes | None:
    """The plan of ``epoch`` with every peer replaced by the rogue (well-formed, invalid)."""
    for _subkey, value, _ in client.get(plans_key(SWARM, epoch)):
        plan = json.loads(open_envelope(value).record.plan)
        for stage in plan["stages"]:
            stage["peers"] = [rogue_id] * len(stage["peers"])
        for link in plan["links"]:
            link["src_peer"] = link["dst_peer"] = rogue_id
        plan["estimated_step_time"] = 1e-9
        return json.dumps(plan, sort_keys=True, separators=(",", ":")).encode()
    return None
