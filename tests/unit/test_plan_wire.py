"""dag/plan_wire.py: a Plan as canonical JSON and back; junk from a peer is a PlanWireError."""

import copy
import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fusionllm.common.errors import ConfigError
from fusionllm.dag.cost import DeviceProfile
from fusionllm.dag.plan_wire import MAX_PLAN_JSON_BYTES, PlanWireError, plan_from_json, plan_to_json
from fusionllm.dag.planner import Plan, PlanConfig, plan
from fusionllm.dag.swarm import Peer, Swarm
from fusionllm.dag.synthetic import gpt2_costs

DEVICE = DeviceProfile(name="gpu", flops=1e12, memory_bandwidth=1e11, memory_bytes=8 << 30)


def make_plan(n_peers: int, **config) -> Plan:
    peers = [
        Peer(peer_id=f"peer{i}", device=DEVICE, uplink=1e9, downlink=1e9) for i in range(n_peers)
    ]
    settings = {"micro_batches": 4, "batch_size": 8, **config}
    return plan(
        gpt2_costs("small", batch=1, seq=128), Swarm.from_links(peers), PlanConfig(**settings)
    )


@pytest.fixture(scope="module")
def plans() -> list[Plan]:
    return [make_plan(4), make_plan(8, max_stages=2), make_plan(1)]


@pytest.fixture(scope="module")
def real_plan(plans) -> Plan:
    return plans[0]


def wire_of(p: Plan) -> dict:
    return json.loads(plan_to_json(p))


def encode(wire) -> bytes:
    return json.dumps(wire).encode()


def test_plan_wire_error_is_a_config_error():
    assert issubclass(PlanWireError, ConfigError)


def test_round_trip_and_digest(plans):
    for p in plans:
        data = plan_to_json(p)
        assert hashlib.sha256(data).hexdigest() == p.digest()
        back = plan_from_json(data)
        assert isinstance(back, Plan)
        assert back.digest() == p.digest()
        assert plan_to_json(back) == data
        assert [s.peers for s in back.stages] == [s.peers for s in p.stages]
        assert back.backup == p.backup
        assert isinstance(back.stages[0].node_ids, tuple)
        assert isinstance(back.fences[0], tuple)


def test_plans_exercise_replicas_and_links(plans):
    # The fixtures cover a pipeline, data-parallel replicas and a single-stage plan.
    assert len(plans[0].stages) >= 2
    assert plans[0].links
    assert max(len(s.peers) for s in plans[1].stages) >= 2
    assert len(plans[2].stages) >= 1


def test_canonical_bytes_are_compact_and_sorted(real_plan):
    data = plan_to_json(real_plan)
    assert b" " not in data
    wire = json.loads(data)
    assert data == json.dumps(wire, sort_keys=True, separators=(",", ":")).encode()


def test_infinity_survives_as_text(real_plan):
    wire = wire_of(real_plan)
    wire["links"][0]["forward_bandwidth"] = "inf"
    back = plan_from_json(encode(wire))
    assert back.links[0].forward_bandwidth == float("inf")
    assert json.loads(plan_to_json(back))["links"][0]["forward_bandwidth"] == "inf"


def test_ints_accepted_as_floats(real_plan):
    wire = wire_of(real_plan)
    wire["estimated_step_time"] = 2
    back = plan_from_json(encode(wire))
    assert back.estimated_step_time == 2.0
    assert isinstance(back.estimated_step_time, float)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"not json",
        b"{",
        b"[]",
        b"null",
        b"1",
        b'"plan"',
        b"\xff\xfe",
        b"[" * 100_000,
        b'{"method": NaN}',
    ],
)
def test_junk_bytes(data):
    with pytest.raises(PlanWireError):
        plan_from_json(data)


@pytest.mark.parametrize("data", [None, "{}", bytearray(b"{}"), memoryview(b"{}"), 5])
def test_non_bytes(data):
    with pytest.raises(PlanWireError):
        plan_from_json(data)


def test_oversize(real_plan):
    data = plan_to_json(real_plan)
    padded = data[:-1] + b" " * (MAX_PLAN_JSON_BYTES - len(data)) + b"}"
    assert len(padded) == MAX_PLAN_JSON_BYTES
    assert plan_from_json(padded).digest() == real_plan.digest()
    with pytest.raises(PlanWireError, match="at most"):
        plan_from_json(padded + b" ")


def _edit(wire: dict, path: tuple, value) -> dict:
    wire = copy.deepcopy(wire)
    target = wire
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return wire


def _drop(wire: dict, path: tuple) -> dict:
    wire = copy.deepcopy(wire)
    target = wire
    for step in path[:-1]:
        target = target[step]
    del target[path[-1]]
    return wire


@pytest.mark.parametrize(
    "path",
    [("method",), ("backup",), ("stages",), ("links",), ("micro_batches",),
     ("stages", 0, "peers"), ("stages", 1, "shares"), ("links", 0, "dst_peer")],
)  # fmt: skip
def test_missing_field(real_plan, path):
    with pytest.raises(PlanWireError, match="missing"):
        plan_from_json(encode(_drop(wire_of(real_plan), path)))


@pytest.mark.parametrize("path", [("extra",), ("stages", 0, "extra"), ("links", 0, "signature")])
def test_extra_field(real_plan, path):
    with pytest.raises(PlanWireError, match="unexpected"):
        plan_from_json(encode(_edit(wire_of(real_plan), path, 1)))


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("micro_batches",), True),
        (("micro_batches",), 4.0),
        (("micro_batches",), "4"),
        (("micro_batches",), None),
        (("micro_batches",), 1 << 63),
        (("micro_batches",), [4]),
        (("estimated_step_time",), True),
        (("estimated_step_time",), "0.5"),
        (("estimated_step_time",), "nan"),
        (("estimated_step_time",), "-inf"),
        (("estimated_step_time",), None),
        (("bubble_fraction",), [0.1]),
        (("method",), 1),
        (("method",), "m" * 257),
        (("method",), None),
        (("backup",), "p2"),
        (("backup",), [1]),
        (("backup",), ["p"] * 4097),
        (("backup",), {"p2": 1}),
        (("fences",), [["p0"], "p1"]),
        (("fences",), [[1]]),
        (("stages",), {}),
        (("stages",), [1]),
        (("stages",), ["stage"]),
        (("stages", 0, "index"), False),
        (("stages", 0, "index"), 0.0),
        (("stages", 0, "peers"), "p1"),
        (("stages", 0, "peers"), [None]),
        (("stages", 0, "shares"), [True]),
        (("stages", 0, "shares"), ["1.0"]),
        (("stages", 0, "shares"), 1.0),
        (("stages", 0, "memory_bytes"), [1.5]),
        (("stages", 0, "memory_bytes"), [True]),
        (("stages", 0, "node_ids"), [0]),
        (("stages", 0, "forward_time"), "fast"),
        (("links",), [None]),
        (("links", 0, "src_stage"), True),
        (("links", 0, "dense_bytes"), "786432"),
        (("links", 0, "forward_codec"), 0),
        (("links", 0, "forward_ratio"), None),
        (("links", 0, "backward_rtt"), False),
    ],
)
def test_wrong_types(real_plan, path, value):
    with pytest.raises(PlanWireError):
        plan_from_json(encode(_edit(wire_of(real_plan), path, value)))


def test_huge_integers(real_plan):
    for path in [("estimated_step_time",), ("micro_batches",), ("stages", 0, "shares")]:
        huge = [10**400] if path[-1] == "shares" else 10**400
        with pytest.raises(PlanWireError, match=r"out of range|must be an integer"):
            plan_from_json(encode(_edit(wire_of(real_plan), path, huge)))


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_json_numbers(real_plan, token):
    # Python's json reads NaN/Infinity tokens as floats; the wire refuses them.
    for path in [("bubble_fraction",), ("estimated_step_time",)]:
        data = encode(_edit(wire_of(real_plan), path, "@")).replace(b'"@"', token.encode())
        with pytest.raises(PlanWireError, match="finite"):
            plan_from_json(data)
    data = encode(_edit(wire_of(real_plan), ("stages", 0, "shares"), ["@"]))
    with pytest.raises(PlanWireError, match="finite"):
        plan_from_json(data.replace(b'"@"', token.encode()))


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@given(data=st.binary(max_size=200))
def test_arbitrary_bytes_only_raise_plan_wire_error(data):
    with pytest.raises(PlanWireError):
        plan_from_json(data)


@given(value=_json, field=st.sampled_from(
    ["method", "fences", "stages", "links", "backup", "micro_batches", "estimated_step_time"]
))  # fmt: skip
def test_arbitrary_field_values_only_raise_plan_wire_error(real_plan, value, field):
    wire = wire_of(real_plan)
    wire[field] = value
    try:
        back = plan_from_json(json.dumps(wire).encode())
    except PlanWireError:
        return
    assert isinstance(back, Plan)  # a well-typed value is accepted as is
