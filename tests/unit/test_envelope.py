"""dht/envelope.py: a record opens only under the key of the peer it is stored for."""

import base58
import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fusionllm.dht import envelope as env_mod
from fusionllm.dht.envelope import (
    ENVELOPE_VERSION,
    MAX_ENVELOPE_BYTES,
    OpenedRecord,
    open_envelope,
    public_key_of,
    seal,
)
from fusionllm.dht.records import (
    MAX_ADDR_CHARS,
    MAX_ADDRS,
    MAX_PLAN_BYTES,
    NodeInfo,
    NodeState,
    PlanProposal,
    RecordError,
)
from tests.support.identities import Identity, cpu_device

KEY = "fusionllm/demo/nodes"
EXP = 1_700_000_030.0


@pytest.fixture(scope="module")
def alice(tmp_path_factory) -> Identity:
    return Identity(tmp_path_factory.mktemp("alice") / "key")


@pytest.fixture(scope="module")
def bob(tmp_path_factory) -> Identity:
    return Identity(tmp_path_factory.mktemp("bob") / "key")


def node_info(peer_id: str, **changes) -> NodeInfo:
    fields = {
        "peer_id": peer_id,
        "swarm": "demo",
        "addrs": (f"/ip4/10.0.0.1/tcp/4001/p2p/{peer_id}",),
        "dht_addrs": ("/ip4/10.0.0.1/tcp/4002",),
        "device": cpu_device(),
        "uplink": 1e7,
        "downlink": 1e8,
        "links": (),
        "software": "fusionllm 0.1.0",
        "config_digest": "0123456789abcdef",
        "state": NodeState.BACKUP,
        "stage": None,
        "adopted": None,
        "time": 1_700_000_000.0,
    }
    fields.update(changes)
    return NodeInfo(**fields)


def plan_proposal(peer_id: str, plan: bytes = b'{"plan":1}') -> PlanProposal:
    return PlanProposal(swarm="demo", epoch=5, proposer=peer_id, estimate=0.5, plan=plan)


def fields_of(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False)


def repack(fields: dict) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def sealed_node(who: Identity) -> bytes:
    return seal(node_info(who.peer_id), key=KEY, subkey=who.peer_id, expiration=EXP, sign=who.sign)


# ----------------------------------------------------------------------------- valid records


def test_node_record_round_trip(alice):
    info = node_info(alice.peer_id)
    opened = open_envelope(
        seal(info, key=KEY, subkey=alice.peer_id, expiration=EXP, sign=alice.sign)
    )
    assert opened == OpenedRecord("node", KEY, alice.peer_id, EXP, info)


def test_plan_record_round_trip(alice):
    prop = plan_proposal(alice.peer_id)
    key = "fusionllm/demo/plans/5"
    opened = open_envelope(
        seal(prop, key=key, subkey=alice.peer_id, expiration=EXP, sign=alice.sign)
    )
    assert opened.kind == "plan"
    assert opened.key == key
    assert opened.record == prop
    assert opened.record.digest == prop.digest


def test_envelope_accepts_bytearray_and_memoryview(alice):
    data = sealed_node(alice)
    assert open_envelope(bytearray(data)).record == open_envelope(memoryview(data)).record


def test_integer_expiration_seals_an_envelope_that_opens(alice):
    data = seal(node_info(alice.peer_id), key=KEY, subkey=alice.peer_id, expiration=1_700_000_030,
                sign=alice.sign)  # fmt: skip
    opened = open_envelope(data)
    assert opened.expiration == 1_700_000_030.0
    assert isinstance(opened.expiration, float)


def test_public_key_of_matches_identity(alice):
    raw = alice.key_pair.public_key.to_bytes()
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    assert public_key_of(alice.peer_id).public_bytes(Encoding.Raw, PublicFormat.Raw) == raw


# ----------------------------------------------------------------------------- forgeries


def test_record_signed_by_another_key(alice, bob):
    data = seal(
        node_info(alice.peer_id), key=KEY, subkey=alice.peer_id, expiration=EXP, sign=bob.sign
    )
    with pytest.raises(RecordError, match="signature"):
        open_envelope(data)


def test_peer_cannot_write_another_peers_record(alice, bob):
    # Bob stores Alice's (valid) record under his own subkey, signed by himself.
    data = seal(
        node_info(alice.peer_id), key=KEY, subkey=bob.peer_id, expiration=EXP, sign=bob.sign
    )
    with pytest.raises(RecordError, match="stored under"):
        open_envelope(data)


def test_peer_cannot_propose_in_another_peers_name(alice, bob):
    data = seal(plan_proposal(alice.peer_id), key="k", subkey=bob.peer_id, expiration=EXP,
                sign=bob.sign)  # fmt: skip
    with pytest.raises(RecordError, match="stored under"):
        open_envelope(data)


def test_signature_over_swapped_subkey_fails(alice, bob):
    fields = fields_of(sealed_node(alice))
    fields["sub"] = bob.peer_id
    with pytest.raises(RecordError):
        open_envelope(repack(fields))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("key", "fusionllm/other/nodes"),
        ("exp", EXP + 3600.0),
        ("kind", "plan"),
    ],
)
def test_tampered_signed_fields(alice, field, value):
    fields = fields_of(sealed_node(alice))
    fields[field] = value
    with pytest.raises(RecordError):
        open_envelope(repack(fields))


def test_tampered_body(alice):
    fields = fields_of(sealed_node(alice))
    body = msgpack.unpackb(fields["body"], raw=False)
    body["up"] = 1e12  # a better uplink than the peer signed
    fields["body"] = msgpack.packb(body, use_bin_type=True)
    with pytest.raises(RecordError, match="signature"):
        open_envelope(repack(fields))


@pytest.mark.parametrize("position", [0, 10, 31, 32, 63])
def test_flipped_signature_bit(alice, position):
    fields = fields_of(sealed_node(alice))
    sig = bytearray(fields["sig"])
    sig[position] ^= 0x01
    fields["sig"] = bytes(sig)
    with pytest.raises(RecordError):
        open_envelope(repack(fields))


def test_every_flipped_byte_is_refused(alice):
    data = sealed_node(alice)
    for i in range(0, len(data), 7):
        broken = bytearray(data)
        broken[i] ^= 0x20
        try:
            opened = open_envelope(bytes(broken))
        except RecordError:
            continue
        # msgpack can re-encode some header bytes harmlessly; whatever opens is the original.
        assert opened.record == node_info(alice.peer_id)


@pytest.mark.parametrize("sig", [b"", b"\x00" * 63, b"\x00" * 65, "x" * 64, None])
def test_malformed_signature(alice, sig):
    fields = fields_of(sealed_node(alice))
    fields["sig"] = sig
    with pytest.raises(RecordError):
        open_envelope(repack(fields))


def test_bad_schema_body_correctly_signed(alice):
    body = node_info(alice.peer_id).to_wire()
    body["state"] = "running"
    data = _sign_raw(alice, "node", msgpack.packb(body, use_bin_type=True))
    with pytest.raises(RecordError, match="node state"):
        open_envelope(data)


def test_future_schema_version_body_correctly_signed(alice):
    body = node_info(alice.peer_id).to_wire()
    body["v"] = 2
    data = _sign_raw(alice, "node", msgpack.packb(body, use_bin_type=True))
    with pytest.raises(RecordError, match="version"):
        open_envelope(data)


@pytest.mark.parametrize(
    "body",
    [b"", b"\xc1", b"\x92\x01", msgpack.packb({1: 2}), msgpack.packb([1, 2]), b"\x81\xa1"],
)
def test_body_not_a_record_correctly_signed(alice, body):
    with pytest.raises(RecordError):
        open_envelope(_sign_raw(alice, "node", body))


def test_plan_body_under_node_kind(alice):
    body = msgpack.packb(plan_proposal(alice.peer_id).to_wire(), use_bin_type=True)
    with pytest.raises(RecordError):
        open_envelope(_sign_raw(alice, "node", body))


def _sign_raw(who: Identity, kind: str, body: bytes, *, version=ENVELOPE_VERSION) -> bytes:
    signed = env_mod._signed_bytes(kind, KEY, who.peer_id, EXP, body)
    return repack({"v": version, "kind": kind, "key": KEY, "sub": who.peer_id, "exp": EXP,
                   "body": body, "sig": who.sign(signed)})  # fmt: skip


# ----------------------------------------------------------------------------- envelope shape


@pytest.mark.parametrize("version", [0, 2, None, "1", True, 1.0])
def test_unknown_envelope_version(alice, version):
    fields = fields_of(sealed_node(alice))
    fields["v"] = version
    with pytest.raises(RecordError, match="version"):
        open_envelope(repack(fields))


@pytest.mark.parametrize("kind", ["tx", "", None, 1, {}, b"node"])
def test_unknown_kind(alice, kind):
    fields = fields_of(sealed_node(alice))
    fields["kind"] = kind
    with pytest.raises(RecordError):
        open_envelope(repack(fields))


def test_missing_and_extra_envelope_fields(alice):
    fields = fields_of(sealed_node(alice))
    for key in list(fields):
        partial = dict(fields)
        del partial[key]
        with pytest.raises(RecordError, match="wrong fields"):
            open_envelope(repack(partial))
    with pytest.raises(RecordError, match="wrong fields"):
        open_envelope(repack({**fields, "extra": 1}))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("key", 1),
        ("key", b"fusionllm/demo/nodes"),
        ("sub", None),
        ("exp", 1_700_000_030),
        ("exp", float("nan")),
        ("exp", float("inf")),
        ("exp", "soon"),
        ("body", "text"),
        ("body", None),
    ],
)
def test_wrong_field_types(alice, field, value):
    fields = fields_of(sealed_node(alice))
    fields[field] = value
    with pytest.raises(RecordError):
        open_envelope(repack(fields))


@pytest.mark.parametrize(
    "subkey",
    [
        "",
        "x" * 129,
        "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",  # an RSA-style (sha256) id
        "12D3KooW0OIl",  # 0, O, I, l are not base58
        "12D3KooWé",
        base58.b58encode(b"\x00\x24\x08\x02\x12\x20" + b"\x01" * 32).decode(),  # secp256k1 type
        base58.b58encode(b"\x00\x24\x08\x01\x12\x20" + b"\x01" * 31).decode(),  # short key
        base58.b58encode(b"\x00\x24\x08\x01\x12\x20" + b"\x01" * 33).decode(),  # long key
    ],
)
def test_not_an_ed25519_peer_id(alice, subkey):
    with pytest.raises(RecordError):
        public_key_of(subkey)
    fields = fields_of(sealed_node(alice))
    fields["sub"] = subkey
    with pytest.raises(RecordError):
        open_envelope(repack(fields))


@pytest.mark.parametrize("peer_id", [None, 5, b"12D3KooW"])
def test_public_key_of_non_string(peer_id):
    with pytest.raises(RecordError):
        public_key_of(peer_id)


def test_oversize_envelopes(alice):
    with pytest.raises(RecordError, match="over the limit"):
        open_envelope(b"\x00" * (max(MAX_ENVELOPE_BYTES.values()) + 1))
    # A node-kind envelope padded past the node limit (but under the plan limit).
    fields = fields_of(sealed_node(alice))
    fields["body"] = b"\x00" * MAX_ENVELOPE_BYTES["node"]
    with pytest.raises(RecordError, match="over the limit"):
        open_envelope(repack(fields))


def test_seal_refuses_oversize_record(alice):
    # Lengths are checked in characters: 4-byte characters make a valid record too big to store.
    wide = "\U0001d538" * MAX_ADDR_CHARS
    info = node_info(alice.peer_id, addrs=(wide,) * MAX_ADDRS, dht_addrs=(wide,) * MAX_ADDRS)
    with pytest.raises(RecordError, match="over"):
        seal(info, key=KEY, subkey=alice.peer_id, expiration=EXP, sign=alice.sign)


def test_largest_plan_opens(alice):
    prop = plan_proposal(alice.peer_id, plan=b"p" * (MAX_PLAN_BYTES - 64))
    data = seal(prop, key="k", subkey=alice.peer_id, expiration=EXP, sign=alice.sign)
    assert open_envelope(data).record == prop


@pytest.mark.parametrize("data", [None, "text", 5, [b"x"], {"v": 1}])
def test_non_bytes(data):
    with pytest.raises(RecordError):
        open_envelope(data)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        msgpack.packb([]),
        msgpack.packb([1]),
        msgpack.packb(None),
        msgpack.packb({1: 2}),
        msgpack.packb({"v": 1}),
        msgpack.packb({str(i): i for i in range(9)}),
        msgpack.packb("s" * 300),
        msgpack.ExtType(1, b"x").data,
        msgpack.packb(msgpack.ExtType(1, b"x")),
    ],
)
def test_junk_envelopes(data):
    with pytest.raises(RecordError):
        open_envelope(data)


def test_trailing_bytes_after_envelope(alice):
    with pytest.raises(RecordError):
        open_envelope(sealed_node(alice) + b"\x00")


@given(data=st.binary(max_size=512))
def test_arbitrary_bytes_only_ever_raise_record_error(data):
    with pytest.raises(RecordError):
        open_envelope(data)


_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=70),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=12,
)


@given(
    fields=st.fixed_dictionaries(
        {k: _msgpack_values for k in ("v", "kind", "key", "sub", "exp", "body", "sig")}
    )
)
def test_arbitrary_envelope_maps_only_ever_raise_record_error(fields):
    with pytest.raises(RecordError):
        open_envelope(repack(fields))


@given(body=_msgpack_values, kind=st.sampled_from(["node", "plan"]))
def test_arbitrary_signed_bodies_only_ever_raise_record_error(alice, body, kind):
    with pytest.raises(RecordError):
        open_envelope(_sign_raw(alice, kind, msgpack.packb(body, use_bin_type=True)))
