"""Signed records: a record is valid only under the key of the peer id it is stored for.

Our peer ids are libp2p Ed25519 ids, which embed the public key (an identity multihash), so a
verifier needs nothing but the subkey to check the signature: a peer can write only its own
subkey, and the same key signs on the DHT and owns the data-plane identity (one peer id
everywhere). This module needs neither libp2p nor hivemind (their protobuf modules cannot
share a process): it parses the id by hand and verifies with ``cryptography``.

    envelope = msgpack {"v": 1, "kind", "key", "sub", "exp", "body": bin, "sig": bin
                        [, "mac": bin]}
    signed   = DOMAIN + msgpack([kind, key, sub, exp, body])

``mac`` is a private swarm's tag over the signed bytes (common/swarm_key.py): a node that
holds the swarm's secret adds it, and the directory of such a node refuses records without
a valid one. An open swarm's envelopes have none.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import base58
import msgpack
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fusionllm.common.errors import peer_repr
from fusionllm.dht.records import NodeInfo, PlanProposal, RecordError

ENVELOPE_VERSION = 1
_DOMAIN = b"fusionllm/record/v1\x00"
# identity multihash (0x00, 36 bytes) of a libp2p PublicKey protobuf {Type: Ed25519, Data: 32}
_ED25519_ID_PREFIX = b"\x00\x24\x08\x01\x12\x20"
MAX_ENVELOPE_BYTES = {"node": 16 << 10, "plan": 600 << 10}
_MAX_KEY_CHARS = 256

Signer = Callable[[bytes], bytes]
Tagger = Callable[[bytes], bytes]  # a private swarm's MAC over the signed bytes
_FIELDS = frozenset({"v", "kind", "key", "sub", "exp", "body", "sig"})
_MAC_BYTES = 32


@dataclass(frozen=True)
class OpenedRecord:
    kind: str
    key: str
    subkey: str
    expiration: float
    record: NodeInfo | PlanProposal
    # What the signature (and a mac) cover, and a private swarm's tag, unchecked here (the
    # key is the reader's): not part of what the record says, so not of its equality.
    signed: bytes = field(default=b"", compare=False, repr=False)
    mac: bytes | None = field(default=None, compare=False, repr=False)


def public_key_of(peer_id: str) -> Ed25519PublicKey:
    """The Ed25519 key inside a libp2p peer id; RecordError for any other kind of id."""
    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= 128:
        raise RecordError("peer id must be a short string")
    try:
        raw = base58.b58decode(peer_id)
    except ValueError as exc:
        raise RecordError(f"peer id {peer_id[:60]!r} is not base58") from exc
    if len(raw) != len(_ED25519_ID_PREFIX) + 32 or not raw.startswith(_ED25519_ID_PREFIX):
        raise RecordError(f"peer id {peer_id[:60]!r} is not an Ed25519 libp2p id")
    return Ed25519PublicKey.from_public_bytes(raw[len(_ED25519_ID_PREFIX) :])


def _signed_bytes(kind: str, key: str, subkey: str, expiration: float, body: bytes) -> bytes:
    return _DOMAIN + msgpack.packb([kind, key, subkey, expiration, body], use_bin_type=True)


def seal(
    record: NodeInfo | PlanProposal,
    *,
    key: str,
    subkey: str,
    expiration: float,
    sign: Signer,
    tag: Tagger | None = None,
) -> bytes:
    """The envelope bytes to store for ``record``; ``sign`` signs with ``subkey``'s key,
    ``tag`` (a private swarm's) adds a mac over the same bytes."""
    kind = "node" if isinstance(record, NodeInfo) else "plan"
    expiration = float(expiration)  # signed as stored: an int would pack differently
    body = msgpack.packb(record.to_wire(), use_bin_type=True)
    signed = _signed_bytes(kind, key, subkey, expiration, body)
    signature = sign(signed)
    envelope = {
        "v": ENVELOPE_VERSION,
        "kind": kind,
        "key": key,
        "sub": subkey,
        "exp": expiration,
        "body": body,
        "sig": signature,
    }
    if tag is not None:
        envelope["mac"] = tag(signed)
    data = msgpack.packb(envelope, use_bin_type=True)
    if len(data) > MAX_ENVELOPE_BYTES[kind]:
        raise RecordError(f"{kind} record is {len(data)} bytes, over {MAX_ENVELOPE_BYTES[kind]}")
    return data


def open_envelope(data: Any) -> OpenedRecord:
    """Verify and parse an envelope from a peer. RecordError for anything wrong with it."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RecordError(f"a record must be bytes, got {type(data).__name__}")
    if len(data) > max(MAX_ENVELOPE_BYTES.values()):
        raise RecordError(f"record of {len(data)} bytes is over the limit")
    try:
        envelope = msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=True,
            max_str_len=_MAX_KEY_CHARS,
            max_bin_len=max(MAX_ENVELOPE_BYTES.values()),
            max_array_len=0,
            max_map_len=8,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises assorted ValueError/TypeError subclasses
        raise RecordError(f"record is not a valid envelope: {exc}") from exc
    if not isinstance(envelope, dict) or set(envelope) - {"mac"} != _FIELDS:
        raise RecordError("record envelope has the wrong fields")
    mac = envelope.get("mac")
    if "mac" in envelope and (not isinstance(mac, bytes) or len(mac) != _MAC_BYTES):
        raise RecordError("record mac malformed")
    if type(envelope["v"]) is not int or envelope["v"] != ENVELOPE_VERSION:
        raise RecordError(f"record envelope version {peer_repr(envelope['v'])} is not supported")
    kind, key, subkey, expiration = (envelope[k] for k in ("kind", "key", "sub", "exp"))
    body, signature = envelope["body"], envelope["sig"]
    if not isinstance(kind, str) or kind not in MAX_ENVELOPE_BYTES:
        raise RecordError(f"unknown record kind {peer_repr(kind)}")
    if len(data) > MAX_ENVELOPE_BYTES[kind]:
        raise RecordError(f"{kind} record of {len(data)} bytes is over the limit")
    if not isinstance(key, str) or not isinstance(subkey, str):
        raise RecordError("record key and subkey must be strings")
    if not isinstance(expiration, float) or not math.isfinite(expiration):
        raise RecordError("record expiration must be a finite float")
    if not isinstance(body, bytes) or not isinstance(signature, bytes) or len(signature) != 64:
        raise RecordError("record body/signature malformed")
    signed = _signed_bytes(kind, key, subkey, expiration, body)
    try:
        public_key_of(subkey).verify(signature, signed)
    except InvalidSignature:
        raise RecordError(f"record signature does not match its subkey {subkey[:16]}...") from None
    record = _parse_body(kind, body)
    owner = record.peer_id if isinstance(record, NodeInfo) else record.proposer
    if owner != subkey:
        raise RecordError(f"record is about {owner[:16]}... but stored under {subkey[:16]}...")
    return OpenedRecord(kind, key, subkey, expiration, record, signed, mac)


def _parse_body(kind: str, body: bytes) -> NodeInfo | PlanProposal:
    try:
        wire = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_str_len=1024,
            max_bin_len=MAX_ENVELOPE_BYTES[kind],
            max_array_len=256,
            max_map_len=32,
            max_ext_len=0,
        )
    except Exception as exc:
        raise RecordError(f"{kind} record body is not msgpack: {exc}") from exc
    if kind == "node":
        return NodeInfo.from_wire(wire)
    return PlanProposal.from_wire(wire)
