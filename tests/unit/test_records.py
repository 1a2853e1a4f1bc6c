"""dht/records.py: strict wire schemas; every malformed peer record is a RecordError."""

import dataclasses
import math

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fusionllm.common.errors import ConfigError, PeerError
from fusionllm.dht.records import (
    MAX_ADDR_CHARS,
    MAX_ADDRS,
    MAX_LINKS,
    MAX_NAME_CHARS,
    MAX_PEER_ID_CHARS,
    MAX_PLAN_BYTES,
    DeviceInfo,
    LinkReport,
    NodeInfo,
    NodeState,
    PlanProposal,
    RecordError,
)

DIGEST = "ab" * 32


def device(**changes) -> DeviceInfo:
    fields = {
        "name": "NVIDIA GeForce RTX 3090",
        "kind": "cuda",
        "memory_bytes": 24 << 30,
        "flops": 30e12,
        "memory_bandwidth": 900e9,
        "op_overhead": 2e-5,
        "cpu_cores": 16,
        "ram_bytes": 64 << 30,
    }
    fields.update(changes)
    return DeviceInfo(**fields)


def node(**changes) -> NodeInfo:
    fields = {
        "peer_id": "12D3KooWPeerA",
        "swarm": "demo",
        "addrs": ("/ip4/10.0.0.1/tcp/4001/p2p/12D3KooWPeerA",),
        "dht_addrs": ("/ip4/10.0.0.1/tcp/4002",),
        "device": device(),
        "uplink": 12.5e6,
        "downlink": 100e6,
        "links": (LinkReport(peer="12D3KooWPeerB", bandwidth=5e6, rtt=0.02, age=3.0),),
        "software": "fusionllm 0.1.0",
        "config_digest": "0123456789abcdef",
        "state": NodeState.SERVING,
        "stage": 2,
        "adopted": (17, DIGEST),
        "time": 1.7e9,
    }
    fields.update(changes)
    return NodeInfo(**fields)


def proposal(**changes) -> PlanProposal:
    fields = {
        "swarm": "demo",
        "epoch": 12,
        "proposer": "12D3KooWPeerA",
        "estimate": 0.75,
        "plan": b'{"method":"op-fence"}',
    }
    fields.update(changes)
    return PlanProposal(**fields)


def through_msgpack(wire):
    return msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False)


def test_record_error_is_a_peer_error():
    """Readers skip a peer's bad entry by catching PeerError: every parse failure must be one,
    of the record kind (not a KeyError or TypeError from a half-checked map)."""
    for bad in ({"v": 1}, {"v": 1, "id": 5}, [], None, {"v": True}):
        with pytest.raises(PeerError) as caught:
            NodeInfo.from_wire(bad)
        assert type(caught.value) is RecordError, (bad, caught.value)
        with pytest.raises(PeerError) as caught:
            PlanProposal.from_wire(bad)
        assert type(caught.value) is RecordError, (bad, caught.value)


# ----------------------------------------------------------------------------- round trips


def test_node_info_round_trips_through_msgpack():
    info = node()
    assert NodeInfo.from_wire(through_msgpack(info.to_wire())) == info


def test_node_info_round_trip_with_optional_fields_absent():
    info = node(stage=None, adopted=None, links=(), addrs=(), dht_addrs=(), state="joining")
    back = NodeInfo.from_wire(through_msgpack(info.to_wire()))
    assert back.stage is None
    assert back.adopted is None
    assert back.links == ()
    assert back.state is NodeState.JOINING


def test_node_info_from_wire_builds_tuples_and_enum():
    back = NodeInfo.from_wire(through_msgpack(node().to_wire()))
    assert isinstance(back.addrs, tuple)
    assert isinstance(back.links, tuple)
    assert isinstance(back.adopted, tuple)
    assert back.adopted == (17, DIGEST)
    assert isinstance(back.state, NodeState)
    assert isinstance(back.uplink, float)


def test_plan_proposal_round_trip_and_digest():
    prop = proposal()
    back = PlanProposal.from_wire(through_msgpack(prop.to_wire()))
    assert back == prop
    assert back.digest == prop.digest
    assert len(prop.digest) == 64
    assert proposal(plan=b"other").digest != prop.digest


def test_link_report_round_trip():
    link = LinkReport(peer="12D3KooWPeerB", bandwidth=1e6, rtt=0.0, age=0.0)
    assert LinkReport.from_wire(through_msgpack(link.to_wire())) == link


_printable = st.text(
    alphabet=st.characters(min_codepoint=32, max_codepoint=0x2FFF).filter(str.isprintable),
    min_size=1,
    max_size=40,
)
_positive = st.floats(min_value=1e-3, max_value=1e14, allow_nan=False, allow_infinity=False)


@given(
    name=_printable,
    memory=st.integers(1, 1 << 50),
    flops=_positive,
    overhead=st.floats(0.0, 1.0),
    cores=st.integers(1, 1 << 16),
    peer=_printable,
    bandwidth=_positive,
    rtt=st.floats(0.0, 600.0),
    state=st.sampled_from(list(NodeState)),
    stage=st.none() | st.integers(0, 1 << 16),
    epoch=st.integers(0, 1 << 62),
    digest=st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
    n_addrs=st.integers(0, MAX_ADDRS),
    when=st.floats(0.0, 1e11),
)
def test_node_info_round_trip_property(
    name, memory, flops, overhead, cores, peer, bandwidth, rtt, state, stage, epoch, digest,
    n_addrs, when,
):  # fmt: skip
    info = node(
        peer_id=peer,
        device=device(
            name=name, memory_bytes=memory, flops=flops, op_overhead=overhead, cpu_cores=cores
        ),
        addrs=tuple(f"/ip4/10.0.0.{i}/tcp/1" for i in range(n_addrs)),
        links=(LinkReport(peer=peer, bandwidth=bandwidth, rtt=rtt, age=0.5),) * 2,
        state=state,
        stage=stage,
        adopted=(epoch, digest),
        time=when,
    )
    assert NodeInfo.from_wire(through_msgpack(info.to_wire())) == info


@given(
    epoch=st.integers(0, 1 << 62),
    estimate=st.floats(1e-9, 1e9),
    plan=st.binary(min_size=1, max_size=256),
    proposer=_printable,
)
def test_plan_proposal_round_trip_property(epoch, estimate, plan, proposer):
    prop = proposal(epoch=epoch, estimate=estimate, plan=plan, proposer=proposer)
    assert PlanProposal.from_wire(through_msgpack(prop.to_wire())) == prop


# ----------------------------------------------------------------------------- rejections


def _with(wire: dict, **changes) -> dict:
    out = dict(wire)
    out.update(changes)
    return out


def _without(wire: dict, key: str) -> dict:
    out = dict(wire)
    del out[key]
    return out


@pytest.mark.parametrize("version", [0, 2, None, "1", True, 1.0, [1]])
def test_node_info_unknown_schema_version(version):
    with pytest.raises(RecordError, match="version"):
        NodeInfo.from_wire(_with(node().to_wire(), v=version))


def test_node_info_without_version():
    with pytest.raises(RecordError, match="no schema version"):
        NodeInfo.from_wire(_without(node().to_wire(), "v"))


@pytest.mark.parametrize("version", [0, 2, True, "1"])
def test_plan_proposal_unknown_schema_version(version):
    with pytest.raises(RecordError, match="version"):
        PlanProposal.from_wire(_with(proposal().to_wire(), v=version))


@pytest.mark.parametrize("wire", [None, 1, "node", b"node", [1, 2], (), 1.5])
def test_non_map_records(wire):
    with pytest.raises(RecordError):
        NodeInfo.from_wire(wire)
    with pytest.raises(RecordError):
        PlanProposal.from_wire(wire)
    with pytest.raises(RecordError):
        DeviceInfo.from_wire(wire)


@pytest.mark.parametrize(
    "key",
    [
        "id",
        "swarm",
        "addrs",
        "dht",
        "dev",
        "up",
        "down",
        "links",
        "sw",
        "cfg",
        "state",
        "stage",
        "plan",
        "t",
    ],
)
def test_node_info_missing_field(key):
    with pytest.raises(RecordError, match="missing fields"):
        NodeInfo.from_wire(_without(node().to_wire(), key))


@pytest.mark.parametrize("extra", ["extra", 1, b"id"])
def test_node_info_extra_field(extra):
    wire = node().to_wire()
    wire[extra] = 0
    with pytest.raises(RecordError, match="unexpected fields"):
        NodeInfo.from_wire(wire)


@pytest.mark.parametrize("key", ["swarm", "epoch", "by", "est", "plan"])
def test_plan_proposal_missing_field(key):
    with pytest.raises(RecordError, match="missing fields"):
        PlanProposal.from_wire(_without(proposal().to_wire(), key))


def test_plan_proposal_extra_field():
    with pytest.raises(RecordError, match="unexpected fields"):
        PlanProposal.from_wire(_with(proposal().to_wire(), sig=b"x"))


@pytest.mark.parametrize("key", ["name", "kind", "mem", "flops", "membw", "ovh", "cores", "ram"])
def test_device_missing_field(key):
    with pytest.raises(RecordError, match="missing fields"):
        DeviceInfo.from_wire(_without(device().to_wire(), key))
    wire = node().to_wire()
    wire["dev"] = _without(device().to_wire(), key)
    with pytest.raises(RecordError):
        NodeInfo.from_wire(wire)


_NAN, _INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("id", 5),
        ("id", ""),
        ("id", b"12D3KooWPeerA"),
        ("id", "x" * (MAX_PEER_ID_CHARS + 1)),
        ("id", "peer\nid"),
        ("id", "peer\x00id"),
        ("swarm", None),
        ("swarm", "s" * (MAX_NAME_CHARS + 1)),
        ("swarm", "bad\tname"),
        ("addrs", "/ip4/1.2.3.4/tcp/1"),
        ("addrs", ["/ip4/1.2.3.4/tcp/1"] * (MAX_ADDRS + 1)),
        ("addrs", ["a" * (MAX_ADDR_CHARS + 1)]),
        ("addrs", [""]),
        ("addrs", [7]),
        ("addrs", ["/ip4/1.2.3.4\x1b[2J"]),
        ("addrs", {"a": 1}),
        ("dht", ["/ip4/1.2.3.4/tcp/1"] * (MAX_ADDRS + 1)),
        ("dht", [None]),
        ("dev", None),
        ("dev", []),
        ("up", True),
        ("up", "12.5e6"),
        ("up", _NAN),
        ("up", _INF),
        ("up", -_INF),
        ("up", 0.0),
        ("up", -1.0),
        ("up", 1e16),
        ("up", None),
        ("down", False),
        ("down", _NAN),
        ("down", 0),
        ("links", None),
        ("links", "links"),
        ("links", [["p", 1e6, 0.01, 0.0]] * (MAX_LINKS + 1)),
        ("links", [["p", 1e6, 0.01]]),
        ("links", [["p", 1e6, 0.01, 0.0, 0.0]]),
        ("links", [{"peer": "p"}]),
        ("links", [["p", _NAN, 0.01, 0.0]]),
        ("links", [["p", 0.0, 0.01, 0.0]]),
        ("links", [["p", 1e6, -0.01, 0.0]]),
        ("links", [["p", 1e6, 601.0, 0.0]]),
        ("links", [["p", 1e6, 0.01, -1.0]]),
        ("links", [["p", 1e6, 0.01, _INF]]),
        ("links", [["p", True, 0.01, 0.0]]),
        ("links", [["", 1e6, 0.01, 0.0]]),
        ("links", [[3, 1e6, 0.01, 0.0]]),
        ("links", [["p", "1e6", 0.01, 0.0]]),
        ("sw", ""),
        ("sw", 1),
        ("cfg", "c" * 65),
        ("cfg", ""),
        ("cfg", None),
        ("state", "running"),
        ("state", "SERVING"),
        ("state", None),
        ("state", 2),
        ("state", ["serving"]),
        ("state", {"s": 1}),
        ("stage", True),
        ("stage", -1),
        ("stage", (1 << 16) + 1),
        ("stage", 1.0),
        ("stage", "1"),
        ("plan", [17]),
        ("plan", [17, DIGEST, 0]),
        ("plan", [17, DIGEST.upper()]),
        ("plan", [17, DIGEST[:-1]]),
        ("plan", [17, DIGEST + "0"]),
        ("plan", [17, "g" * 64]),
        ("plan", [17, b"ab" * 32]),
        ("plan", [-1, DIGEST]),
        ("plan", [True, DIGEST]),
        ("plan", [17.0, DIGEST]),
        ("plan", [(1 << 62) + 1, DIGEST]),
        ("plan", DIGEST),
        ("plan", {"epoch": 17}),
        ("t", _NAN),
        ("t", -1.0),
        ("t", 1e12),
        ("t", True),
        ("t", "now"),
    ],
)
def test_node_info_bad_field(key, value):
    with pytest.raises(RecordError):
        NodeInfo.from_wire(_with(node().to_wire(), **{key: value}))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("name", ""),
        ("name", "n" * (MAX_NAME_CHARS + 1)),
        ("name", "gpu\n"),
        ("name", None),
        ("kind", "k" * 17),
        ("kind", 0),
        ("mem", 0),
        ("mem", -(1 << 30)),
        ("mem", True),
        ("mem", 1.5e9),
        ("mem", "24GiB"),
        ("mem", (1 << 50) + 1),
        ("flops", 0.0),
        ("flops", -1e12),
        ("flops", _NAN),
        ("flops", _INF),
        ("flops", 1e19),
        ("flops", True),
        ("flops", "1e12"),
        ("membw", 0),
        ("membw", _NAN),
        ("membw", 2e15),
        ("ovh", -1e-6),
        ("ovh", 1.5),
        ("ovh", _NAN),
        ("ovh", False),
        ("cores", 0),
        ("cores", True),
        ("cores", 4.0),
        ("cores", (1 << 16) + 1),
        ("ram", 0),
        ("ram", -1),
        ("ram", None),
    ],
)
def test_device_bad_field(key, value):
    with pytest.raises(RecordError):
        DeviceInfo.from_wire(_with(device().to_wire(), **{key: value}))
    wire = node().to_wire()
    wire["dev"] = _with(device().to_wire(), **{key: value})
    with pytest.raises(RecordError):
        NodeInfo.from_wire(wire)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("swarm", ""),
        ("swarm", 3),
        ("swarm", "s" * (MAX_NAME_CHARS + 1)),
        ("epoch", -1),
        ("epoch", True),
        ("epoch", 1.0),
        ("epoch", "12"),
        ("epoch", (1 << 62) + 1),
        ("by", ""),
        ("by", None),
        ("by", "p" * (MAX_PEER_ID_CHARS + 1)),
        ("by", "peer\u200b"),
        ("est", 0.0),
        ("est", -0.5),
        ("est", _NAN),
        ("est", _INF),
        ("est", 1e10),
        ("est", True),
        ("est", "0.75"),
        ("plan", b""),
        ("plan", b"x" * (MAX_PLAN_BYTES + 1)),
        ("plan", "{}"),
        ("plan", bytearray(b"{}")),
        ("plan", None),
        ("plan", [1, 2]),
    ],
)
def test_plan_proposal_bad_field(key, value):
    with pytest.raises(RecordError):
        PlanProposal.from_wire(_with(proposal().to_wire(), **{key: value}))


def test_limits_are_inclusive():
    info = node(
        addrs=("a" * MAX_ADDR_CHARS,) * MAX_ADDRS,
        links=(LinkReport(peer="p" * MAX_PEER_ID_CHARS, bandwidth=1.0, rtt=600.0, age=1e7),)
        * MAX_LINKS,
        swarm="s" * MAX_NAME_CHARS,
    )
    assert NodeInfo.from_wire(through_msgpack(info.to_wire())) == info
    big = proposal(plan=b"x" * MAX_PLAN_BYTES)
    assert PlanProposal.from_wire(big.to_wire()).plan == big.plan


def test_int_values_accepted_where_floats_are_expected():
    wire = _with(node().to_wire(), up=1000, down=2000, t=5)
    back = NodeInfo.from_wire(wire)
    assert (back.uplink, back.downlink, back.time) == (1000.0, 2000.0, 5.0)
    assert all(isinstance(x, float) for x in (back.uplink, back.downlink, back.time))


def test_huge_int_where_float_expected_is_a_record_error():
    with pytest.raises(RecordError):
        NodeInfo.from_wire(_with(node().to_wire(), up=10**400))


# ----------------------------------------------------------------------------- constructors


@pytest.mark.parametrize(
    "changes",
    [
        {"memory_bytes": 0},
        {"memory_bytes": -5},
        {"memory_bytes": True},
        {"flops": math.nan},
        {"flops": 0.0},
        {"memory_bandwidth": math.inf},
        {"op_overhead": -1.0},
        {"cpu_cores": 0},
        {"ram_bytes": 1.5},
        {"name": ""},
        {"name": "a\nb"},
        {"kind": "x" * 17},
    ],
)
def test_device_constructor_rejects(changes):
    with pytest.raises(ConfigError):
        device(**changes)


@pytest.mark.parametrize(
    "changes",
    [
        {"peer_id": ""},
        {"swarm": "x" * (MAX_NAME_CHARS + 1)},
        {"addrs": ("a",) * (MAX_ADDRS + 1)},
        {"uplink": 0.0},
        {"downlink": math.nan},
        {"links": (LinkReport(peer="p", bandwidth=-1.0, rtt=0.0, age=0.0),)},
        {"links": (LinkReport(peer="p", bandwidth=1.0, rtt=0.0, age=0.0),) * (MAX_LINKS + 1)},
        {"state": "running"},
        {"stage": -1},
        {"adopted": (1, "nothex")},
        {"adopted": (-1, DIGEST)},
        {"config_digest": "c" * 65},
        {"time": -1.0},
    ],
)
def test_node_info_constructor_rejects(changes):
    with pytest.raises(ConfigError):
        node(**changes)


@pytest.mark.parametrize(
    "changes",
    [
        {"epoch": -1},
        {"estimate": 0.0},
        {"estimate": math.inf},
        {"plan": b""},
        {"plan": "text"},
        {"proposer": ""},
        {"swarm": ""},
    ],
)
def test_plan_proposal_constructor_rejects(changes):
    with pytest.raises(ConfigError):
        proposal(**changes)


def test_records_are_frozen():
    info = node()
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.stage = 3  # type: ignore[misc]
