"""Whom the planner waits for: members whose links to the other candidates are not measured.

A link nobody measured is estimated from its ends' records (dag/swarm.py), and the testbed
showed what a plan over such links is worth: every first plan on every topology claimed the
same 0.1122 s, seated stages across a 20 Mbit/s link it took for a fast one, and trained at a
quarter of the rate the swarm reached once it had measured (docs/testbed.md). So a node does
not plan while a pair of candidates has no measured link in either direction, for at most
``wait_s`` after the later of the two arrived; after that it plans with what is measured (a
peer that cannot be probed must not stall the swarm).
"""

import itertools
from collections.abc import Collection, Set

from fusionllm.common.errors import ConfigError


def unmeasured_pairs(
    peers: Collection[str], measured: Set[tuple[str, str]]
) -> list[tuple[str, str]]:
    """Pairs of ``peers`` (sorted) with no measured link either way."""
    return [
        (a, b)
        for a, b in itertools.combinations(sorted(peers), 2)
        if (a, b) not in measured and (b, a) not in measured
    ]


class LinkWait:
    """When each candidate was first seen, and which ones planning still waits for."""

    def __init__(self, wait_s: float) -> None:
        if not 0 <= wait_s < 3600:
            raise ConfigError(f"link wait must be in [0, 3600) s, got {wait_s}")
        self.wait_s = wait_s
        self._first_seen: dict[str, float] = {}

    def waiting(
        self, peers: Collection[str], measured: Set[tuple[str, str]], *, now: float
    ) -> set[str]:
        """Those of ``peers`` in a pair with no measured link whose wait (from the later of
        the two's arrival) has not run out; members that went are forgotten."""
        self._first_seen = {p: self._first_seen.get(p, now) for p in peers}
        if self.wait_s == 0:
            return set()
        late = set()
        for a, b in unmeasured_pairs(peers, measured):
            if now < max(self._first_seen[a], self._first_seen[b]) + self.wait_s:
                late.update((a, b))
        return late
