"""A private swarm's DHT values, encrypted: a stranger who reads them learns only that they exist.

hivemind's DHT has no private network, so anyone who joins its routing can get any key. In a
private swarm every value a member stores (a signed envelope, envelope.py) is sealed, and a
member opens it before anything else reads it:

    value = MAGIC (4) + nonce (12) + AES-256-GCM(envelope, aad=MAGIC) (envelope + 16)

The key is derived from the swarm key's records key with HKDF and its own purpose label
(``RecordTags.cipher_key``, common/swarm_key.py), so the DHT worker, which holds only the
records key, opens what it validates. What a stranger still sees: the keys (named after the
swarm), the subkeys (members' peer ids, which the DHT's routing shows anyway), each value's
size and expiration. What it cannot do: read a record or proposal, or store one a member
counts (the worker's validator and the reader refuse an unsealed value or one sealed under
another key: ``UnsealedRecordError``).

The associated data binds no key or subkey: the envelope inside is signed over its key,
subkey and expiration, and every reader checks those after opening (the DHT worker knows a
key only by its hash). Nonces are random: a key may seal 2**32 values before a repeat becomes
likely, and a swarm's heartbeats seal a few per member per second.
"""

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fusionllm.common.swarm_key import RecordTags
from fusionllm.dht.envelope import MAX_ENVELOPE_BYTES
from fusionllm.dht.records import RecordError

MAGIC = b"FLc1"
NONCE_BYTES = 12
OVERHEAD = len(MAGIC) + NONCE_BYTES + 16  # + GCM's tag
MAX_SEALED_BYTES = max(MAX_ENVELOPE_BYTES.values()) + OVERHEAD


class UnsealedRecordError(RecordError):
    """A private swarm's DHT value that is not sealed, or not under this swarm's key."""


class RecordCipher:
    """Seals and opens DHT values under one private swarm's derived key."""

    def __init__(self, tags: RecordTags) -> None:
        self._aead = AESGCM(tags.cipher_key)

    def __repr__(self) -> str:
        return "RecordCipher(...)"

    def seal(self, envelope: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return MAGIC + nonce + self._aead.encrypt(nonce, envelope, MAGIC)

    def open(self, value: object) -> bytes:
        """The envelope inside ``value`` (from a peer: any type); UnsealedRecordError if it is
        not a value this swarm's key sealed."""
        if not isinstance(value, bytes | bytearray | memoryview):
            raise UnsealedRecordError(f"a sealed record must be bytes, got {type(value).__name__}")
        value = bytes(value)
        if not value.startswith(MAGIC):
            raise UnsealedRecordError("record is not sealed (a private swarm seals every record)")
        if not OVERHEAD <= len(value) <= MAX_SEALED_BYTES:
            raise UnsealedRecordError(f"sealed record of {len(value)} bytes is out of bounds")
        nonce = value[len(MAGIC) : len(MAGIC) + NONCE_BYTES]
        try:
            return self._aead.decrypt(nonce, value[len(MAGIC) + NONCE_BYTES :], MAGIC)
        except InvalidTag:
            raise UnsealedRecordError(
                "sealed record does not open under this swarm's key (another key, or altered)"
            ) from None
