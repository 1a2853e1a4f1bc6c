"""dht/record_rules.py: what the swarm's DHT validator (dht/validator.py) lets a node store.

hivemind cannot be imported next to py-libp2p, so the validator's rules live in a pure module;
the key id function here is a stand-in for hivemind's (the rules only compare ids), and the
clock is fake. That the real validator wires the same rules into a real DHT is covered by
tests/integration/test_lying_members.py.
"""

import hashlib

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.dht.envelope import seal
from fusionllm.dht.keys import nodes_key, plans_key
from fusionllm.dht.record_rules import KnownMembers, OpenedEnvelopes, RecordRules
from fusionllm.dht.records import (
    MAX_CLOCK_SKEW_S,
    NodeInfo,
    NodeState,
    PlanProposal,
    RecordError,
)
from tests.support.identities import Identity, cpu_device

SWARM = "demo"
NOW = 1_700_000_000.0
TTL = 60.0


def key_id(key: str) -> bytes:
    return hashlib.sha1(key.encode()).digest()


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def alice(tmp_path_factory) -> Identity:
    return Identity(tmp_path_factory.mktemp("alice") / "key")


@pytest.fixture(scope="module")
def mallory(tmp_path_factory) -> Identity:
    return Identity(tmp_path_factory.mktemp("mallory") / "key")


def info(peer_id: str, *, at: float = NOW, swarm: str = SWARM) -> NodeInfo:
    device = cpu_device()
    return NodeInfo(peer_id=peer_id, swarm=swarm, addrs=(), dht_addrs=(), device=device,
                    uplink=1e7, downlink=1e8, links=(), software="test",
                    config_digest="0123456789abcdef", state=NodeState.BACKUP, stage=None,
                    adopted=None, time=at)  # fmt: skip


def proposal(peer_id: str, epoch: int = 7) -> PlanProposal:
    return PlanProposal(swarm=SWARM, epoch=epoch, proposer=peer_id, estimate=1.0, plan=b"{}")


def rules(clock: Clock) -> RecordRules:
    return RecordRules(SWARM, max_ttl_s=TTL, key_id=key_id, clock=clock)


def store_node(r: RecordRules, who: Identity, *, at: float = NOW, exp: float = NOW + 10):
    key = nodes_key(SWARM)
    value = seal(info(who.peer_id, at=at), key=key, subkey=who.peer_id, expiration=exp,
                 sign=who.sign)  # fmt: skip
    return r.check(key_id(key), who.peer_id, value, exp)


def store_plan(r: RecordRules, who: Identity, *, epoch: int = 7, exp: float = NOW + 10):
    key = plans_key(SWARM, epoch)
    value = seal(proposal(who.peer_id, epoch), key=key, subkey=who.peer_id, expiration=exp,
                 sign=who.sign)  # fmt: skip
    return r.check(key_id(key), who.peer_id, value, exp)


# ----------------------------------------------------------------------------- node records


def test_a_well_formed_node_record_is_accepted(alice):
    opened = store_node(rules(Clock()), alice)
    assert opened.record.peer_id == alice.peer_id
    assert opened.kind == "node"


def test_node_records_dated_ahead_beyond_the_skew_are_refused(alice):
    clock = Clock()
    r = rules(clock)
    assert store_node(r, alice, at=NOW + MAX_CLOCK_SKEW_S).record.time == NOW + MAX_CLOCK_SKEW_S
    with pytest.raises(RecordError, match="ahead of us"):
        store_node(r, alice, at=NOW + MAX_CLOCK_SKEW_S + 0.01)
    clock.now = NOW + 1.0  # the same record is fine once our clock has caught up
    assert store_node(r, alice, at=NOW + MAX_CLOCK_SKEW_S + 0.01, exp=NOW + 11)


def test_records_expiring_beyond_max_ttl_are_refused(alice):
    r = rules(Clock())
    assert store_node(r, alice, exp=NOW + TTL)
    with pytest.raises(RecordError, match="expires more than"):
        store_node(r, alice, exp=NOW + TTL + 0.01)


def test_a_record_must_be_stored_as_signed(alice, mallory):
    r = rules(Clock())
    key = nodes_key(SWARM)
    value = seal(info(alice.peer_id), key=key, subkey=alice.peer_id, expiration=NOW + 10,
                 sign=alice.sign)  # fmt: skip
    with pytest.raises(RecordError, match="subkey it was not signed for"):
        r.check(key_id(key), mallory.peer_id, value, NOW + 10)
    with pytest.raises(RecordError, match="expiration differs"):
        r.check(key_id(key), alice.peer_id, value, NOW + 20)
    with pytest.raises(RecordError, match="wrong key"):
        r.check(key_id(plans_key(SWARM, 1)), alice.peer_id, value, NOW + 10)
    forged = seal(info(alice.peer_id), key=key, subkey=alice.peer_id, expiration=NOW + 10,
                  sign=mallory.sign)  # fmt: skip
    with pytest.raises(RecordError, match="signature"):
        r.check(key_id(key), alice.peer_id, forged, NOW + 10)
    with pytest.raises(RecordError):
        r.check(key_id(key), alice.peer_id, b"\x00junk", NOW + 10)


def test_another_swarms_record_is_refused(alice):
    r = rules(Clock())
    key = nodes_key("elsewhere")
    value = seal(info(alice.peer_id, swarm="elsewhere"), key=key, subkey=alice.peer_id,
                 expiration=NOW + 10, sign=alice.sign)  # fmt: skip
    with pytest.raises(RecordError, match="for swarm 'elsewhere'"):
        r.check(key_id(key), alice.peer_id, value, NOW + 10)


# ----------------------------------------------------------------------------- opened envelopes


def sealed_node(who: Identity, *, exp: float = NOW + 10, sign=None) -> bytes:
    return seal(info(who.peer_id), key=nodes_key(SWARM), subkey=who.peer_id, expiration=exp,
                sign=sign or who.sign)  # fmt: skip


def test_the_same_envelope_is_opened_once_and_checked_every_time(alice, mallory):
    clock = Clock()
    r = rules(clock)
    value, nodes_id = sealed_node(alice), key_id(nodes_key(SWARM))
    for _ in range(5):  # as hivemind hands it over: from every replica that has it
        assert r.check(nodes_id, alice.peer_id, value, NOW + 10).record.peer_id == alice.peer_id
    assert r.envelopes.opened == 1
    # What depends on where it is stored, and on the clock, is checked again each time.
    with pytest.raises(RecordError, match="subkey it was not signed for"):
        r.check(nodes_id, mallory.peer_id, value, NOW + 10)
    with pytest.raises(RecordError, match="wrong key"):
        r.check(key_id(plans_key(SWARM, 1)), alice.peer_id, value, NOW + 10)
    clock.now = NOW + 10 - TTL - 1.0
    with pytest.raises(RecordError, match="expires more than"):
        r.check(nodes_id, alice.peer_id, value, NOW + 10)
    assert r.envelopes.opened == 1


def test_refused_envelopes_are_not_remembered(alice, mallory):
    r = rules(Clock())
    forged, nodes_id = sealed_node(alice, sign=mallory.sign), key_id(nodes_key(SWARM))
    for _ in range(3):
        with pytest.raises(RecordError, match="signature"):
            r.check(nodes_id, alice.peer_id, forged, NOW + 10)
    assert len(r.envelopes) == 0
    assert r.envelopes.opened == 0


def test_opened_envelopes_are_bounded_least_recently_used_first(alice):
    envelopes = OpenedEnvelopes(limit=2)
    a, b, c = (sealed_node(alice, exp=NOW + i) for i in (1, 2, 3))
    for value in (a, b, a, c):  # b is the least recently used when c arrives
        envelopes.open(value)
    assert (len(envelopes), envelopes.opened) == (2, 3)
    assert envelopes.open(a).expiration == NOW + 1
    assert envelopes.opened == 3  # a was still there
    assert envelopes.open(b).expiration == NOW + 2
    assert envelopes.opened == 4  # b was forgotten, so opened again
    with pytest.raises(ConfigError):
        OpenedEnvelopes(limit=0)


# ----------------------------------------------------------------------------- plan keys


def test_plan_keys_accept_members_only(alice, mallory):
    r = rules(Clock())
    with pytest.raises(RecordError, match="not a member"):
        store_plan(r, alice)  # no node record of alice seen yet
    store_node(r, alice)
    assert store_plan(r, alice).record.proposer == alice.peer_id
    with pytest.raises(RecordError, match="not a member"):
        store_plan(r, mallory)


def test_a_refused_node_record_does_not_make_a_member(alice):
    r = rules(Clock())
    with pytest.raises(RecordError):
        store_node(r, alice, at=NOW + 60)
    with pytest.raises(RecordError, match="not a member"):
        store_plan(r, alice)


def test_membership_outlives_the_record_by_a_plans_lifetime(alice):
    clock = Clock()
    r = rules(clock)
    store_node(r, alice, exp=NOW + 10)
    clock.now = NOW + 10 + TTL  # the record expired max_ttl ago: its plans may still be served
    assert store_plan(r, alice, exp=clock.now + 5)
    clock.now = NOW + 10 + TTL + 0.01
    with pytest.raises(RecordError, match="not a member"):
        store_plan(r, alice, exp=clock.now + 5)


def test_a_plan_under_another_epochs_key_is_refused(alice):
    r = rules(Clock())
    store_node(r, alice)
    value = seal(proposal(alice.peer_id, 7), key=plans_key(SWARM, 7), subkey=alice.peer_id,
                 expiration=NOW + 10, sign=alice.sign)  # fmt: skip
    with pytest.raises(RecordError, match="wrong key"):
        r.check(key_id(plans_key(SWARM, 8)), alice.peer_id, value, NOW + 10)


def test_known_members_are_bounded_and_forget_the_expired_first():
    known = KnownMembers(limit=3)
    for i, until in enumerate([5.0, 50.0, 60.0]):
        known.note(f"p{i}", until, now=0.0)
    known.note("p0", 1.0, now=0.0)  # an older record never shortens what we know
    assert known.knows("p0", since=5.0)
    known.note("p3", 70.0, now=10.0)  # over the limit: p0 expired at 5 goes
    assert len(known) == 3
    assert not known.knows("p0", since=0.0)
    known.note("p4", 80.0, now=10.0)  # none expired: the soonest to expire goes
    assert len(known) == 3
    assert not known.knows("p1", since=0.0)
    assert all(known.knows(p, since=60.0) for p in ("p2", "p3", "p4"))


def test_rules_config_is_checked():
    with pytest.raises(ConfigError):
        RecordRules(SWARM, max_ttl_s=0, key_id=key_id)
    with pytest.raises(ConfigError):
        RecordRules(SWARM, max_ttl_s=10, max_skew_s=-1, key_id=key_id)
    with pytest.raises(ConfigError):
        RecordRules("bad name!", max_ttl_s=10, key_id=key_id)
