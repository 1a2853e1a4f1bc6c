"""node/bandwidth.py: gossip reports, the link book and probe-target choice."""

import math
import random

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fusionllm.common.errors import ConfigError
from fusionllm.dht.records import DeviceInfo, LinkReport, NodeInfo, NodeState, RecordError
from fusionllm.node.control.bandwidth import (
    MAX_REPORT_BYTES,
    MAX_REPORT_LINKS,
    BandwidthBook,
    BandwidthReport,
    LinkSample,
    choose_probe_targets,
    describe,
    peer_of,
    quantize,
)

NOW = 1_700_000_000.0


class _Everyone:
    """A membership that contains every peer (for tests of other rules than membership)."""

    def __contains__(self, peer: object) -> bool:
        return True


EVERYONE = _Everyone()


def member(peer_id: str, *, up: float = 1e7, down: float = 1e8, links=()) -> NodeInfo:
    return NodeInfo(
        peer_id=peer_id,
        swarm="demo",
        addrs=(),
        dht_addrs=(),
        device=DeviceInfo(
            name="gpu",
            kind="cuda",
            memory_bytes=8 << 30,
            flops=1e12,
            memory_bandwidth=3e11,
            op_overhead=1e-5,
            cpu_cores=8,
            ram_bytes=16 << 30,
        ),
        uplink=up,
        downlink=down,
        links=tuple(links),
        software="fusionllm 0.1.0",
        config_digest="0123456789abcdef",
        state=NodeState.BACKUP,
        stage=None,
        adopted=None,
        time=NOW,
    )


def link(peer: str, bandwidth: float = 1e6, rtt: float = 0.02, age: float = 1.0) -> LinkReport:
    return LinkReport(peer=peer, bandwidth=bandwidth, rtt=rtt, age=age)


def report_wire(**changes) -> dict:
    wire = {"v": 1, "swarm": "demo", "t": NOW, "links": [link("b").to_wire()]}
    wire.update(changes)
    return wire


def pack(wire) -> bytes:
    return msgpack.packb(wire, use_bin_type=True)


# ----------------------------------------------------------------------------- reports


def test_report_round_trip():
    report = BandwidthReport(swarm="demo", time=NOW, links=(link("b"), link("c", 2e6, 0.1, 0.0)))
    assert BandwidthReport.from_bytes(report.to_bytes()) == report
    empty = BandwidthReport(swarm="demo", time=NOW, links=())
    assert BandwidthReport.from_bytes(empty.to_bytes()) == empty


def test_largest_report_fits():
    links = tuple(link("p" * 128, age=float(i)) for i in range(MAX_REPORT_LINKS))
    data = BandwidthReport(swarm="s" * 128, time=NOW, links=links).to_bytes()
    assert len(data) <= MAX_REPORT_BYTES
    assert len(BandwidthReport.from_bytes(data).links) == MAX_REPORT_LINKS


@given(
    links=st.lists(
        st.tuples(st.text(alphabet="abcdefgh123", min_size=1, max_size=40),
                  st.floats(1.0, 1e12), st.floats(0.0, 600.0), st.floats(0.0, 1e6)),
        max_size=MAX_REPORT_LINKS,
    ),
    when=st.floats(0.0, 4e9),
)  # fmt: skip
def test_report_round_trip_property(links, when):
    report = BandwidthReport(
        swarm="demo",
        time=when,
        links=tuple(LinkReport(peer=p, bandwidth=b, rtt=r, age=a) for p, b, r, a in links),
    )
    assert BandwidthReport.from_bytes(report.to_bytes()) == report


def test_oversize_report():
    with pytest.raises(RecordError, match="over"):
        BandwidthReport.from_bytes(b"\x00" * (MAX_REPORT_BYTES + 1))


def test_too_many_links():
    wire = report_wire(links=[link("b").to_wire()] * (MAX_REPORT_LINKS + 1))
    with pytest.raises(RecordError):
        BandwidthReport.from_bytes(pack(wire))


@pytest.mark.parametrize(
    "wire",
    [
        {k: v for k, v in report_wire().items() if k != "links"},
        {k: v for k, v in report_wire().items() if k != "v"},
        {**report_wire(), "sig": "x"},
        [1, 2, 3],
        "report",
        None,
    ],
)
def test_wrong_fields(wire):
    with pytest.raises(RecordError):
        BandwidthReport.from_bytes(pack(wire))


@pytest.mark.parametrize("version", [0, 2, "1", None, True, 1.0])
def test_unsupported_version(version):
    with pytest.raises(RecordError, match="version"):
        BandwidthReport.from_bytes(pack(report_wire(v=version)))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("swarm", ""),
        ("swarm", 5),
        ("swarm", "s" * 129),
        ("swarm", b"demo"),
        ("t", math.nan),
        ("t", math.inf),
        ("t", True),
        ("t", "now"),
        ("t", None),
        ("links", "b"),
        ("links", {"b": 1}),
        ("links", None),
        ("links", [["b", math.nan, 0.02, 1.0]]),
        ("links", [["b", 1e6, math.inf, 1.0]]),
        ("links", [["b", -1e6, 0.02, 1.0]]),
        ("links", [["b", 1e6, 0.02]]),
        ("links", [["", 1e6, 0.02, 1.0]]),
        ("links", [[b"b", 1e6, 0.02, 1.0]]),
        ("links", [["b", True, 0.02, 1.0]]),
    ],
)
def test_bad_values(field, value):
    with pytest.raises(RecordError):
        BandwidthReport.from_bytes(pack(report_wire(**{field: value})))


@pytest.mark.parametrize(
    "data", [b"", b"\xc1", b"\x81", pack({1: 2}), pack(report_wire()) + b"\x00", pack([[[]]])]
)
def test_junk_report_bytes(data):
    with pytest.raises(RecordError):
        BandwidthReport.from_bytes(data)


@given(data=st.binary(max_size=300))
def test_arbitrary_bytes_only_raise_record_error(data):
    try:
        report = BandwidthReport.from_bytes(data)
    except RecordError:
        return
    # Whatever parses is a well-formed report: it survives our own encoding unchanged.
    assert len(report.links) <= MAX_REPORT_LINKS
    assert math.isfinite(report.time)
    assert BandwidthReport.from_bytes(report.to_bytes()) == report


# ----------------------------------------------------------------------------- the book


def sample(at: float, bandwidth: float = 1e6, rtt: float = 0.02) -> LinkSample:
    return LinkSample(bandwidth=bandwidth, rtt=rtt, measured_at=at)


@pytest.mark.parametrize("max_age", [0.0, -1.0, math.nan])
def test_book_needs_positive_max_age(max_age):
    with pytest.raises(ConfigError, match="max_age_s"):
        BandwidthBook(max_age_s=max_age)


def test_newest_sample_wins():
    book = BandwidthBook(max_age_s=60.0)
    assert book.record("a", "b", sample(NOW - 10, 1e6), now=NOW)
    assert book.record("a", "b", sample(NOW - 5, 2e6), now=NOW)
    assert not book.record("a", "b", sample(NOW - 7, 3e6), now=NOW)  # older: ignored
    assert not book.record("a", "b", sample(NOW - 5, 4e6), now=NOW)  # same time: ignored
    assert book.towards("b", NOW, sources=EVERYONE) == [2e6]
    assert book.last_measured("a", NOW) == {"b": NOW - 5}


def test_a_window_keeps_the_best_recent_figures():
    """Our own probes: a slow probe on a busy CPU does not price the link; the link's figure
    is its fastest recent bandwidth and lowest recent RTT, dated by the newest sample."""
    book = BandwidthBook(max_age_s=60.0)
    assert book.record("a", "b", sample(NOW - 3, 8e6, rtt=0.004), now=NOW, window=3)
    assert book.record("a", "b", sample(NOW - 2, 1e6, rtt=0.001), now=NOW, window=3)
    assert book.record("a", "b", sample(NOW - 1, 2e6, rtt=0.009), now=NOW, window=3)
    assert book.towards("b", NOW, sources=EVERYONE) == [8e6]
    (link_ab,) = [v for v in book.link_table([member("a"), member("b")], now=NOW) if v.src == "a"]
    assert (link_ab.bandwidth, link_ab.rtt, link_ab.age) == (8e6, 0.001, pytest.approx(1.0))
    # A fourth sample pushes the first (the fast one) out: a link that slowed shows.
    assert book.record("a", "b", sample(NOW, 3e6, rtt=0.009), now=NOW, window=3)
    assert book.towards("b", NOW, sources=EVERYONE) == [3e6]
    # Samples also leave by age, one by one.
    assert book.towards("b", NOW + 59.5, sources=EVERYONE) == [3e6]
    book.record("a", "c", sample(NOW + 30, 5e6), now=NOW + 30, window=3)
    assert book.towards("b", NOW + 60.5, sources=EVERYONE) == []


def test_the_newest_sample_says_what_a_link_costs_now():
    """The witness (control/pace.py) prices a step's frames at the link's newest figure: the
    best of the window is the plan's, and a link that slowed since must not read as compute."""
    book = BandwidthBook(max_age_s=60.0)
    assert book.newest("a", "b", now=NOW) is None
    book.record("a", "b", sample(NOW - 3, 8e6, rtt=0.004), now=NOW, window=3)
    book.record("a", "b", sample(NOW - 1, 1e6, rtt=0.009), now=NOW, window=3)
    assert book.towards("b", NOW, sources=EVERYONE) == [8e6]
    newest = book.newest("a", "b", now=NOW)
    assert (newest.bandwidth, newest.rtt) == (1e6, 0.009)
    assert book.newest("b", "a", now=NOW) is None  # a direction of its own
    assert book.newest("a", "b", now=NOW + 58.5) is not None
    assert book.newest("a", "b", now=NOW + 59.5) is None  # stale: the plan's figure again


def test_window_one_replaces_and_a_bad_window_is_refused():
    """A member's gossip is its own filtered figure: it replaces what we had of that link."""
    book = BandwidthBook(max_age_s=60.0)
    book.record("a", "b", sample(NOW - 2, 8e6), now=NOW, window=4)
    book.record("a", "b", sample(NOW - 1, 1e6), now=NOW)
    assert book.towards("b", NOW, sources=EVERYONE) == [1e6]
    with pytest.raises(ValueError, match="window"):
        book.record("a", "b", sample(NOW), now=NOW, window=0)


def test_directions_are_separate():
    book = BandwidthBook(max_age_s=60.0)
    assert book.record("a", "b", sample(NOW, 1e6), now=NOW)
    assert book.record("b", "a", sample(NOW, 5e6), now=NOW)
    assert book.towards("b", NOW, sources=EVERYONE) == [1e6]
    assert book.towards("a", NOW, sources=EVERYONE) == [5e6]


def test_stale_and_future_samples_refused():
    book = BandwidthBook(max_age_s=60.0)
    assert not book.record("a", "b", sample(NOW - 60.001), now=NOW)
    assert book.record("a", "b", sample(NOW - 60.0), now=NOW)  # exactly max_age: kept
    assert not book.record("a", "c", sample(NOW + 5.001), now=NOW)
    assert book.record("a", "c", sample(NOW + 5.0), now=NOW)  # small clock skew tolerated
    assert not book.record("a", "d", sample(math.nan), now=NOW)
    assert book.last_measured("a", NOW) == {"b": NOW - 60.0, "c": NOW + 5.0}


def test_self_links_refused():
    book = BandwidthBook(max_age_s=60.0)
    assert not book.record("a", "a", sample(NOW), now=NOW)
    assert book.towards("a", NOW, sources=EVERYONE) == []


def test_samples_expire():
    book = BandwidthBook(max_age_s=30.0)
    book.record("a", "b", sample(NOW), now=NOW)
    book.record("c", "b", sample(NOW + 20, 3e6), now=NOW + 20)
    assert sorted(book.towards("b", NOW + 30, sources=EVERYONE)) == [1e6, 3e6]
    assert book.towards("b", NOW + 30.5, sources=EVERYONE) == [3e6]
    assert book.last_measured("a", NOW + 31) == {}
    assert book.towards("b", NOW + 51, sources=EVERYONE) == []
    # An expired link accepts any fresh sample again.
    assert book.record("a", "b", sample(NOW + 40), now=NOW + 40)


def test_record_report_attributes_links_to_author():
    book = BandwidthBook(max_age_s=60.0)
    report = BandwidthReport(
        swarm="demo",
        time=NOW,
        links=(
            link("b", 1e6, age=2.0),
            link("c", 2e6, age=100.0),  # measured 100 s before the report: stale
            link("alice", 3e6),  # the author's link to itself: refused
        ),
    )
    assert book.record_report("alice", report, now=NOW, members=EVERYONE) == 1
    assert book.last_measured("alice", NOW) == {"b": NOW - 2.0}
    assert book.towards("b", NOW, sources=EVERYONE) == [1e6]
    assert book.last_measured("b", NOW) == {}  # nothing attributed to the link's peer
    # Replaying the same report adds nothing; a newer one replaces.
    assert book.record_report("alice", report, now=NOW, members=EVERYONE) == 0
    newer = BandwidthReport(swarm="demo", time=NOW + 10, links=(link("b", 9e6, age=0.0),))
    assert book.record_report("alice", newer, now=NOW + 10, members=EVERYONE) == 1
    assert book.towards("b", NOW + 10, sources=EVERYONE) == [9e6]


def test_record_report_from_the_future_refused():
    book = BandwidthBook(max_age_s=60.0)
    report = BandwidthReport(swarm="demo", time=NOW + 3600, links=(link("b", age=0.0),))
    assert book.record_report("alice", report, now=NOW, members=EVERYONE) == 0


def test_record_report_only_from_members_about_members():
    book = BandwidthBook(max_age_s=60.0)
    members = {"alice", "b", "c"}
    report = BandwidthReport(
        swarm="demo", time=NOW, links=(link("b", 1e6), link("stranger", 2e6), link("c", 3e6))
    )
    # A stranger's report is not filed at all, whatever it claims.
    assert book.record_report("mallory", report, now=NOW, members=members) == 0
    assert book.last_measured("mallory", NOW) == {}
    # A member's report keeps only its links towards members.
    assert book.record_report("alice", report, now=NOW, members=members) == 2
    assert book.last_measured("alice", NOW) == {"b": NOW - 1.0, "c": NOW - 1.0}


def test_a_stranger_cannot_set_a_members_downlink():
    book = BandwidthBook(max_age_s=60.0)
    book.record("a", "me", sample(NOW, 2e6), now=NOW)
    book.record("mallory", "me", sample(NOW, 1e14), now=NOW)  # e.g. filed before a rule
    assert sorted(book.towards("me", NOW, sources=EVERYONE)) == [2e6, 1e14]
    assert book.towards("me", NOW, sources={"a", "me"}) == [2e6]
    assert book.towards("me", NOW, sources=set()) == []


def test_own_report_newest_first_and_capped():
    book = BandwidthBook(max_age_s=1000.0)
    for i in range(MAX_REPORT_LINKS + 10):
        book.record("me", f"peer{i:03d}", sample(NOW - i, bandwidth=1e6 + i), now=NOW)
    book.record("other", "peer000", sample(NOW, 5e9), now=NOW)
    report = book.own_report("me", "demo", now=NOW + 1)
    assert report.swarm == "demo"
    assert report.time == NOW + 1
    assert len(report.links) == MAX_REPORT_LINKS
    assert [x.peer for x in report.links] == [f"peer{i:03d}" for i in range(MAX_REPORT_LINKS)]
    assert [x.age for x in report.links] == [1.0 + i for i in range(MAX_REPORT_LINKS)]
    assert report.links[0].bandwidth == 1e6
    # It survives the wire and re-attributes to the same measurement times.
    back = BandwidthReport.from_bytes(report.to_bytes())
    other = BandwidthBook(max_age_s=1000.0)
    assert other.record_report("me", back, now=NOW + 1, members=EVERYONE) == MAX_REPORT_LINKS
    expected = {f"peer{i:03d}": NOW - i for i in range(MAX_REPORT_LINKS)}
    assert other.last_measured("me", NOW + 1) == expected


def test_own_report_ties_by_peer_and_no_negative_age():
    book = BandwidthBook(max_age_s=60.0)
    for peer in ("c", "a", "b"):
        book.record("me", peer, sample(NOW + 2), now=NOW)  # slightly in the future
    report = book.own_report("me", "demo", now=NOW)
    assert [x.peer for x in report.links] == ["a", "b", "c"]
    assert all(x.age == 0.0 for x in report.links)
    assert book.own_report("nobody", "demo", now=NOW).links == ()


# ----------------------------------------------------------------------------- planner view


def test_quantize_grid():
    assert quantize(1024.0) == 1024.0
    assert quantize(1e6) == 2.0**20
    assert quantize(1.0) == 1.0
    assert quantize(3.0) == pytest.approx(2**1.5)
    assert quantize(0.05, 2) == pytest.approx(2**-4.5)
    assert quantize(0.0) == 0.0
    assert quantize(-1.0) == -1.0
    assert math.isinf(quantize(math.inf))
    assert math.isnan(quantize(math.nan))


@given(value=st.floats(1e-6, 1e15), steps=st.sampled_from([1, 2, 4, 8]))
def test_quantize_lands_on_the_grid_and_nearby(value, steps):
    q = quantize(value, steps)
    exponent = math.log2(q) * steps
    assert exponent == pytest.approx(round(exponent), abs=1e-9)
    assert abs(math.log2(q) - math.log2(value)) <= 0.5 / steps + 1e-9
    assert quantize(q, steps) == pytest.approx(q, rel=1e-12)


def test_swarm_uses_quantized_measured_links():
    members = [member("a", up=1e7, down=1e8), member("b", up=2e7, down=5e7), member("c")]
    book = BandwidthBook(max_age_s=60.0)
    book.record("a", "b", sample(NOW - 1, 1.01e6, 0.03), now=NOW)
    book.record("b", "x", sample(NOW - 1, 1e6), now=NOW)  # x is not a member: left out
    book.record("c", "a", sample(NOW - 100, 1e6), now=NOW - 90)  # stale by now
    swarm = book.swarm(members, now=NOW)
    assert swarm.peer_ids == ("a", "b", "c")
    a, b, c = (swarm.index(p) for p in "abc")
    measured = swarm.link(a, b)
    assert measured.bandwidth == 2.0**20
    assert measured.rtt == pytest.approx(quantize(0.03, 2))
    # Unmeasured pairs are estimated from the (quantized) access links.
    assert swarm.link(b, a).bandwidth == min(quantize(2e7), quantize(1e8))
    assert swarm.link(c, a).bandwidth == min(quantize(1e7), quantize(1e8))
    assert swarm.src.size == 1


def test_swarm_rtt_floor():
    members = [member("a"), member("b")]
    book = BandwidthBook(max_age_s=60.0)
    book.record("a", "b", sample(NOW, 1e6, 0.0), now=NOW)
    swarm = book.swarm(members, now=NOW)
    assert swarm.link(swarm.index("a"), swarm.index("b")).rtt == quantize(1e-4, 2)


def test_noisy_books_build_the_same_swarm():
    members = [member("a"), member("b"), member("c")]
    one, two = BandwidthBook(max_age_s=60.0), BandwidthBook(max_age_s=60.0)
    one.record("a", "b", sample(NOW - 1, 1.00e6, 0.031), now=NOW)
    two.record("a", "b", sample(NOW - 3, 1.02e6, 0.029), now=NOW)
    s1, s2 = one.swarm(members, now=NOW), two.swarm(list(reversed(members)), now=NOW)
    assert np.array_equal(s1.bandwidth, s2.bandwidth)
    assert np.array_equal(s1.rtt, s2.rtt)
    assert np.array_equal(s1.src, s2.src)
    assert np.array_equal(s1.dst, s2.dst)


def test_peer_of_quantizes_device_and_takes_median_rtt():
    info = member("a", up=1e7, down=1e8,
                  links=[link("b", rtt=0.01), link("c", rtt=0.2), link("d", rtt=0.04)])  # fmt: skip
    peer = peer_of(info)
    assert peer.peer_id == "a"
    assert peer.uplink == quantize(1e7)
    assert peer.downlink == quantize(1e8)
    assert peer.device.flops == quantize(1e12)
    assert peer.device.memory_bandwidth == quantize(3e11)
    assert peer.device.memory_bytes == 8 << 30
    assert peer.device.op_overhead == quantize(1e-5)
    assert peer.rtt == quantize(0.04, 2)
    assert peer_of(member("b")).rtt == 0.05  # no links: the default


def test_link_table_marks_estimated_links():
    members = [member("b", up=2e7, down=5e7), member("a", up=1e7, down=1e8)]
    book = BandwidthBook(max_age_s=60.0)
    book.record("a", "b", sample(NOW - 4, 3e6, 0.02), now=NOW)
    table = book.link_table(members, now=NOW)
    assert [(v.src, v.dst) for v in table] == [("a", "b"), ("b", "a")]
    measured, estimated = table
    assert measured.measured
    assert measured.bandwidth == 3e6
    assert measured.rtt == 0.02
    assert measured.age == pytest.approx(4.0)
    assert not estimated.measured
    assert estimated.age is None
    assert estimated.bandwidth == min(2e7, 1e8)
    assert estimated.rtt == 0.05
    shown = describe(measured)
    assert shown == {"src": "a", "dst": "b", "mb_per_s": 3.0, "rtt_ms": 20.0, "measured": True,
                     "age_s": 4.0}  # fmt: skip
    assert describe(estimated)["age_s"] is None


def test_link_table_size():
    members = [member(p) for p in "abcd"]
    table = BandwidthBook(max_age_s=1.0).link_table(members, now=NOW)
    assert len(table) == 4 * 3
    assert not any(v.measured for v in table)


# ----------------------------------------------------------------------------- probe targets


def targets(**kwargs) -> list[str]:
    args = {"me": "me", "candidates": [], "last_measured": {}, "count": 3,
            "rng": random.Random(7)}  # fmt: skip
    args.update(kwargs)
    return choose_probe_targets(args.pop("me"), args.pop("candidates"), args.pop("last_measured"),
                                **args)  # fmt: skip


def test_priority_first():
    got = targets(candidates=["a", "b", "c", "d", "me"], priority=["d", "c"], count=3)
    assert got[:2] == ["c", "d"]
    assert len(got) == 3


def test_priority_outside_candidates_ignored():
    got = targets(candidates=["a", "b"], priority=["zz", "me"], count=5)
    assert sorted(got) == ["a", "b"]


def test_priority_ordered_by_staleness():
    got = targets(candidates=["a", "b", "c"], priority=["a", "b"],
                  last_measured={"a": NOW, "b": NOW - 10}, count=2)  # fmt: skip
    assert got == ["b", "a"]


def test_never_measured_before_measured():
    last = {"a": NOW - 5, "b": NOW - 50}
    got = targets(candidates=["a", "b", "c", "d"], last_measured=last, count=4)
    assert set(got[:2]) == {"c", "d"}
    assert got[2:] == ["b", "a"]  # then the least recently measured


def test_count_cap_and_never_self():
    cands = [f"p{i}" for i in range(20)] + ["me"]
    for count in (0, 1, 5, 30):
        got = targets(candidates=cands, count=count, priority=["me"])
        assert len(got) == min(count, 20)
        assert "me" not in got
        assert len(set(got)) == len(got)
    assert targets(candidates=["me"], count=3) == []


def test_duplicate_candidates_once():
    assert sorted(targets(candidates=["a", "a", "b"], count=5)) == ["a", "b"]


def test_deterministic_for_a_seeded_random():
    cands = [f"p{i}" for i in range(30)]
    runs = [targets(candidates=cands, count=5, rng=random.Random(42)) for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    # Among equals the choice is random: other seeds pick other peers.
    picks = {tuple(targets(candidates=cands, count=5, rng=random.Random(s))) for s in range(10)}
    assert len(picks) > 1


def test_random_among_equals_covers_everyone_eventually():
    rng = random.Random(1)
    seen = set()
    for _ in range(20):
        seen.update(targets(candidates=[f"p{i}" for i in range(10)], count=2, rng=rng))
    assert seen == {f"p{i}" for i in range(10)}
