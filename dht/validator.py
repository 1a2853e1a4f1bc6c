"""hivemind's record validator for a swarm: the rules of record_rules.py, inside the DHT.

Runs in the DHT worker, on its DHTNode's event loop, on every store a peer asks of us and on
every record a peer returns to our gets; anything ``RecordRules`` refuses is refused here
(and counted).
Imports hivemind: only the DHT worker process may import this module (hivemind and py-libp2p
cannot share a process), so the rules live apart and are unit-tested there.
"""

import time
from collections.abc import Callable

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer

from fusionllm.common.logs import get_logger
from fusionllm.common.swarm_key import RecordTags
from fusionllm.dht.record_rules import RecordRules
from fusionllm.dht.records import MAX_CLOCK_SKEW_S, RecordError

logger = get_logger(__name__)


def key_id(key: str) -> bytes:
    """The DHT's id of a key name, as hivemind computes it for gets and stores."""
    return DHTID.generate(source=key).to_bytes()


class SwarmRecordValidator(RecordValidatorBase):
    def __init__(
        self,
        swarm: str,
        *,
        max_ttl_s: float,
        max_skew_s: float = MAX_CLOCK_SKEW_S,
        clock: Callable[[], float] = time.time,
        tags: RecordTags | None = None,
    ) -> None:
        self.rules = RecordRules(
            swarm, max_ttl_s=max_ttl_s, max_skew_s=max_skew_s, key_id=key_id, clock=clock,
            tags=tags,
        )  # fmt: skip
        self.rejected = 0

    def validate(self, record: DHTRecord) -> bool:
        try:
            try:
                subkey = MSGPackSerializer.loads(record.subkey)
                value = MSGPackSerializer.loads(record.value)
            except Exception as exc:
                raise RecordError(f"record subkey/value is not msgpack: {exc}") from exc
            self.rules.check(record.key, subkey, value, record.expiration_time)
        except RecordError as exc:
            self.rejected += 1
            logger.debug("refused a DHT record: %s", exc)
            return False
        except Exception:  # a validator that raises would break hivemind's request handler
            self.rejected += 1
            logger.debug("refused a DHT record that broke validation", exc_info=True)
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False
