"""The READY barrier's late members: each suspected once, when its own wait ends."""

import time
from collections.abc import Callable

from fusionllm.common.logs import get_logger

logger = get_logger(__name__)


class Latecomers:
    """One barrier round's members that are late. ``wait_s(peer)``: how long the round waits
    for ``peer`` before ``suspect(peer, "barrier")`` (its stage's state may still be arriving)."""

    def __init__(
        self,
        others: list[str],
        *,
        wait_s: Callable[[str], float],
        suspect: Callable[[str, str], None],
    ) -> None:
        self._others, self._wait_s, self._suspect = others, wait_s, suspect
        self._started = time.monotonic()
        self._suspected: set[str] = set()
        self._waits: dict[str, float] = {}

    def check(self, ready: dict) -> None:
        waited = time.monotonic() - self._started
        for peer in self._others:
            if peer in ready or peer in self._suspected:
                continue
            if peer not in self._waits:
                self._waits[peer] = self._wait_s(peer)
            if waited >= self._waits[peer]:
                self._suspected.add(peer)
                logger.warning("member %s is not at the READY barrier after %.0f s: suspecting it",
                               peer[:16], waited)  # fmt: skip
                self._suspect(peer, "barrier")
