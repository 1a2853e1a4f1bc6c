"""A plan nobody trains, seen from outside it: the backup pool suspects its members.

The READY barrier suspects a member that does not come (session.py), but only the plan's own
members wait there. A plan whose members all stay away (two members that claim a fast device
and never train, seated together with no trainer beside them; with ``--min-stages 1``, one)
has nobody at its barrier to suspect them: its estimate stays the best, the swarm keeps it,
and training stops for good. So a trainer the followed plan leaves out watches the swarm's
progress (the newest step the members' records say was reached): if it does not move for
``patience_s`` while that plan is followed, it suspects the plan's members (reason "idle").
Enough of the pool's word keeps them out (seating.py), and the swarm re-plans without them.

The patience is long on purpose (``idle_patience_s``): an honest plan's own barrier deals
with a missing member within its grace, and its first step may wait for state moved between
its members at the links' speed. A member's record could claim progress it never made: that
lie is out of reach here (only records are seen from the pool).

Pure bookkeeping over the caller's clock (tests/unit/test_idle_plan.py).
"""

from collections.abc import Iterable

from fusionllm.common.errors import ConfigError


def idle_patience_s(
    *, barrier_grace_s: float, step_timeout_s: float, state_bytes: int, bytes_per_s: float
) -> float:
    """How long a followed plan may show no progress before the pool suspects its members:
    twice what its own members would wait (the barrier's grace and one step's frame timeout),
    plus the whole model's state at ``bytes_per_s`` (moved between its members before the
    first step)."""
    return 2.0 * (barrier_grace_s + step_timeout_s) + state_bytes / max(bytes_per_s, 1.0)


class IdlePlanWatch:
    """One followed plan that this node is not in, watched for progress."""

    def __init__(
        self, members: Iterable[str], *, progress: int, now: float, patience_s: float
    ) -> None:
        if not patience_s > 0:
            raise ConfigError(f"patience_s must be > 0, got {patience_s}")
        self.members = tuple(sorted(set(members)))
        self._progress = progress
        self._since = now
        self.patience_s = patience_s

    def check(self, *, progress: int, now: float) -> tuple[str, ...]:
        """The members to suspect now: all of them once the progress stood still for the
        patience, then again after each further patience (the suspicion book doubles the
        backoff); nobody while the swarm's steps move on."""
        if progress > self._progress:
            self._progress, self._since = progress, now
            return ()
        if now - self._since < self.patience_s:
            return ()
        self._since = now
        return self.members
