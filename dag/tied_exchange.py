"""What a step's tied-gradient exchange costs each stage's uplink (runner.py's step 3).

Stages that split a shared parameter (GPT-2's wte on the first stage, lm_head on the last)
each send their copy's gradient to the other holders after their schedule, and sum the
copies before the optimizer step. The first stage's copy leaves after its last backward, the
step's last compute; on the testbed's topology C (issue 25) that 64 KiB frame over a 5 MB/s
uplink held the last stage 44 ms a step, and the estimate of the plan it ran missed by about
that much. ``tied_tails`` gives each stage's uplink time for those frames, which the
simulator adds after the stage's schedule (its ``allreduce`` term).

Pure: the graph's shared parameters, the cut, each stage's first peer and a link lookup.
"""

import bisect
from collections.abc import Callable, Sequence

from fusionllm.dag.cost import LinkProfile
from fusionllm.dag.graph import GraphCosts


def tied_tails(
    graph: GraphCosts,
    cuts: Sequence[int],
    stage_peers: Sequence[int],
    link: Callable[[int, int], LinkProfile],
) -> tuple[float, ...]:
    """Per stage, seconds its uplink spends sending its shared parameters' gradients to the
    other stages that hold them. ``cuts``: stage k runs nodes ``cuts[k]:cuts[k + 1]``;
    ``stage_peers[k]``: the peer (index) of stage k's first replica, which stands for its
    replicas (each sends to its counterparts, in parallel)."""
    tails = [0.0] * (len(cuts) - 1)
    for users, nbytes in graph.shared_params:
        holders = sorted({bisect.bisect_right(cuts, u) - 1 for u in users})
        for h in holders:
            for other in holders:
                if other != h:
                    tails[h] += nbytes / link(stage_peers[h], stage_peers[other]).bandwidth
    return tuple(tails)
