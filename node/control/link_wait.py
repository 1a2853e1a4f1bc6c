"""Whom the planner waits for: candidates with too few measured links to the other candidates.

A link nobody measured is estimated from its ends' records (dag/swarm.py), and the testbed
showed what a plan over such links is worth: every first plan on every topology claimed the
same 0.1122 s, seated stages across a 20 Mbit/s link it took for a fast one, and trained at a
quarter of the rate the swarm reached once it had measured (docs/testbed.md). So a node does
not plan while a candidate has links measured both ways to fewer than ``need`` of the
others (all of them in a swarm that small), for at most ``wait_s`` after that candidate
arrived; after that it plans with what is measured (a peer that cannot be probed must not
stall the swarm). Not every pair: a large swarm only ever measures a sample of its links.

Where probes wait for their slots (probe_slots.py), a link's first probe may come a whole
cycle of slots after its ends met, and a cycle grows with the swarm (12 s on four members at
1 MiB probes, 20 s on five): the wait is ``wait_s`` plus that (``sweep_s``). With 6 s in all,
B's first plan was made with the two sites' own links unmeasured, priced from the records,
and it seated a stage on each side of the 20 Mbit/s link for 43 steps (issue 25, session 16).
Both ways, as a plan sends both ways (activations on, gradients back), and the way not
measured is priced from its ends' records, whose uplink and downlink are the best links each
had measured when it last wrote. With either way enough, the three OP-Fence runs of one full
B run planned first across the sites and trained there 40-48 steps: e2 -> e1 unmeasured, at
e2's 20 Mbit/s (it had measured only its links to the other site), made e1 / e2 look no
faster than a cross-site pair; w2 -> e2 unmeasured, at w2's 1 Gbit/s to w1, made w2 / e2 look
fast. Hence two cycles: a link whose lane was refused waits a probe interval, then its slot.
"""

from collections.abc import Callable, Collection, Set

from fusionllm.common.errors import ConfigError


def measured_neighbours(
    peers: Collection[str], measured: Set[tuple[str, str]]
) -> dict[str, set[str]]:
    """peer -> the other ``peers`` it has a link with measured both ways."""
    out: dict[str, set[str]] = {p: set() for p in peers}
    for a, b in measured:
        if a in out and b in out and a != b and (b, a) in measured:
            out[a].add(b)
            out[b].add(a)
    return out


class LinkWait:
    """When each candidate was first seen, and which ones planning still waits for."""

    def __init__(
        self,
        wait_s: float,
        *,
        need: int = 3,
        sweep_s: Callable[[int], float] = lambda peers: 0.0,
    ) -> None:
        if not 0 <= wait_s < 3600:
            raise ConfigError(f"link wait must be in [0, 3600) s, got {wait_s}")
        if need < 1:
            raise ConfigError(f"need must be >= 1 measured link, got {need}")
        self.wait_s, self.need, self.sweep_s = wait_s, need, sweep_s
        self._first_seen: dict[str, float] = {}

    def waiting(
        self,
        peers: Collection[str],
        measured: Set[tuple[str, str]],
        *,
        now: float,
        members: int | None = None,
    ) -> set[str]:
        """Those of ``peers`` with too few measured links whose wait has not run out;
        members that went are forgotten (one that comes back waits again). ``members``: how
        many the probe slots pair off (observers too), if more than ``peers``."""
        self._first_seen = {p: self._first_seen.get(p, now) for p in peers}
        if self.wait_s == 0:
            return set()
        need = min(self.need, len(self._first_seen) - 1)
        wait_s = self.wait_s + self.sweep_s(max(members or 0, len(self._first_seen)))
        return {
            p
            for p, linked in measured_neighbours(peers, measured).items()
            if len(linked) < need and now < self._first_seen[p] + wait_s
        }
