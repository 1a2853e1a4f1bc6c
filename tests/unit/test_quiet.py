"""quiet.py: when an idle, stable swarm acts, what wakes it, and what its records promise."""

import msgpack
import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.dht.records import (
    DeviceInfo,
    NodeInfo,
    NodeState,
    RecordError,
    TrainingProgress,
)
from fusionllm.node.control.agreement import fresh_members
from fusionllm.node.control.bandwidth import BandwidthReport
from fusionllm.node.control.quiet import (
    MAX_BEAT,
    MAX_PROPOSAL_TTL_S,
    ConnectionWatch,
    HeldAge,
    QuietCadence,
    check_stride,
    quiet_view,
)

NOW = 1_700_000_000.0
DIGEST = "0123456789abcdef"


def info(peer: str, *, adopted: str | None = "d" * 64, at: float = NOW, **changes) -> NodeInfo:
    device = DeviceInfo(name="cpu", kind="cpu", memory_bytes=1 << 33, flops=1e11,
                        memory_bandwidth=1e10, op_overhead=1e-5, cpu_cores=2,
                        ram_bytes=1 << 33)  # fmt: skip
    fields = dict(peer_id=peer, swarm="demo", addrs=(), dht_addrs=(), device=device, uplink=1e8,
                  downlink=1e8, links=(), software="t", config_digest=DIGEST,
                  state=NodeState.BACKUP, stage=None,
                  adopted=(7, adopted) if adopted else None, time=at)  # fmt: skip
    fields.update(changes)
    return NodeInfo(**fields)


def test_the_stride_doubles_while_nothing_changes_and_stays_aligned():
    cadence = QuietCadence(32)
    view = ("members", "plan")
    strides = []
    for _ in range(8):
        cadence.observed(view)
        strides.append(cadence.stride)
    assert strides == [1, 2, 4, 8, 16, 32, 32, 32]  # the first sight only starts the count
    assert [e for e in range(60, 140) if cadence.acts(e)] == [64, 96, 128]
    assert MAX_BEAT < 32
    assert cadence.beat == MAX_BEAT  # records skip at most MAX_BEAT beats, however quiet


def test_a_changed_view_wakes_and_says_to_tell_only_when_quiet():
    cadence = QuietCadence(8)
    assert not cadence.observed("a")
    assert not cadence.observed("b")  # a change while acting every epoch: nothing to tell
    for _ in range(3):
        assert not cadence.observed("b")
    assert cadence.stride == 8
    assert cadence.observed("c")  # quiet, and the swarm changed: tell the others
    assert cadence.stride == 1
    assert not cadence.observed("c")
    assert cadence.stride == 2
    assert cadence.observed(None)  # not idle any more (a member trains): wake and tell
    assert (cadence.stride, cadence.beat) == (1, 1)


def test_a_wake_by_a_hint_tells_only_if_the_next_look_finds_a_change():
    cadence = QuietCadence(4)
    for _ in range(3):
        cadence.observed("v")
    assert cadence.stride == 4
    cadence.wake(alert=True)  # a stranger connected
    assert cadence.stride == 1
    assert all(cadence.acts(e) for e in range(5))
    assert not cadence.observed("v")  # nothing changed: quiet again from here
    assert cadence.stride == 2
    cadence.wake(alert=True)
    assert cadence.observed("w")  # it did change: tell the swarm

    told = QuietCadence(4)
    for _ in range(3):
        told.observed("v")
    told.wake(alert=False)  # a member told us: it already told everyone
    assert not told.observed("w")
    assert told.stride == 1


def test_max_stride_one_never_goes_quiet():
    cadence = QuietCadence(1)
    for _ in range(5):
        assert not cadence.observed("v")
    assert (cadence.stride, cadence.beat) == (1, 1)


@pytest.mark.parametrize("bad", [0, 3, 6, 128, -2, 2.0, True, "8", None])
def test_stride_must_be_a_power_of_two_in_range(bad):
    with pytest.raises(ConfigError):
        check_stride(bad)


def test_quiet_view_needs_every_member_on_our_plan_and_none_training():
    plan = "d" * 64
    members = {"a": info("a"), "b": info("b"), "me": info("me", adopted=None)}
    assert quiet_view(members, plan, own="me") == (frozenset(members), plan)
    # Our own record may lag what we follow: it is not asked.
    other = {**members, "b": info("b", adopted="e" * 64)}
    assert quiet_view(other, plan, own="me") is None
    newcomer = {**members, "c": info("c", adopted=None)}
    assert quiet_view(newcomer, plan, own="me") is None
    training = {**members, "b": info("b", training=TrainingProgress(0, 5, 2.0))}
    assert quiet_view(training, plan, own="me") is None
    finished = {**members, "b": info("b", training=TrainingProgress(0, 5, 2.0, True))}
    assert quiet_view(finished, plan, own="me") is not None
    # A swarm where no plan is feasible is idle too, once nobody follows one.
    waiting = {p: info(p, adopted=None) for p in ("a", "b", "me")}
    assert quiet_view(waiting, None, own="me") == (frozenset(waiting), None)


def test_a_quiet_record_is_suspected_later_and_believed_only_up_to_max_beat():
    suspect = 6.0
    records = {
        "loud": info("loud", at=NOW - suspect - 1),
        "quiet": info("quiet", at=NOW - 3 * suspect, beat=4),
        "too_quiet": info("too_quiet", at=NOW - MAX_BEAT * suspect - 1, beat=64),
        "fresh_quiet": info("fresh_quiet", at=NOW - 1, beat=2),
    }
    fresh = fresh_members(records, digest=DIGEST, now=NOW, suspect_after_s=suspect,
                          max_skew_s=30.0)  # fmt: skip
    assert sorted(fresh) == ["fresh_quiet", "quiet"]


def test_beat_on_the_wire():
    quiet = info("a", beat=4)
    assert NodeInfo.from_wire(quiet.to_wire()).beat == 4
    loud = info("a")
    assert "beat" not in loud.to_wire()  # records of loud nodes are as they were
    assert NodeInfo.from_wire(loud.to_wire()).beat == 1
    for bad in (0, 65, 2.0, True, "4"):
        wire = {**loud.to_wire(), "beat": bad}
        with pytest.raises(RecordError):
            NodeInfo.from_wire(wire)


def test_wake_on_the_wire():
    report = BandwidthReport(swarm="demo", time=NOW, links=(), wake=True)
    assert BandwidthReport.from_bytes(report.to_bytes()).wake
    plain = BandwidthReport(swarm="demo", time=NOW, links=())
    assert not BandwidthReport.from_bytes(plain.to_bytes()).wake
    for bad in (False, 1, "yes", None):
        wire = {"v": 1, "swarm": "demo", "t": NOW, "links": [], "wake": bad}
        with pytest.raises(RecordError):
            BandwidthReport.from_bytes(msgpack.packb(wire))


def test_connection_hints():
    watch = ConnectionWatch()
    members = {"me", "a", "b"}
    none = (frozenset(), frozenset())
    assert watch.hint(["a", "b"], members) == none
    assert watch.hint(["a", "b", "x"], members) == ({"x"}, set())
    assert watch.hint(["a", "b", "x"], members) == none  # the same stranger: no news
    assert watch.hint(["a", "b"], members) == none  # it left
    assert watch.hint(["a", "b", "x"], members) == ({"x"}, set())  # ... and came back
    assert watch.hint(["a", "x"], members) == (set(), {"b"})
    assert watch.hint(["a", "x"], members - {"b"}) == none  # b left the members: not news
    # A flood of strangers is remembered only while they are connected: no unbounded set.
    for i in range(3072):
        watch.hint(["a", f"s{i}"], members)
    assert watch._strangers == {"s3071"}


def test_link_figures_live_longer_while_quiet_and_for_a_while_after():
    held = HeldAge(60.0)
    assert held.max_age(1, now=0.0) == 60.0
    assert held.max_age(4, now=10.0) == 240.0
    assert held.max_age(8, now=20.0) == 480.0
    assert held.max_age(8, now=99.0) == 480.0  # asked every second while quiet (links.py)
    # Woken at 100 s: figures stay until the resumed rounds could have replaced them ...
    assert held.max_age(1, now=100.0) == 480.0
    assert held.max_age(1, now=158.0) == 480.0
    # ... then the usual age (measured from the last moment we were that quiet).
    assert held.max_age(1, now=160.0) == 60.0
    assert held.max_age(2, now=170.0) == 120.0


def test_a_proposal_lives_past_the_next_epoch_its_node_acts_in():
    """Stored every ``stride`` epochs (the stride may double meanwhile), a proposal that lived
    4 epochs left a quiet swarm without one for most of each stride: status then found the
    plan every member follows but nothing to describe it with."""
    cadence = QuietCadence(16)
    assert cadence.proposal_ttl_s(2.0) == 10.0  # acting every epoch: 5 epochs, as 4 before
    for _ in range(4):
        cadence.observed("same view")
    assert cadence.stride == 8
    next_acting_at_most = 2 * cadence.stride  # epochs from now, if the stride doubles
    assert cadence.proposal_ttl_s(2.0) >= (next_acting_at_most + 1) * 2.0
    assert cadence.proposal_ttl_s(60.0) == MAX_PROPOSAL_TTL_S  # under the DHT's max TTL
