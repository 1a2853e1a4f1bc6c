"""Which cores a training daemon computes on while it serves a plan (``--pin-cores``).

Several daemons on one machine (``fusionllm swarm``, a testbed) otherwise leave their compute
and transport threads to the scheduler, which moves them over all cores and makes them hand
the GIL to each other across cores: on 2 cores the swarm stepped ~10% slower unpinned
(benchmarks/swarm.py), the launcher's stage processes ~25% slower (benchmarks/pipeline.py).
Pinned, the k-th process of the plan (by stage, then replica) takes the k-th block of cores,
so daemons of one plan that share a machine compute on different cores without talking to
each other; a daemon out of every plan runs where it ran before.
"""

import contextlib
from collections.abc import Iterator, Sequence

from fusionllm.common.cpus import available_cores, pin, spread
from fusionllm.common.logs import get_logger
from fusionllm.node.training.assignment import Assignment

logger = get_logger(__name__)


class CorePlacement:
    """Pins this process for the length of a plan; does nothing when not ``enabled``."""

    def __init__(self, *, enabled: bool, home: Sequence[int] | None = None) -> None:
        """``home``: the cores to spread plans over and return to (default: ours now)."""
        self.enabled = enabled
        self._home = tuple(home) if home is not None else available_cores() if enabled else ()

    def cores_for(self, assignment: Assignment, threads: int) -> tuple[int, ...] | None:
        """The cores this node computes on in ``assignment``; None: not in it."""
        if assignment.role is None:
            return None
        order = sorted(assignment.peers, key=lambda role: (role.stage, role.replica))
        rank = order.index(assignment.role)
        return spread(rank + 1, threads, self._home)[rank]

    @contextlib.contextmanager
    def serving(self, assignment: Assignment, threads: int) -> Iterator[None]:
        cores = self.cores_for(assignment, threads) if self.enabled else None
        pinned = cores is not None and pin(cores)
        if pinned:
            logger.info("computing on cores %s for plan %s", list(cores), assignment.digest[:12])
        try:
            yield
        finally:
            if pinned:
                pin(self._home)
