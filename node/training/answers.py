"""Which requests for state (WANT) a node answers, and how many bytes it gives each asker.

An answer sends the asker every stage state we hold after its floor: up to the whole model
with its optimizer state. Answered for anyone, every time, a member could make us send our
whole state again and again. So a WANT counts only when

- it comes from the first member of the plan we follow (the one session.py lets ask), while
  we are outside that plan (members meet at the barrier; they never ask each other);
- we have not answered that peer for that plan yet (one answer per plan and peer);

and what an answer sends is budgeted per peer: ``states_per_window`` whole-model states each
``window_s`` (a plan change rarely needs more than one).

Pure bookkeeping over an injected clock (tests/unit/test_answers.py).
"""

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fusionllm.common.errors import ConfigError

_PLANS_REMEMBERED = 64  # answered (peer, plan) pairs kept; older ones fall off
ANSWERED = "answered for this plan already"


@dataclass(frozen=True, kw_only=True)
class AnswerLimits:
    window_s: float = 60.0
    states_per_window: float = 2.0  # whole-model states (parameters + AdamW) per peer

    def __post_init__(self) -> None:
        if not 0 < self.window_s <= 86400:
            raise ConfigError(f"window_s must be in (0, 86400], got {self.window_s}")
        if not 0 < self.states_per_window <= 1000:
            raise ConfigError(f"states_per_window must be in (0, 1000], got "
                              f"{self.states_per_window}")  # fmt: skip


class Answers:
    def __init__(
        self,
        limits: AnswerLimits | None = None,
        *,
        full_state_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if full_state_bytes <= 0:
            raise ConfigError(f"full_state_bytes must be > 0, got {full_state_bytes}")
        self.limits = limits or AnswerLimits()
        self._budget = int(self.limits.states_per_window * full_state_bytes)
        self._clock = clock
        self._lock = threading.Lock()
        self._answered: dict[tuple[str, str], None] = {}  # (peer, plan digest), oldest first
        self._spent: dict[str, tuple[float, int]] = {}  # peer -> (window start, bytes sent)
        self.refused = 0

    def refusal(
        self, peer: str, *, digest: str | None, members: Sequence[str], serving: bool
    ) -> str | None:
        """Why a WANT from ``peer`` goes unanswered (None: answer it, once). ``digest`` and
        ``members``: the plan we follow (None: none); ``serving``: whether it seats us."""
        why = None
        if digest is None or not members:
            why = "we follow no plan"
        elif serving:
            why = "we serve the plan: its members meet at the barrier"
        elif peer != members[0]:
            why = "only the plan's first member asks"
        with self._lock:
            if why is None and (peer, digest) in self._answered:
                why = ANSWERED
            if why is not None:
                self.refused += 1
                return why
            self._answered[(peer, digest)] = None
            while len(self._answered) > _PLANS_REMEMBERED:
                del self._answered[next(iter(self._answered))]
        return None

    def spend(self, peer: str, nbytes: int) -> bool:
        """Count ``nbytes`` sent to ``peer`` if its budget has room for them (False: send
        nothing more to it in this window)."""
        now = self._clock()
        with self._lock:
            if len(self._spent) > _PLANS_REMEMBERED:  # members come and go: forget old windows
                window = self.limits.window_s
                self._spent = {p: v for p, v in self._spent.items() if now - v[0] < window}
            start, spent = self._spent.get(peer, (now, 0))
            if now - start >= self.limits.window_s:
                start, spent = now, 0
            if spent + nbytes > self._budget:
                self._spent[peer] = (start, spent)
                return False
            self._spent[peer] = (start, spent + nbytes)
            return True
