"""Measured beats claimed: how much slower a node computes than its advertised device says.

A node advertises its device (measured by probe.py, or claimed with ``--device-json``) and the
planner sizes its stage by it. A node much slower than that (its GPU unused, its CPU shared, a
claim that was never true) is the bottleneck of every step. Each step's report gives the node's
own compute time for its stage (``StepReport.busy_s``, forward and backward); ``PaceMeter``
keeps the ratio of that to what the advertised device predicts for the same work
(``predicted_compute_s``, the planner's roofline), and once the median is more than
``threshold`` times, the node's record says so (``NodeInfo.pace``): every node then plans it
with its device's figures divided by the pace (``bandwidth.peer_of``), the same on every
node, as the record is signed and read by all.

The published pace moves in powers of two and only when the median leaves a wide band around
it, so noise and the cost model's per-stage error do not re-plan the swarm. A pace can only
make a node look slower: a liar gains nothing by it. Pure: fed numbers, no clock
(tests/unit/test_pace.py).
"""

import math
import statistics
from collections import deque

from fusionllm.common.errors import ConfigError
from fusionllm.dag.cost import DeviceProfile, node_time
from fusionllm.dag.graph import GraphCosts
from fusionllm.dag.planner import Plan, PlanConfig
from fusionllm.dht.records import DeviceInfo

THRESHOLD = 2.0  # the "more than 2x slower than its advertised device predicts"
# A published pace holds while the median stays within [0.5, 2.5] x it: the cost model's
# error differs from stage to stage (up to ~2x on a loaded CPU here), so a node moved to
# another stage must not flip its pace, and the swarm's plan with it, back and forth.
_LEAVE_BELOW = 0.5
_LEAVE_ABOVE = 2.5


def predicted_compute_s(
    costs: GraphCosts, plan: Plan, peer: str, device: DeviceInfo, config: PlanConfig
) -> float | None:
    """The compute one step of ``plan`` asks of ``peer`` on ``device``, as the planner
    reckons it (every micro-batch's share, forward and backward); None if it is not seated."""
    for stage in plan.stages:
        if peer in stage.peers:
            share = stage.shares[stage.peers.index(peer)]
            profile = DeviceProfile(
                name=device.name,
                flops=device.flops,
                memory_bandwidth=device.memory_bandwidth,
                memory_bytes=device.memory_bytes,
                op_overhead=device.op_overhead,
            )
            nodes = costs.nodes[stage.start : stage.stop]
            per_micro_batch = sum(node_time(n, profile, scale=config.scale).total for n in nodes)
            return config.micro_batches * share * per_micro_batch
    return None


class PaceMeter:
    """The median of a node's last ``window`` measured/predicted ratios, as a published pace."""

    def __init__(self, *, window: int = 16, threshold: float = THRESHOLD) -> None:
        if not 3 <= window <= 1024:
            raise ConfigError(f"window must be in [3, 1024], got {window}")
        if not 1.0 < threshold <= 1e3:
            raise ConfigError(f"threshold must be in (1, 1000], got {threshold}")
        self.threshold = threshold
        self._ratios: deque[float] = deque(maxlen=window)
        self.published = 1.0

    def add(self, measured_s: float, predicted_s: float) -> float:
        """Note one step; the pace to publish now (1.0: as advertised)."""
        if measured_s > 0 and predicted_s > 0 and math.isfinite(measured_s / predicted_s):
            self._ratios.append(measured_s / predicted_s)
        if len(self._ratios) < self._ratios.maxlen:
            return self.published  # a few steps are no measurement (warm-up, a plan switch)
        median = statistics.median(self._ratios)
        held = self.published
        if held > 1.0 and held * _LEAVE_BELOW <= median <= held * _LEAVE_ABOVE:
            return held
        self.published = 2.0 ** math.floor(math.log2(median)) if median > self.threshold else 1.0
        return self.published

    def reset(self) -> None:
        """A new plan: its stage is another amount of work, measured afresh."""
        self._ratios.clear()
