"""The link a cut between replicated stages really uses: every pair the micro-batches cross.

The runtime hands micro-batch i to replica ``i mod R`` of each stage (node/pipeline/schedule.py
``owner``), so a cut between stages of R_a and R_b replicas carries frames over up to
lcm(R_a, R_b) peer pairs, each sender on its own uplink. The planner used to time such a cut
at its best pair alone; on the testbed's topology C (issue 25) a plan of one 0.8-core stage
feeding two 0.4-core replicas was estimated at 0.152 s and stepped in 0.292 s: one replica's
gradients went back over a 2.5 MB/s link, the best pair's at 5.

``replica_link`` folds the pairs into one LinkProfile the simulator's per-stage FIFO can use:
a sender's frames queue on its uplink one after another, senders run in parallel, so the
M frames of a step take as long as the busiest sender's share; the effective bandwidth is
the one that moves M frames in that time, and the latency the worst pair's. With one replica
on each side it is that pair's link, unchanged.
"""

from collections.abc import Callable, Sequence

from fusionllm.common.errors import ConfigError
from fusionllm.dag.cost import LinkProfile


def replica_link(
    link: Callable[[int, int], LinkProfile],
    senders: Sequence[int],
    receivers: Sequence[int],
    micro_batches: int,
) -> LinkProfile:
    """One direction of a cut: micro-batch i goes from ``senders[i % len(senders)]`` to
    ``receivers[i % len(receivers)]``; ``link(s, r)`` is that pair's link."""
    if not senders or not receivers or micro_batches < 1:
        raise ConfigError("a cut needs senders, receivers and at least one micro-batch")
    per_sender: dict[int, float] = {}  # seconds per byte its frames queue on its uplink
    rtt = 0.0
    for i in range(micro_batches):
        s, r = senders[i % len(senders)], receivers[i % len(receivers)]
        pair = link(s, r)
        per_sender[s] = per_sender.get(s, 0.0) + 1.0 / pair.bandwidth
        rtt = max(rtt, pair.rtt)
    return LinkProfile(bandwidth=micro_batches / max(per_sender.values()), rtt=rtt)
