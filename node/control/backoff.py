"""Idle work proportional to need: how often a stable swarm re-plans from scratch.

Planning is the costliest part of an epoch (0.1-0.3 s of CPU for a tiny model, every epoch, on
every node: at 16 nodes on 2 cores that alone is most of a core). A node that follows a plan
which still passes its audit gains nothing from re-planning every epoch while the members stay
the same; it re-proposes that plan instead, and plans afresh only

- when the members changed (a node joined, left or was suspected gone: the plan may no longer
  run, or a better one may exist),
- when it follows nothing or its plan fails the audit (epochs.py decides that), or
- when the gap has passed: 1 epoch after a change, doubling each time planning afresh changed
  nothing the node proposes (the same plan, or one within the switch margin of the plan it
  follows), up to ``max_gap`` epochs (measurements drift slowly; a plan they make better is
  found at most ``max_gap`` epochs late).

Whatever the reason, only the epoch's few planners plan afresh (planners.py: the members with
the most CPU); the rest re-propose the plan they follow.

``ReplanBackoff.due`` and ``ReplanBackoff.planned`` are pure bookkeeping over epoch numbers:
no clock, no threads, deterministic (tests/unit/test_backoff.py). ``ProbeBackoff`` does the
same for the probe rounds (links.py).
"""

from collections.abc import Hashable
from dataclasses import dataclass

from fusionllm.common.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class BackoffConfig:
    max_gap: int = 8  # epochs between fresh plans at most, once the swarm is stable
    # How many members plan afresh in an epoch (planners.py): those with the most spare CPU.
    planners: int = 3

    def __post_init__(self) -> None:
        for name, top in (("max_gap", 1024), ("planners", 1 << 16)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an int, got {value!r}")
            if not 1 <= value <= top:
                raise ConfigError(f"{name} must be in [1, {top}], got {value}")


class ReplanBackoff:
    """When to plan afresh; one per node, used by the epoch loop's thread only."""

    def __init__(self, config: BackoffConfig | None = None) -> None:
        self.config = config or BackoffConfig()
        self.gap = 1
        self._planned_at: int | None = None  # epoch of the last fresh plan
        self._members: frozenset[Hashable] = frozenset()  # ... and its members
        self._digest: str | None = None  # ... and what it came to

    def due(self, epoch: int, members: frozenset[Hashable], *, incumbent_ok: bool) -> str | None:
        """Why to plan afresh in ``epoch`` for ``members`` (None: no need); ``incumbent_ok``:
        the plan we follow still runs on these members and its figures hold. ``members`` is
        whatever identifies the swarm the plan is for (epochs.py adds which are measured)."""
        found = self._why(epoch, members, incumbent_ok=incumbent_ok)
        return found[0] if found else None

    def only_the_gap(self, epoch: int, members: frozenset[Hashable], *, incumbent_ok: bool) -> bool:
        """Whether the gap is ``due``'s only reason: a routine check that nothing better
        appeared, which one member's plan answers for everyone (plans are deterministic)."""
        found = self._why(epoch, members, incumbent_ok=incumbent_ok)
        return found is not None and found[1]

    def _why(
        self, epoch: int, members: frozenset[Hashable], *, incumbent_ok: bool
    ) -> tuple[str, bool] | None:
        """(why to plan afresh, whether only the gap says so), or None."""
        if self._planned_at is None:
            return "first plan", False
        if not incumbent_ok:
            return "the plan we follow fails its audit", False
        if members != self._members:
            return "members changed", False
        if epoch - self._planned_at >= self.gap:
            return f"{self.gap} epochs since the last plan", True
        return None

    def planned(self, epoch: int, members: frozenset[Hashable], digest: str | None) -> None:
        """Note a fresh planning round: ``digest`` of what it made us propose (None: no feasible
        plan). The gap doubles only when the same members led to the same proposal again;
        anything else starts over at 1."""
        same = members == self._members and digest is not None and digest == self._digest
        self.gap = min(2 * self.gap, self.config.max_gap) if same else 1
        self._planned_at, self._members, self._digest = epoch, members, digest


class ProbeBackoff:
    """How long the probe thread waits between rounds, as a factor of ``probe_interval_s``:
    doubling each round the swarm looks the same as the round before (the members and our plan
    neighbours), up to ``max_factor``; back to 1 as soon as either changes. Failure detection
    does not hang on probes (records expire, see swarm_settings.py), so slower probing of a
    stable swarm only ages the link figures, and ``max_factor_for`` keeps them fresh."""

    def __init__(self, max_factor: int) -> None:
        if isinstance(max_factor, bool) or not isinstance(max_factor, int) or max_factor < 1:
            raise ConfigError(f"max_factor must be an int >= 1, got {max_factor!r}")
        self.max_factor = max_factor
        self.factor = 1
        self._state: Hashable = None

    def next_factor(self, state: Hashable) -> int:
        """The factor for the wait after this round, whose view of the swarm is ``state``."""
        same = state == self._state
        self.factor = min(2 * self.factor, self.max_factor) if same else 1
        self._state = state
        return self.factor


def max_factor_for(probe_interval_s: float, max_age_s: float, *, limit: int = 4) -> int:
    """The largest probe backoff that still refreshes a link twice within the BandwidthBook's
    ``max_age_s`` (rounds jitter up to 1.2x), at most ``limit``."""
    return max(1, min(limit, int(max_age_s / (2 * 1.2 * probe_interval_s))))
