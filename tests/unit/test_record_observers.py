"""dht/records.py: a record's observer flag and its suspicions, old records without them."""

import msgpack
import pytest

from fusionllm.common.errors import ConfigError
from fusionllm.dht.records import (
    MAX_PEER_ID_CHARS,
    MAX_REASON_CHARS,
    MAX_STRIKES,
    MAX_SUSPECTS,
    NodeInfo,
    RecordError,
    Suspicion,
)
from tests.unit.test_records import node


def _through_msgpack(wire):
    return msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False)


def test_an_observer_and_its_suspicions_round_trip():
    info = node(observer=True, suspects=(Suspicion("12D3KooWPeerB", 1.7e9 + 15, "barrier", 2),))
    back = NodeInfo.from_wire(_through_msgpack(info.to_wire()))
    assert back == info
    assert back.observer is True
    assert back.suspects[0].until == 1.7e9 + 15


def test_a_record_without_the_new_fields_reads_as_a_plannable_member():
    wire = node().to_wire()
    assert "obs" not in wire
    assert "sus" not in wire
    back = NodeInfo.from_wire(wire)
    assert back.observer is False
    assert back.suspects == ()


def test_a_trainer_writes_no_observer_field():
    # Older readers refuse unknown fields: only observers (whom they must not plan) and
    # nodes that suspect someone write the new ones.
    assert set(node(observer=False).to_wire()) == set(node().to_wire())


@pytest.mark.parametrize("value", [1, 0, "yes", None, [True]])
def test_observer_must_be_a_bool(value):
    wire = {**node().to_wire(), "obs": value}
    with pytest.raises(RecordError, match="observer must be a bool"):
        NodeInfo.from_wire(wire)


_GOOD = ["12D3KooWPeerB", 1.7e9, "barrier", 1]


@pytest.mark.parametrize(
    ("index", "value", "match"),
    [
        (0, "", "suspect must have"),
        (0, "p" * (MAX_PEER_ID_CHARS + 1), "suspect must have"),
        (0, 7, "suspect must be a string"),
        (1, float("nan"), "suspected until must be a finite"),
        (1, -1.0, "suspected until must be a finite"),
        (1, "soon", "suspected until must be a number"),
        (2, "r" * (MAX_REASON_CHARS + 1), "suspicion reason must have"),
        (2, "bad\nline", "non-printable"),
        (3, 0, "strikes must be in"),
        (3, MAX_STRIKES + 1, "strikes must be in"),
        (3, True, "strikes must be an integer"),
    ],
)
def test_a_malformed_suspicion_is_refused(index, value, match):
    item = list(_GOOD)
    item[index] = value
    with pytest.raises(RecordError, match=match):
        NodeInfo.from_wire({**node().to_wire(), "sus": [item]})


@pytest.mark.parametrize(
    ("sus", "match"),
    [
        ([_GOOD[:3]], "suspicion must have 4 fields"),
        ([_GOOD] * (MAX_SUSPECTS + 1), "suspects has"),
        ("12D3KooWPeerB", "suspects must be a list"),
    ],
)
def test_a_malformed_suspect_list_is_refused(sus, match):
    with pytest.raises(RecordError, match=match):
        NodeInfo.from_wire({**node().to_wire(), "sus": sus})


def test_the_constructor_refuses_too_many_suspicions():
    many = tuple(Suspicion(f"peer{i}", 1.0, "barrier", 1) for i in range(MAX_SUSPECTS + 1))
    with pytest.raises(ConfigError, match="suspects has"):
        node(suspects=many)
