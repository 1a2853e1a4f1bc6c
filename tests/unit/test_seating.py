"""Who a plan may seat: suspicion.py's backoff (fake clock), seating.py's rules, and the
epoch agreement on fake records: observers and suspects stay out of every node's plan."""

import dataclasses

import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.dht.records import (
    MAX_SUSPECTS,
    DeviceInfo,
    NodeState,
    Suspicion,
    TrainingProgress,
)
from fusionllm.node.control.agreement import serving_peers
from fusionllm.node.control.seating import accusations, excluded, seatable
from fusionllm.node.control.suspicion import SuspicionBook, SuspicionConfig
from tests.unit.test_epochs import SETTINGS, T0, FakeClock, Node, epoch_round, record, swarm_of
from tests.unit.test_epochs import FakeDirectory as Directory

# ----------------------------------------------------------------------------- the backoff


def test_a_suspect_is_kept_out_15_s_then_twice_as_long_each_repeat():
    clock = FakeClock()
    book = SuspicionBook(clock=clock)
    lengths = []
    for _ in range(4):
        s = book.suspect("p", "barrier")
        lengths.append(s.until - clock.now)
        assert book.current() == (s,)
        clock.now = s.until  # it served its time, was planned again, and failed again
        assert book.current() == ()
    assert lengths == [15.0, 30.0, 60.0, 120.0]


def test_asking_again_while_it_is_out_changes_nothing():
    clock = FakeClock()
    book = SuspicionBook(clock=clock)
    first = book.suspect("p", "barrier")
    clock.now += 10
    assert book.suspect("p", "stalled") == first


def test_meeting_us_at_a_barrier_forgives_the_strikes():
    clock = FakeClock()
    book = SuspicionBook(SuspicionConfig(first_backoff_s=5.0), clock=clock)
    clock.now = book.suspect("p", "barrier").until
    clock.now = book.suspect("p", "barrier").until  # strike 2: 10 s
    book.cleared("p")
    again = book.suspect("p", "barrier")
    assert (again.strikes, again.until - clock.now) == (1, 5.0)


def test_meeting_us_at_a_barrier_ends_a_suspicion_in_force():
    # It came late (a view split, a slow hand-over) but came: it trains with us, and our
    # record must stop keeping it out of the next plan.
    clock = FakeClock()
    book = SuspicionBook(clock=clock)
    book.suspect("p", "barrier")
    clock.now += 5.0
    assert book.cleared("p") is True  # our record changes: the daemon beats at once
    assert book.current() == ()
    assert book.cleared("p") is False  # nothing left to lift
    again = book.suspect("p", "barrier")
    assert (again.strikes, again.until - clock.now) == (1, 15.0)


def test_strikes_are_forgiven_after_a_clear_spell_and_not_before():
    clock = FakeClock()
    book = SuspicionBook(SuspicionConfig(forgive_after_s=600.0), clock=clock)
    clock.now = book.suspect("p", "barrier").until + 599.0  # re-seated, failed again soon
    assert book.suspect("p", "barrier").strikes == 2
    clock.now = book.current()[0].until + 600.0  # ten clear minutes: a new view drop
    fresh = book.suspect("p", "barrier")
    assert (fresh.strikes, fresh.until - clock.now) == (1, 15.0)


def test_the_backoff_has_a_ceiling():
    config = SuspicionConfig(first_backoff_s=15.0, max_backoff_s=100.0)
    assert [config.backoff_s(k) for k in (1, 3, 4, 40)] == [15.0, 60.0, 100.0, 100.0]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"first_backoff_s": 0.0}, "first_backoff_s"),
        ({"first_backoff_s": 20.0, "max_backoff_s": 10.0}, "max_backoff_s"),
        ({"factor": 0.5}, "factor must be"),
        ({"factor": float("nan")}, "factor must be"),
        ({"forgive_after_s": 0.0}, "forgive_after_s"),
        ({"forgive_after_s": float("nan")}, "forgive_after_s"),
    ],
)
def test_bad_settings_are_refused(changes, match):
    with pytest.raises(ConfigError, match=match):
        SuspicionConfig(**changes)


def test_a_flood_of_suspects_stays_bounded():
    clock = FakeClock()
    book = SuspicionBook(clock=clock)
    for i in range(10 * MAX_SUSPECTS):
        book.suspect(f"p{i}", "barrier")
        clock.now += 0.01  # all still out: the book must drop some anyway
    assert len(book.current()) == MAX_SUSPECTS
    assert len(book._held) <= 4 * MAX_SUSPECTS
    assert book.current()[0].peer == f"p{10 * MAX_SUSPECTS - 1}"  # the newest kept


# ----------------------------------------------------------------------------- the rules


def _serving(peer: str, *suspects: str, until: float = T0 + 15, **changes):
    found = tuple(Suspicion(s, until, "barrier", 1) for s in suspects)
    return record(peer, state=NodeState.SERVING, suspects=found, **changes)


def test_an_observer_is_never_seatable():
    members = {"a": _serving("a"), "w": record("w", observer=True)}
    assert set(seatable(members, now=T0)) == {"a"}


def test_two_of_two_waiting_members_keep_a_suspect_out():
    members = {"a": _serving("a", "c"), "b": _serving("b", "c"), "c": _serving("c")}
    out = excluded(members, now=T0)
    assert sorted(a.by for a in out["c"]) == ["a", "b"]
    assert set(seatable(members, now=T0)) == {"a", "b"}


def test_half_the_others_that_serve_are_enough_and_fewer_are_not():
    members = {p: _serving(p) for p in "abcde"}
    members["a"] = _serving("a", "e")
    assert "e" not in excluded(members, now=T0)  # 1 of the 4 others: one member's word
    members["b"] = _serving("b", "e")
    assert "e" in excluded(members, now=T0)  # 2 of 4


def _at(step: int) -> TrainingProgress:
    return TrainingProgress(replica=0, step=step, loss=1.0)


def test_in_a_plan_of_two_the_partner_that_stalled_is_kept_out():
    # b stopped mid-run (its heartbeat up): a suspects it, b suspects nobody.
    members = {"a": _serving("a", "b", training=_at(40)), "b": _serving("b", training=_at(40))}
    assert set(excluded(members, now=T0)) == {"b"}
    assert set(seatable(members, now=T0)) == {"a"}


def test_in_a_plan_of_two_suspecting_back_keeps_nobody_out_at_the_same_step():
    # Each waited on the other (a frame lost between them): nobody can tell who failed whom.
    members = {
        "a": _serving("a", "b", training=_at(40)),
        "b": _serving("b", "a", training=_at(40)),
    }
    assert excluded(members, now=T0) == {}
    assert set(seatable(members, now=T0)) == {"a", "b"}


def test_in_a_plan_of_two_only_the_member_further_along_is_believed():
    # b crashed at the barrier and came back late: it suspects a, which went on without it.
    members = {
        "a": _serving("a", "b", training=_at(60)),
        "b": _serving("b", "a", training=_at(40)),
    }
    assert set(excluded(members, now=T0)) == {"b"}
    assert [x.by for x in accusations(members, now=T0)["b"]] == ["a"]
    # Behind, its word alone does not count either, mutual or not.
    members["a"] = _serving("a", training=_at(60))
    assert excluded(members, now=T0) == {}
    # A member that never trained (no progress in its record) cannot keep a trainer out.
    members = {"a": _serving("a", training=_at(3)), "n": _serving("n", "a")}
    assert excluded(members, now=T0) == {}
    members["a"] = _serving("a", "n", training=_at(3))
    assert set(excluded(members, now=T0)) == {"n"}


def test_a_suspicion_ends_with_its_backoff():
    members = {"a": _serving("a", "c"), "c": _serving("c")}
    assert "c" in excluded(members, now=T0 + 14.9)
    assert excluded(members, now=T0 + 15.0) == {}


def test_a_swarm_that_needs_every_member_seats_its_suspect():
    # --min-peers 3 of 3: keeping c out would leave 2, and no plan at all (the session 7
    # stall on topology C: stuck until a host was killed). Seated, c can meet the barrier.
    members = {"a": _serving("a", "c"), "b": _serving("b", "c"), "c": _serving("c")}
    assert excluded(members, now=T0, min_peers=3) == {}
    assert set(seatable(members, now=T0, min_peers=3)) == {"a", "b", "c"}
    # A swarm that can train without it keeps it out (the stalling members' protection).
    assert set(seatable(members, now=T0, min_peers=2)) == {"a", "b"}
    assert set(excluded(members, now=T0)) == {"c"}


def test_only_as_many_suspects_as_the_swarm_needs_are_seated_the_least_accused_first():
    members = {p: _serving(p) for p in "abcde"}
    members["a"] = _serving("a", "d", "e")
    members["b"] = _serving("b", "d", "e")
    members["c"] = _serving("c", "e", until=T0 + 30)  # e: three accusers, d: two
    members["w"] = record("w", observer=True)  # never seated: no room in the count
    assert set(excluded(members, now=T0, min_peers=3)) == {"d", "e"}
    assert set(excluded(members, now=T0, min_peers=4)) == {"e"}
    assert excluded(members, now=T0, min_peers=5) == {}
    assert excluded(members, now=T0, min_peers=9) == {}  # short anyway: nobody kept out
    # Equally accused: the one whose suspicions end first, on every node alike.
    members["c"] = _serving("c")
    for p in "ab":
        members[p] = dataclasses.replace(
            members[p],
            suspects=(Suspicion("d", T0 + 20, "barrier", 1), Suspicion("e", T0 + 10, "barrier", 1)),
        )
    assert set(excluded(members, now=T0, min_peers=4)) == {"d"}


def test_observers_and_self_accusations_and_strangers_do_not_count():
    members = {
        "a": _serving("a", "a", "zz"),  # itself, and a peer that is no member
        "w": record("w", observer=True, suspects=(Suspicion("a", T0 + 15, "barrier", 1),)),
    }
    assert accusations(members, now=T0) == {}


# ----------------------------------------------------------------------------- the agreement

FAST = DeviceInfo(name="RTX 4090", kind="cuda", memory_bytes=24 << 30, flops=8e13,
                  memory_bandwidth=1e12, op_overhead=1e-6, cpu_cores=16,
                  ram_bytes=64 << 30)  # fmt: skip


class Marked(Node):
    """A node whose record adds fields (observer, suspects) to what the test Node writes."""

    def __init__(self, *args, marks: dict, **kw) -> None:
        self.marks = marks
        super().__init__(*args, **kw)

    def info(self):
        return dataclasses.replace(super().info(), **self.marks)


def _seated_after_rounds(newcomer_marks: dict, rounds: int = 3) -> list[set[str]]:
    clock = FakeClock()
    directory, nodes = swarm_of(2, clock)
    fast = Marked("fast", directory, clock, marks=newcomer_marks, device=FAST, memory=24 << 30)
    nodes.append(fast)
    fast.heartbeat()
    seated = []
    for k in range(rounds):
        epoch_round(nodes, 850_000_000 + k)
        clock.now += 2.0
        seated.extend(serving_peers(n.agreement.adopted.plan) for n in nodes)
    return seated


def test_a_fast_newcomer_is_seated_unless_it_observes():
    assert any("fast" in s for s in _seated_after_rounds({}))  # the plan wants it
    assert not any("fast" in s for s in _seated_after_rounds({"observer": True}))


def test_every_node_plans_around_a_member_the_others_suspect():
    clock = FakeClock()
    directory = Directory()
    suspects = {"suspects": (Suspicion("fast", T0 + 60, "barrier", 1),), "state": NodeState.SERVING}
    nodes = [Marked(f"peer{i}", directory, clock, marks=suspects) for i in (0, 1)]
    nodes.append(Node("fast", directory, clock, device=FAST, memory=24 << 30))
    for node in nodes:
        node.heartbeat()
    for k in range(3):
        epoch_round(nodes, 850_000_000 + k)
        clock.now += 2.0
        adopted = {n.agreement.adopted.digest for n in nodes}
        assert len(adopted) == 1  # the suspect too: it reads the same records
        assert "fast" not in serving_peers(nodes[0].agreement.adopted.plan)
        assert all(n.agreement.excluded.keys() == {"fast"} for n in nodes)


def test_a_swarm_with_min_peers_all_plans_again_with_the_member_it_suspects():
    """Three members, ``--min-peers 3``; two suspect the third (it came late to a barrier in
    a view split): every node still adopts one plan, and it seats all three."""
    clock = FakeClock()
    directory = Directory()
    settings = dataclasses.replace(SETTINGS, min_peers=3)
    suspects = {"suspects": (Suspicion("peer2", T0 + 60, "barrier", 1),),
                "state": NodeState.SERVING}  # fmt: skip
    nodes = [Marked(f"peer{i}", directory, clock, marks=suspects, settings=settings)
             for i in (0, 1)]  # fmt: skip
    nodes.append(Node("peer2", directory, clock, settings=settings))
    for node in nodes:
        node.heartbeat()
    for k in range(2):
        epoch_round(nodes, 850_000_000 + k)
        clock.now += 2.0
    assert all(n.agreement.adopted is not None for n in nodes)
    assert len({n.agreement.adopted.digest for n in nodes}) == 1
    assert serving_peers(nodes[0].agreement.adopted.plan) == {"peer0", "peer1", "peer2"}
    assert all(n.agreement.excluded == {} for n in nodes)


def test_the_backup_pools_word_keeps_an_idle_plans_members_out():
    # x and y were seated together and never trained; a and b, left out, suspected both
    # (training/idle_plan.py). Backup members' suspicions count like any trainer's.
    idle = {"suspects": (Suspicion("x", T0 + 15, "idle", 1), Suspicion("y", T0 + 15, "idle", 1)),
            "training": _at(40)}  # fmt: skip
    members = {"a": record("a", **idle), "x": _serving("x", "a"), "y": _serving("y")}
    assert set(excluded(members, now=T0)) == {"x", "y"}  # x's word back: it never trained
    members["b"] = record("b", **idle)
    assert set(seatable(members, now=T0)) == {"a", "b"}
