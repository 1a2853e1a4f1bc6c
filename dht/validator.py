"""hivemind's record validator for a swarm: signed, schema-checked, correctly keyed records only.

Runs inside hivemind's DHT process on every store a peer asks of us and on every record a
peer returns to our gets. Anything but one of our signed envelopes, stored under the key and
subkey it was signed for, with the expiration it was signed with, not too far in the future,
is refused (a bare value, a record signed by another key, a peer writing another peer's
subkey, a bad schema, a node record under a plan key...). Imports hivemind: only the DHT
worker process may import this module (hivemind and py-libp2p cannot share a process).
"""

import time

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from fusionllm.common.logs import get_logger
from fusionllm.dht.envelope import open_envelope
from fusionllm.dht.keys import nodes_key, plans_key
from fusionllm.dht.records import NodeInfo, RecordError

logger = get_logger(__name__)


class SwarmRecordValidator(RecordValidatorBase):
    def __init__(self, swarm: str, *, max_ttl_s: float) -> None:
        self.swarm = swarm
        self.max_ttl_s = max_ttl_s
        self._nodes_key_id = DHTID.generate(source=nodes_key(swarm)).to_bytes()
        self.rejected = 0

    def validate(self, record: DHTRecord) -> bool:
        try:
            self._check(record)
        except RecordError as exc:
            self.rejected += 1
            logger.debug("refused a DHT record: %s", exc)
            return False
        except Exception:  # a validator that raises would break hivemind's request handler
            self.rejected += 1
            logger.debug("refused a DHT record that broke validation", exc_info=True)
            return False
        return True

    def _check(self, record: DHTRecord) -> None:
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            value = MSGPackSerializer.loads(record.value)
        except Exception as exc:
            raise RecordError(f"record subkey/value is not msgpack: {exc}") from exc
        opened = open_envelope(value)
        if opened.subkey != subkey:
            raise RecordError("record stored under a subkey it was not signed for")
        if opened.expiration != record.expiration_time:
            raise RecordError("record expiration differs from the signed one")
        if opened.expiration > time.time() + self.max_ttl_s:
            raise RecordError(f"record expires more than {self.max_ttl_s}s from now")
        if isinstance(opened.record, NodeInfo):
            expected = nodes_key(self.swarm)
            if opened.record.swarm != self.swarm:
                raise RecordError(f"node record for swarm {opened.record.swarm!r}")
        else:
            if opened.record.swarm != self.swarm:
                raise RecordError(f"plan for swarm {opened.record.swarm!r}")
            expected = plans_key(self.swarm, opened.record.epoch)
        if opened.key != expected or DHTID.generate(source=expected).to_bytes() != record.key:
            raise RecordError(f"{opened.kind} record stored under the wrong key")

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False
