"""A node's reachability in its record (dht/records.py), whom it asks to dial it back
(node/control/reach_check.py) and what ``fusionllm status`` says of it."""

import collections
import threading

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from fusionllm.common.errors import ConfigError
from fusionllm.dht.records import REACH_VERDICTS, NodeInfo, NodeState, RecordError
from fusionllm.node.control.reach_check import ReachCheck, ReachConfig, pick_askers
from fusionllm.node.control.status import describe, format_status
from fusionllm.node.errors import ControlError
from fusionllm.node.p2p.dialback import DialBackAnswer
from fusionllm.node.p2p.reachability import explain
from tests.unit.test_epochs import T0, record
from tests.unit.test_records import node


@pytest.mark.parametrize("verdict", REACH_VERDICTS)
def test_a_verdict_round_trips_and_an_unjudged_node_writes_none(verdict):
    assert NodeInfo.from_wire(node(reach=verdict).to_wire()).reach == verdict
    assert "reach" not in node().to_wire()  # older readers refuse fields they do not know
    assert NodeInfo.from_wire(node().to_wire()).reach == ""


@pytest.mark.parametrize("value", ["reachable", 1, None, ["public"]])
def test_a_verdict_outside_the_list_is_refused(value):
    with pytest.raises(RecordError, match=r"reach .* is not one of"):
        NodeInfo.from_wire({**node().to_wire(), "reach": value})
    with pytest.raises(ConfigError, match="reach"):
        node(reach="reachable")


def _member(peer: str, **changes) -> NodeInfo:
    return record(peer, addrs=(f"/ip4/10.0.0.1/tcp/4001/p2p/{peer}",), **changes)


def test_members_others_reach_are_asked_first_and_private_ones_never():
    members = {
        "a": _member("a", reach="private"),
        "b": _member("b"),  # has not judged (or older software)
        "c": _member("c", reach="public"),
        "d": _member("d", reach="mapped"),
        "me": _member("me", reach="public"),
        "e": _member("e", reach="announced"),
        "f": record("f", reach="public"),  # no address to dial it at
        "g": _member("g", reach="unknown"),  # has not judged yet
    }
    assert [m.peer_id for m in pick_askers(members, "me", 3)] == ["c", "d", "e"]
    assert [m.peer_id for m in pick_askers(members, "me", 8)] == ["c", "d", "e", "b", "g"]
    assert pick_askers({"me": members["me"]}, "me", 3) == []
    with pytest.raises(ConfigError, match="confirmations"):
        ReachConfig(confirmations=0)


def test_status_shows_each_members_reach_and_what_private_means():
    members = {
        "a": record("a", state=NodeState.SERVING, reach="public"),
        "b": record("b", state=NodeState.SERVING, reach="private"),
        "c": record("c", state=NodeState.SERVING),
    }
    status = describe("demo", members, None, collections.Counter(), now=T0 + 5, skipped=0)
    assert [p["reach"] for p in status["peers"]] == ["public", "private", "unknown"]
    text = format_status(status)
    assert "reach" in text.splitlines()[1]
    assert "b: no peer can dial it (NAT or firewall)" in text
    assert "a: no peer can dial" not in text


def test_each_verdict_tells_the_user_what_it_means():
    assert explain("public", ["10.0.0.5:4001"]) == (
        "reachability public: peers can dial this node at 10.0.0.5:4001"
    )
    assert "where its router forwards" in explain("mapped", ["198.51.100.9:4001"])
    private = explain("private", (), ["198.51.100.9"])
    assert "members see this node at 198.51.100.9 but cannot dial it back" in private
    assert "forward its ports on the router and give --announce-addr" in private
    assert explain("unknown").startswith("reachability unknown")


class FakeHost:
    """What ReachCheck uses of a PeerHost; members answer as ``answers`` says."""

    def __init__(self, answers: dict, connected=()) -> None:
        self.peer_id = "me"
        self.bound_addrs = ["/ip4/192.168.1.2/tcp/4001/p2p/me"]
        self.answers = answers
        self.connected = list(connected)
        self.dialled: list[str] = []
        self.libp2p = object()

    def connected_peers(self) -> list[str]:
        return self.connected

    def connect(self, addr: str, timeout: float) -> str:
        self.dialled.append(addr)
        return addr.rsplit("/", 1)[1]

    def call(self, fn, libp2p, peer, ports, config):
        reply = self.answers[peer.to_base58()]
        if isinstance(reply, Exception):
            raise reply
        return reply


def _check(host, members, announced_addrs=()):
    events = []
    check = ReachCheck(host=host, config=ReachConfig(), members=lambda: members,
                       is_member=lambda p: True, listen_ips=["192.168.1.2"],
                       announced_addrs=announced_addrs,
                       emit=lambda kind, **f: events.append((kind, f)))  # fmt: skip
    return check, events


def test_a_check_asks_members_and_says_so_when_the_verdict_changes():
    a, b = ID.from_pubkey(create_new_key_pair().public_key), ID.from_pubkey(
        create_new_key_pair().public_key
    )  # fmt: skip
    members = {p.to_base58(): _member(p.to_base58(), reach="public") for p in (a, b)}
    blind = {p.to_base58(): DialBackAnswer(peer=p.to_base58(), observed_ip="198.51.100.9",
                                           reached={4001: False}) for p in (a, b)}  # fmt: skip
    host = FakeHost(blind, connected=[a.to_base58()])
    check, events = _check(host, members)
    assert check.published == ""  # nothing said before a verdict: older readers see no field
    assert check.check_once().verdict == check.published == "private"
    assert host.dialled == [members[b.to_base58()].addrs[0]]  # a was connected already
    assert events == [("reachability", {"verdict": "private", "addrs": [], "answers": 2,
                                        "observed": ["198.51.100.9"], "upnp": False})]  # fmt: skip
    check.check_once()
    assert len(events) == 1  # the same verdict again: no new event
    host.answers[a.to_base58()] = ControlError("reset")  # one member's word is not enough
    assert check.check_once().verdict == "unknown"


def test_an_announced_node_asks_nobody():
    def no_members():
        raise AssertionError("an announced node looked for members to ask")

    check = ReachCheck(host=FakeHost({}), config=ReachConfig(), members=no_members,
                       is_member=lambda p: True, listen_ips=["0.0.0.0"],
                       announced_addrs=["/ip4/203.0.113.5/tcp/4001/p2p/me"])  # fmt: skip
    assert check.current.verdict == check.published == "announced"
    check.loop(threading.Event())  # returns at once
    assert check.current.addrs == ("/ip4/203.0.113.5/tcp/4001/p2p/me",)


def test_one_members_lost_dial_back_never_demotes_a_node_at_once():
    """The docker host-join run: the host's first node had one member to ask; under load that
    member's dial-back failed once and the node turned private (a DHT client on a new port,
    so a guest bootstrapping from its old address failed). One member's word demotes only when
    the next check says the same."""
    (only,) = [ID.from_pubkey(create_new_key_pair().public_key).to_base58()]
    members = {only: _member(only, reach="public")}
    reached = DialBackAnswer(peer=only, observed_ip="192.168.1.2", reached={4001: True})
    lost = DialBackAnswer(peer=only, observed_ip="192.168.1.2", reached={4001: False})
    host = FakeHost({only: reached}, connected=[only])
    check, events = _check(host, members)
    assert check.check_once().verdict == "public"
    host.answers[only] = lost
    assert check.check_once().verdict == "public"  # thin: held back for one check
    host.answers[only] = reached
    assert check.check_once().verdict == "public"
    host.answers[only] = lost
    assert check.check_once().verdict == "public"  # the count started over
    assert check.check_once().verdict == "private"  # twice in a row: it holds
    assert [e[1]["verdict"] for e in events] == ["public", "private"]
