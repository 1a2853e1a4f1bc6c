"""What a node does about relays from its verdict (node/control/relay_use.py), and what
``fusionllm status`` says of a member reached through relays."""

import collections
import dataclasses
import threading
import time

import msgpack
import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from fusionllm.common.errors import ConfigError
from fusionllm.dht.records import LinkReport, NodeState, RecordError
from fusionllm.node.control.bandwidth import BandwidthBook, LinkSample
from fusionllm.node.control.reach_check import ReachCheck, ReachConfig
from fusionllm.node.control.relay_use import (
    RelayUse,
    RelayUseConfig,
    dht_client_mode,
    pick_relays,
)
from fusionllm.node.control.seating import seatable
from fusionllm.node.control.status import describe, format_status
from fusionllm.node.errors import TransportError
from fusionllm.node.p2p.dialback import DialBackAnswer
from tests.unit.test_epochs import T0, record


def _addr(peer: str) -> str:
    return f"/ip4/203.0.113.7/tcp/4001/p2p/{peer}"


def _member(peer: str, **changes):
    return record(peer, addrs=(_addr(peer),), **changes)


MEMBERS = {
    "a": _member("a", reach="private"),
    "b": _member("b", reach="public"),
    "c": _member("c", reach="mapped"),
    "d": _member("d"),  # not judged yet: maybe nobody can dial it
    "e": record("e", reach="public"),  # no address
    "f": _member("f", reach="announced"),
    "me": _member("me", reach="public"),
}


def test_relays_are_members_others_can_dial_by_peer_id():
    assert [m.peer_id for m in pick_relays(MEMBERS, "me", 2)] == ["b", "c"]
    assert [m.peer_id for m in pick_relays(MEMBERS, "me", 4)] == ["b", "c", "f"]
    relayed_only = record("g", reach="public", addrs=(f"{_addr('b')}/p2p-circuit/p2p/g",))
    assert pick_relays({"g": relayed_only}, "me", 2) == []
    with pytest.raises(ConfigError, match="relays"):
        RelayUseConfig(relays=0)


class FakeClient:
    def __init__(self, grants: dict[str, bool]) -> None:
        self.grants = grants

    def reserve(self, relay: str) -> bool:
        return self.grants[relay]


class FakeHost:
    peer_id = "me"

    def __init__(self, unreachable=()) -> None:
        self.unreachable = set(unreachable)
        self.connected = set(MEMBERS)

    def connected_peers(self) -> list[str]:
        return sorted(self.connected)

    def connect(self, addr: str, timeout: float) -> str:
        if addr in self.unreachable:
            raise TransportError("refused")
        return addr.rsplit("/", 1)[1]


def _use(host, grants):
    relays = []
    use = RelayUse(host=host, config=RelayUseConfig(), members=lambda: MEMBERS,
                   client=FakeClient(grants),
                   start_relay=lambda: relays.append(1) or "relay")  # fmt: skip
    return use, relays


def test_a_private_node_holds_slots_and_names_its_relayed_addresses():
    use, relays = _use(FakeHost(), {"b": True, "c": True})
    use.follow("unknown")
    assert use.addrs == ()
    use.follow("private")
    assert use.addrs == (f"{_addr('b')}/p2p-circuit/p2p/me", f"{_addr('c')}/p2p-circuit/p2p/me")
    assert relays == []  # nobody can dial it: it relays for nobody
    assert not use.wanting


def test_a_refused_or_unreachable_relay_gives_no_address():
    use, _ = _use(FakeHost(unreachable={_addr("b")}), {"b": True, "c": False})
    use.follow("private")
    assert use.addrs == ()
    assert use.wanting  # checked again soon, not in 5 min


def test_a_relay_that_went_leaves_the_record_at_once_not_at_the_next_check():
    members = dict(MEMBERS)
    host = FakeHost()
    client = FakeClient({"b": True, "c": True})
    use = RelayUse(host=host, config=RelayUseConfig(), members=lambda: members, client=client,
                   start_relay=lambda: "relay")  # fmt: skip
    use.follow("private")
    assert use.prune() is False  # both still there
    host.connected.discard("b")  # our connection to b closed: the slot on it went with it
    assert use.prune() is True
    assert use.addrs == (f"{_addr('c')}/p2p-circuit/p2p/me",)
    del members["c"]  # c's record expired
    assert use.prune() is True
    assert use.addrs == ()
    assert use.wanting  # the caller looks for other relays now


def test_a_node_others_can_dial_relays_once_and_drops_its_slots():
    use, relays = _use(FakeHost(), {"b": True, "c": True})
    use.follow("private")
    for verdict in ("public", "mapped", "public"):
        use.follow(verdict)
    assert relays == [1]
    assert use.relaying
    assert use.addrs == ()


def test_status_names_the_relays_a_private_member_is_reached_through():
    relayed = (f"{_addr('a')}/p2p-circuit/p2p/b", "/ip4/192.168.1.2/tcp/4001/p2p/b")
    members = {
        "a": _member("a", state=NodeState.SERVING, reach="public"),
        "b": record("b", state=NodeState.SERVING, reach="private", addrs=relayed),
        "c": _member("c", state=NodeState.SERVING, reach="private"),
    }
    status = describe("demo", members, None, collections.Counter(), now=T0 + 5, skipped=0)
    assert [p["relays"] for p in status["peers"]] == [[], ["a"], []]
    text = format_status(status)
    assert "b: no peer can dial it (NAT or firewall); it is reached through the relays of a" in text
    assert "c: no peer can dial it (NAT or firewall); it is reached only over connections" in text


def test_a_relayed_link_says_so_in_five_fields_and_a_direct_one_keeps_four():
    direct = LinkReport(peer="b", bandwidth=5e6, rtt=0.02, age=1.0)
    relayed = dataclasses.replace(direct, relayed=True)
    assert direct.to_wire() == ["b", 5e6, 0.02, 1.0]
    assert relayed.to_wire() == ["b", 5e6, 0.02, 1.0, 1]
    for link in (direct, relayed):
        assert LinkReport.from_wire(msgpack.unpackb(msgpack.packb(link.to_wire()))) == link
    for bad in (["b", 5e6, 0.02, 1.0, 0], ["b", 5e6, 0.02, 1.0, "yes"]):
        with pytest.raises(RecordError, match="relayed field must be 1"):
            LinkReport.from_wire(bad)
    with pytest.raises(RecordError, match="4 or 5 fields"):
        LinkReport.from_wire(["b", 5e6, 0.02])


def test_a_relayed_probe_stays_relayed_from_the_book_to_status():
    book = BandwidthBook(max_age_s=60.0)
    book.record("a", "b", LinkSample(2e6, 0.05, T0, relayed=True), now=T0)
    book.record("a", "c", LinkSample(9e6, 0.01, T0), now=T0)
    report = book.own_report("a", "demo", now=T0 + 1)
    assert {link.peer: link.relayed for link in report.links} == {"b": True, "c": False}
    members = {"a": record("a", state=NodeState.SERVING, links=report.links)}
    status = describe("demo", members, None, collections.Counter(), now=T0 + 2, skipped=0)
    assert {link["dst"]: link["relayed"] for link in status["links"]} == {"b": True, "c": False}
    lines = [line for line in format_status(status).splitlines() if " -> " in line]
    assert [line.endswith("relayed") for line in lines] == [
        link["relayed"] for link in status["links"]
    ]


def test_a_private_member_is_seated_only_once_it_names_a_relayed_address():
    relayed = (f"{_addr('a')}/p2p-circuit/p2p/c",)
    members = {
        "a": _member("a", reach="public"),
        "b": _member("b", reach="private"),  # nobody could dial it: no plan seats it yet
        "c": record("c", reach="private", addrs=relayed),
        "d": _member("d"),  # not judged (or older software): seated as before
    }
    assert sorted(seatable(members, now=T0)) == ["a", "c", "d"]


class UnreachableHost(FakeHost):
    """Every member asked answers that it could not reach us; those in ``unreachable`` cannot
    be dialled to ask."""

    def __init__(self) -> None:
        super().__init__()
        self.bound_addrs = ["/ip4/192.168.1.2/tcp/4001/p2p/me"]
        self.libp2p = object()

    def connected_peers(self) -> list[str]:
        return []

    def call(self, fn, libp2p, peer, ports, config):
        return DialBackAnswer(peer=peer.to_base58(), observed_ip="198.51.100.9",
                              reached={4001: False})  # fmt: skip


def test_a_member_that_cannot_be_dialled_to_ask_does_not_hold_back_the_verdict():
    a, b = (ID.from_pubkey(create_new_key_pair().public_key).to_base58() for _ in range(2))
    members = {a: _member(a, reach="public"), b: _member(b)}  # b: a home not judged yet
    host = UnreachableHost()
    host.unreachable = {_addr(b)}
    check = ReachCheck(host=host, config=ReachConfig(), members=lambda: members,
                       is_member=lambda p: True, listen_ips=["192.168.1.2"])  # fmt: skip
    # One member's word (thin) demotes once a second check in a row says the same.
    assert check.check_once().verdict == "unknown"
    verdict = check.check_once()
    assert (verdict.verdict, verdict.answers) == ("private", 1)


class ReachedHost(UnreachableHost):
    """Every member asked reached us at the address we listen on."""

    def call(self, fn, libp2p, peer, ports, config):
        return DialBackAnswer(peer=peer.to_base58(), observed_ip="192.168.1.2",
                              reached={4001: True})  # fmt: skip


def test_a_public_node_whose_other_members_are_all_private_stays_public():
    a, b = (ID.from_pubkey(create_new_key_pair().public_key).to_base58() for _ in range(2))
    members = {a: _member(a, reach="public")}
    check = ReachCheck(host=ReachedHost(), config=ReachConfig(), members=lambda: members,
                       is_member=lambda p: True, listen_ips=["192.168.1.2"])  # fmt: skip
    assert check.check_once().verdict == "public"
    # a left; the homes that stay may not be asked (private): no news, not "unknown", or the
    # homes that relay through us would drop us as their relay at their next check
    members = {b: _member(b, reach="private")}
    assert check.check_once().verdict == "public"
    assert check.published == "public"


class CountingRelays:
    """RelayUse's face to ReachCheck: counts the checks, says a relay went when told to."""

    def __init__(self) -> None:
        self.addrs: tuple[str, ...] = ("held",)
        self.wanting = False
        self.follows = 0
        self.gone = threading.Event()

    def follow(self, verdict: str) -> None:
        self.follows += 1

    def prune(self) -> bool:
        if self.gone.is_set():
            self.gone.clear()
            return True
        return False


def _wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_relay_that_went_brings_the_next_check_forward_from_minutes_to_retry_s():
    a = ID.from_pubkey(create_new_key_pair().public_key).to_base58()
    relays = CountingRelays()
    config = ReachConfig(first_after_s=0.01, retry_s=0.05, interval_s=3600)
    members = {a: _member(a, reach="public")}
    check = ReachCheck(host=UnreachableHost(), config=config, members=lambda: members,
                       is_member=lambda p: True, listen_ips=["192.168.1.2"],
                       relays=relays)  # fmt: skip
    stop = threading.Event()
    loop = threading.Thread(target=check.loop, args=(stop,), daemon=True)
    loop.start()
    try:
        _wait_until(lambda: relays.follows == 1)  # the first check; the next is an hour away
        relays.gone.set()
        _wait_until(lambda: relays.follows == 2)  # within a retry_s of the relay going
        assert check.current.verdict == "private"
    finally:
        stop.set()
        loop.join(timeout=5)


def test_a_node_that_turns_public_serves_the_dht_again():
    # private: a client; public later (a port forwarded since): a server again, not a client
    # for good; mapped: a client (its DHT port is not mapped); not judged: as it is
    verdicts = ["unknown", "private", "unknown", "public", "private", "mapped", "announced"]
    wanted = [dht_client_mode(v) for v in verdicts]
    assert wanted == [None, True, None, False, True, True, False]
