"""What the swarm's DHT stores: the rules behind dht/validator.py, without hivemind.

A record is accepted only if it is one of our signed envelopes (envelope.py), stored under the
key and subkey it was signed for, with the expiration it was signed with, expiring within
``max_ttl_s`` of now, and, for a node record, written no later than ``max_skew_s`` from now
(a record dated ahead would look fresh for as long as it lives). A plan proposal is accepted
only from a member: a key whose node record this DHT node has validated and which had not
expired ``max_ttl_s`` ago (``KnownMembers``), so a stranger cannot fill plan keys at all.

Why the grace of ``max_ttl_s``: hivemind validates whole dictionaries of records that peers
return to our gets, and one refused entry drops the whole answer, honest proposals with it. A
proposal lives at most ``max_ttl_s``, so a member we knew while it could have written one is
still a member for as long as its proposals can be served to us.

hivemind hands the validator the same record many times: once per peer that returns it to a
get (every replica answers a get for the latest value) and once more as it arrives to be
stored. Opening an envelope (parse, Ed25519 check) is a pure function of its bytes, so the
rules remember the envelopes they opened by a digest of those bytes (``OpenedEnvelopes``)
and open each only once; every other check (expiry, key, swarm, skew, membership) runs
again each time, against the clock of that moment. In a private swarm opening starts with the
swarm's seal (cipher.py), so a value that is not sealed under its key is refused first.

Pure and hivemind-free so unit tests can run it (hivemind and py-libp2p cannot share a
process): the caller decodes the DHT's subkey and value and says how a key name maps to the
DHT's key id.
"""

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from fusionllm.common.errors import ConfigError
from fusionllm.common.swarm_key import RecordTags
from fusionllm.dht.cipher import RecordCipher
from fusionllm.dht.envelope import OpenedRecord, open_envelope
from fusionllm.dht.keys import check_swarm_name, nodes_key, plans_key
from fusionllm.dht.records import MAX_CLOCK_SKEW_S, NodeInfo, RecordError

# Distinct keys remembered at once; beyond it the soonest to expire are forgotten first.
MAX_KNOWN_MEMBERS = 16384
# Opened envelopes remembered at once (least recently used forgotten first): a few heartbeats
# of every member's node record and the current epochs' proposals.
MAX_OPENED_ENVELOPES = 2048


class OpenedEnvelopes:
    """``open_envelope``, remembered: the same bytes are verified and parsed once.

    Only envelopes that opened are remembered (a refused one is checked again each time, so
    junk cannot fill this); the key is a SHA-256 of the bytes, so two envelopes share an
    entry only if they are the same bytes.
    """

    def __init__(
        self, limit: int = MAX_OPENED_ENVELOPES, *, cipher: RecordCipher | None = None
    ) -> None:
        if limit < 1:
            raise ConfigError(f"limit must be >= 1, got {limit}")
        self.limit = limit
        self._cipher = cipher  # a private swarm's: values are sealed envelopes
        self.opened = 0  # envelopes verified and parsed (cache misses that opened)
        self._by_digest: OrderedDict[bytes, OpenedRecord] = OrderedDict()

    def open(self, data: object) -> OpenedRecord:
        if not isinstance(data, bytes):
            return self._open(data)  # refuses it, or a type we do not remember
        digest = hashlib.sha256(data).digest()
        found = self._by_digest.get(digest)
        if found is not None:
            self._by_digest.move_to_end(digest)
            return found
        opened = self._open(data)
        self.opened += 1
        self._by_digest[digest] = opened
        if len(self._by_digest) > self.limit:
            self._by_digest.popitem(last=False)
        return opened

    def __len__(self) -> int:
        return len(self._by_digest)

    def _open(self, data: object) -> OpenedRecord:
        return open_envelope(data if self._cipher is None else self._cipher.open(data))


@dataclass
class KnownMembers:
    """Peer id -> the latest expiration of a node record of it that we validated."""

    limit: int = MAX_KNOWN_MEMBERS
    _until: dict[str, float] = field(default_factory=dict)

    def note(self, peer_id: str, expiration: float, now: float) -> None:
        if expiration > self._until.get(peer_id, -1.0):
            self._until[peer_id] = expiration
        if len(self._until) > self.limit:
            self._forget(now)

    def knows(self, peer_id: str, *, since: float) -> bool:
        """Whether a record of ``peer_id`` was still alive at ``since``."""
        return self._until.get(peer_id, -1.0) >= since

    def __len__(self) -> int:
        return len(self._until)

    def _forget(self, now: float) -> None:
        for peer in [p for p, until in self._until.items() if until < now]:
            del self._until[peer]
        if len(self._until) > self.limit:
            keep = sorted(self._until.items(), key=lambda item: -item[1])[: self.limit]
            self._until = dict(keep)


class RecordRules:
    def __init__(
        self,
        swarm: str,
        *,
        max_ttl_s: float,
        key_id: Callable[[str], bytes],
        max_skew_s: float = MAX_CLOCK_SKEW_S,
        clock: Callable[[], float] = time.time,
        tags: RecordTags | None = None,  # a private swarm's: untagged records are refused
    ) -> None:
        check_swarm_name(swarm)
        if not max_ttl_s > 0 or not max_skew_s >= 0:
            raise ConfigError(f"need max_ttl_s > 0 and max_skew_s >= 0, got {max_ttl_s}, "
                              f"{max_skew_s}")  # fmt: skip
        self.swarm, self.max_ttl_s, self.max_skew_s = swarm, max_ttl_s, max_skew_s
        self._key_id, self._clock, self._tags = key_id, clock, tags
        self._nodes_key = nodes_key(swarm)
        self._nodes_key_id = key_id(self._nodes_key)
        self.members = KnownMembers()
        self.envelopes = OpenedEnvelopes(cipher=RecordCipher(tags) if tags is not None else None)

    def check(
        self, key_id: bytes, subkey: object, value: object, expiration: float
    ) -> OpenedRecord:
        """The opened record if the DHT may keep it; RecordError says why not."""
        now = self._clock()
        opened = self.envelopes.open(value)
        if self._tags is not None and not self._tags.verify(opened.signed, opened.mac):
            raise RecordError(f"{opened.kind} record without this swarm's key")
        if opened.subkey != subkey:
            raise RecordError("record stored under a subkey it was not signed for")
        if opened.expiration != expiration:
            raise RecordError("record expiration differs from the signed one")
        if opened.expiration > now + self.max_ttl_s:
            raise RecordError(f"record expires more than {self.max_ttl_s}s from now")
        record = opened.record
        if record.swarm != self.swarm:
            raise RecordError(f"{opened.kind} record for swarm {record.swarm!r}")
        if isinstance(record, NodeInfo):
            expected, expected_id = self._nodes_key, self._nodes_key_id
            if record.time > now + self.max_skew_s:
                raise RecordError(f"node record dated {record.time - now:.1f}s ahead of us")
        else:
            expected = plans_key(self.swarm, record.epoch)
            expected_id = self._key_id(expected)
        if opened.key != expected or expected_id != key_id:
            raise RecordError(f"{opened.kind} record stored under the wrong key")
        if isinstance(record, NodeInfo):
            self.members.note(record.peer_id, opened.expiration, now)
        elif not self.members.knows(record.proposer, since=now - self.max_ttl_s):
            raise RecordError(f"plan from {record.proposer[:16]}..., not a member we know")
        return opened
