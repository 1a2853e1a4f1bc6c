"""A private swarm's DHT values, sealed (dht/cipher.py): only the swarm's key opens them, a
stranger's bytes say nothing of the record, and a member refuses what is not sealed with its
key, whatever type or size a peer sends."""

import msgpack
import pytest

from fusionllm.common.swarm_key import RecordTags, SwarmKey
from fusionllm.dht.cipher import (
    MAGIC,
    MAX_SEALED_BYTES,
    OVERHEAD,
    RecordCipher,
    UnsealedRecordError,
)
from fusionllm.dht.directory import SwarmDirectory
from fusionllm.dht.envelope import open_envelope, seal
from fusionllm.dht.keys import nodes_key
from fusionllm.dht.records import RecordError
from tests.support.identities import Identity
from tests.unit.test_envelope import node_info
from tests.unit.test_swarm_key import OTHER, SECRET, FakeDht

ours = RecordCipher(SwarmKey(SECRET).records)


@pytest.fixture(scope="module")
def member(tmp_path_factory):
    return Identity(tmp_path_factory.mktemp("member") / "key")


def _envelope(who) -> bytes:
    return seal(node_info(who.peer_id), key=nodes_key("demo"), subkey=who.peer_id,
                expiration=2e9, sign=who.sign, tag=SwarmKey(SECRET).tag)  # fmt: skip


def test_a_sealed_value_opens_under_the_same_key_only(member):
    envelope = _envelope(member)
    value = ours.seal(envelope)
    assert len(value) == len(envelope) + OVERHEAD
    assert ours.open(value) == envelope
    assert RecordCipher(SwarmKey(SECRET).records).open(value) == envelope  # deterministic key
    with pytest.raises(UnsealedRecordError, match=r"does not open under this swarm's key"):
        RecordCipher(SwarmKey(OTHER).records).open(value)
    assert ours.seal(envelope) != value  # a fresh nonce each time


def test_a_stranger_learns_nothing_of_the_record_from_its_bytes(member):
    info = node_info(member.peer_id)
    value = ours.seal(_envelope(member))
    with pytest.raises(RecordError):
        open_envelope(value)
    with pytest.raises(msgpack.ExtraData):  # the magic reads as one small int, then junk
        msgpack.unpackb(value)
    for clear in (b"demo", member.peer_id.encode(), info.addrs[0].encode(), b"peer_id"):
        assert clear not in value


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (None, r"must be bytes, got NoneType"),
        ("FLc1" + "x" * 40, r"must be bytes, got str"),
        (b"", r"not sealed"),
        (b"\x87\xa1v\x01", r"not sealed"),  # an open swarm's envelope starts as a msgpack map
        (MAGIC + bytes(OVERHEAD - len(MAGIC) - 1), r"out of bounds"),
        (MAGIC + bytes(MAX_SEALED_BYTES), r"out of bounds"),
        (MAGIC + bytes(64), r"does not open"),
    ],
)
def test_a_member_refuses_what_is_not_sealed_with_a_typed_error(value, match):
    with pytest.raises(UnsealedRecordError, match=match):
        ours.open(value)
    assert issubclass(UnsealedRecordError, RecordError)  # skipped and counted by readers


def test_every_altered_byte_is_refused(member):
    value = ours.seal(_envelope(member))
    for at in (len(MAGIC), len(MAGIC) + 12, len(value) // 2, len(value) - 1):
        altered = value[:at] + bytes([value[at] ^ 1]) + value[at + 1 :]
        with pytest.raises(UnsealedRecordError, match=r"does not open"):
            ours.open(altered)


def test_the_cipher_key_is_derived_apart_from_the_tag_key():
    tags = SwarmKey(SECRET).records
    assert tags.cipher_key != bytes.fromhex(tags.key_hex)
    assert len(tags.cipher_key) == 32
    # The DHT worker gets the records key only, and derives the same cipher key from it.
    assert RecordTags.from_hex(tags.key_hex).cipher_key == tags.cipher_key
    assert repr(ours) == "RecordCipher(...)"


def test_a_keyed_directory_stores_sealed_values_and_counts_unsealed_ones(member):
    dht = FakeDht()
    keyed = SwarmDirectory(dht, swarm="demo", peer_id=member.peer_id, sign=member.sign,
                           auth=SwarmKey(SECRET))  # fmt: skip
    assert keyed.announce(node_info(member.peer_id), ttl_s=30)
    [(subkey, value, _)] = dht.get(nodes_key("demo"))
    assert subkey == member.peer_id
    assert value.startswith(MAGIC)
    assert list(keyed.members()) == [member.peer_id]
    # The same record stored in the clear (a member's leaked envelope, replayed): refused.
    dht.store(nodes_key("demo"), member.peer_id, ours.open(value), 2e9)
    assert keyed.members() == {}
    assert keyed.skipped == 1
