"""``SwarmDirectory``: a swarm's node records and plan proposals on the DHT, signed and checked.

Writes are sealed with the node's key (dht/envelope.py); reads re-verify every entry in this
process (the DHT worker's validator already did, but a reader trusts only itself), skip and
count what fails, and never raise for a peer's bad entry. In a private swarm (``auth``: the
swarm key) writes carry its tag and are sealed (cipher.py), and reads refuse entries that are
not sealed under it or lack a valid tag.
"""

import threading
import time

from fusionllm.common.logs import get_logger
from fusionllm.common.swarm_key import SwarmKey
from fusionllm.dht.cipher import RecordCipher
from fusionllm.dht.client import DhtClient
from fusionllm.dht.envelope import OpenedRecord, Signer, open_envelope, seal
from fusionllm.dht.keys import nodes_key, plans_key
from fusionllm.dht.records import NodeInfo, NodeState, PlanProposal, RecordError

logger = get_logger(__name__)


class SwarmDirectory:
    def __init__(
        self,
        client: DhtClient,
        *,
        swarm: str,
        peer_id: str,
        sign: Signer,
        auth: SwarmKey | None = None,
    ) -> None:
        self.client, self.swarm, self.peer_id, self._sign = client, swarm, peer_id, sign
        self._auth = auth
        self._tag = auth.tag if auth is not None else None
        self._cipher = RecordCipher(auth.records) if auth is not None else None
        self._last_expiration = 0.0
        self._announce_lock = threading.Lock()
        self.skipped = 0  # entries from peers that failed verification on read

    def announce(self, info: NodeInfo, *, ttl_s: float) -> bool:
        """Store (refresh) our record; it disappears ``ttl_s`` after the last refresh."""
        # hivemind keeps the entry with the latest expiration per subkey: ours must grow.
        with self._announce_lock:
            expiration = max(time.time() + ttl_s, self._last_expiration + 1e-3)
            self._last_expiration = expiration
            key = nodes_key(self.swarm)
            value = seal(info, key=key, subkey=self.peer_id, expiration=expiration,
                         sign=self._sign, tag=self._tag)  # fmt: skip
            return self.client.store(key, self.peer_id, self._sealed(value), expiration)

    def members(self, *, include_leaving: bool = False) -> dict[str, NodeInfo]:
        """Every node with a valid, unexpired record (by peer id)."""
        key = nodes_key(self.swarm)
        found: dict[str, NodeInfo] = {}
        for subkey, value, expiration in self.client.get(key):
            try:
                opened = self._open(value)
                if opened.key != key or opened.subkey != subkey or opened.kind != "node":
                    raise RecordError("node record under the wrong key or subkey")
                if opened.expiration != expiration:
                    raise RecordError("node record expiration differs from the signed one")
                info = opened.record
                if info.swarm != self.swarm:
                    raise RecordError(f"node record for swarm {info.swarm!r}")
            except RecordError as exc:
                self.skipped += 1
                logger.info("skipped a node record from the DHT: %s", exc)
                continue
            if include_leaving or info.state is not NodeState.LEAVING:
                found[info.peer_id] = info
        return found

    def propose(self, proposal: PlanProposal, *, ttl_s: float) -> bool:
        key = plans_key(self.swarm, proposal.epoch)
        expiration = time.time() + ttl_s
        value = seal(proposal, key=key, subkey=self.peer_id, expiration=expiration,
                     sign=self._sign, tag=self._tag)  # fmt: skip
        return self.client.store(key, self.peer_id, self._sealed(value), expiration)

    def proposals(self, epoch: int) -> list[PlanProposal]:
        key = plans_key(self.swarm, epoch)
        found = []
        for subkey, value, _expiration in self.client.get(key):
            try:
                opened = self._open(value)
                if opened.key != key or opened.subkey != subkey or opened.kind != "plan":
                    raise RecordError("plan proposal under the wrong key or subkey")
            except RecordError as exc:
                self.skipped += 1
                logger.info("skipped a plan proposal from the DHT: %s", exc)
                continue
            found.append(opened.record)
        return found

    def _sealed(self, envelope: bytes) -> bytes:
        return envelope if self._cipher is None else self._cipher.seal(envelope)

    def _open(self, value: object) -> OpenedRecord:
        if self._cipher is not None:
            value = self._cipher.open(value)  # UnsealedRecordError (a RecordError)
        opened = open_envelope(value)
        if self._auth is not None and not self._auth.verify(opened.signed, opened.mac):
            raise RecordError(
                f"{opened.kind} record of {opened.subkey[:16]}... lacks the swarm key"
            )
        return opened
