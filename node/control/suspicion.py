"""Members this node waited for in vain, and how long it keeps each out of plans.

A member the adopted plan names that does not come to the READY barrier in time (it never
trains, it crashed there, it is far slower than it claimed) stops the whole swarm: every
other member waits for it. The trainer tells ``SuspicionBook.suspect`` (training/session.py
says how long it waits); the book keeps the
peer out for a backoff that doubles with each repeat, as Petals bans a failing server (15 s
first). It forgives the peer on evidence that it is here after all:

- it met us at a barrier (``cleared``): the suspicion ends at once, in force or not, with its
  strikes. A late honest member (a view split, a slow hand-over) that reached the barrier
  after we suspected it trains with us; kept suspect for the rest of the backoff, it would be
  planned out at the next re-plan, and a swarm that needs every member would stop. Only a
  READY for our plan clears, which a member that never trains does not send;
- it stayed clear for ``forgive_after_s`` after its last suspicion ended: a brief view drop
  hours after the last one starts again from the first backoff, not from an hour's ban.

Our record carries
``current()`` (``NodeInfo.suspects``), so every node reads the same suspicions and seating.py
makes the same decision from them: no node excludes on what only it saw.

Pure bookkeeping over an injected clock (tests/unit/test_suspicion.py); one lock, as the
trainer's thread writes and the heartbeat's reads.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.dht.records import MAX_REASON_CHARS, MAX_STRIKES, MAX_SUSPECTS, Suspicion

logger = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class SuspicionConfig:
    first_backoff_s: float = 15.0  # Petals' first ban
    factor: float = 2.0  # each repeat keeps it out this many times longer
    max_backoff_s: float = 3600.0
    # Clear time after a suspicion ends that forgives its strikes: longer than a re-plan and a
    # barrier's wait, so a member that keeps failing every plan that seats it still doubles.
    forgive_after_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0 < self.first_backoff_s <= self.max_backoff_s <= 86400:
            raise ConfigError(
                f"need 0 < first_backoff_s <= max_backoff_s <= 86400, got "
                f"{self.first_backoff_s} and {self.max_backoff_s}"
            )
        if not 0 < self.forgive_after_s <= 86400:
            raise ConfigError(f"forgive_after_s must be in (0, 86400], got {self.forgive_after_s}")
        if not 1 <= self.factor <= 16:
            raise ConfigError(f"factor must be in [1, 16], got {self.factor}")

    def backoff_s(self, strikes: int) -> float:
        return min(self.first_backoff_s * self.factor ** (strikes - 1), self.max_backoff_s)


class SuspicionBook:
    def __init__(
        self, config: SuspicionConfig | None = None, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.config = config or SuspicionConfig()
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[str, Suspicion] = {}  # peer -> its newest suspicion (maybe expired)

    def suspect(self, peer: str, reason: str) -> Suspicion:
        """Keep ``peer`` out of plans: for the first backoff, or twice the last one if its
        last suspicion ended less than ``forgive_after_s`` ago and it was not cleared since.
        Asked again while it is out, nothing changes (the barrier of a plan that still names
        it keeps timing out until the swarm re-plans)."""
        reason = reason[:MAX_REASON_CHARS]
        now = self._clock()
        with self._lock:
            held = self._held.get(peer)
            if held is not None and held.until > now:
                return held
            if held is not None and now - held.until >= self.config.forgive_after_s:
                held = None
            strikes = min(held.strikes + 1, MAX_STRIKES) if held is not None else 1
            suspicion = Suspicion(peer, now + self.config.backoff_s(strikes), reason, strikes)
            self._held[peer] = suspicion
            self._trim()
        logger.warning("suspecting %s (%s): out of plans for %.0f s (strike %d)",
                       peer[:16], reason, suspicion.until - now, strikes)  # fmt: skip
        return suspicion

    def cleared(self, peer: str) -> bool:
        """``peer`` met us at a barrier: it is no suspect now, and the next suspicion starts
        from the first backoff. True if a suspicion in force ended (our record changes)."""
        with self._lock:
            held = self._held.pop(peer, None)
        lifted = held is not None and held.until > self._clock()
        if lifted:
            logger.info("%s met us at a barrier: no longer suspected", peer[:16])
        return lifted

    def current(self) -> tuple[Suspicion, ...]:
        """The suspicions in force now, newest first (what our record says)."""
        now = self._clock()
        with self._lock:
            live = [s for s in self._held.values() if s.until > now]
        return tuple(sorted(live, key=lambda s: -s.until)[:MAX_SUSPECTS])

    def _trim(self) -> None:
        """At most MAX_SUSPECTS remembered per record, and 4x that in all (caller holds the
        lock): a flood of ids must not grow the book; the oldest expired go first."""
        if len(self._held) <= 4 * MAX_SUSPECTS:
            return
        for peer, _ in sorted(self._held.items(), key=lambda kv: kv[1].until)[:MAX_SUSPECTS]:
            del self._held[peer]
