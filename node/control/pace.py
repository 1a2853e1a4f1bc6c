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

A member's own pace is its own word. So every member also witnesses the others of its plan:
each step's summaries carry every process's compute and its waits for activations and
gradients (pipeline/summary.py); ``checked_compute`` takes a member's compute as the larger of
what it said and what its neighbours' waits show (the upstream neighbour waited for gradients
while the member computed, the downstream one for activations; minus what the member itself
waited on further along, and the links' time as the node measures them now), and
``PaceWitness`` keeps a ``PaceMeter`` per member on those figures. A record says whom its node
witnessed slower than its device (``NodeInfo.witnessed``), and every planner takes a member's
pace as the larger of its own and the median of its witnesses' (``with_witnessed_paces``): a
member that says it computes faster than it does is planned at the speed its neighbours saw.
The neighbours' check is exact for the first and last stages; a middle stage's own waits
enter its check. Stages with replicas are witnessed from their compute alone.
"""

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from fusionllm.common.errors import ConfigError
from fusionllm.dag.cost import DeviceProfile, node_time
from fusionllm.dag.graph import GraphCosts
from fusionllm.dag.planner import Plan, PlanConfig
from fusionllm.dht.records import MAX_WITNESSED, DeviceInfo, NodeInfo, Witnessed

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
            return share * nodes_compute_s(costs, stage.start, stage.stop, device, config)
    return None


def nodes_compute_s(
    costs: GraphCosts, start: int, stop: int, device: DeviceInfo, config: PlanConfig
) -> float:
    """The planner's compute for graph nodes [start, stop) over a step's micro-batches on
    ``device``, forward and backward."""
    profile = DeviceProfile(
        name=device.name,
        flops=device.flops,
        memory_bandwidth=device.memory_bandwidth,
        memory_bytes=device.memory_bytes,
        op_overhead=device.op_overhead,
    )
    per_micro_batch = sum(node_time(n, profile, scale=config.scale).total
                          for n in costs.nodes[start:stop])  # fmt: skip
    return config.micro_batches * per_micro_batch


class RatioWindow:
    """The last ``window`` measured/predicted ratios of a node's steps; their median once the
    window is full (a few steps are no measurement: warm-up, a plan switch). A ratio that is
    not finite and positive is no measurement either."""

    def __init__(self, window: int) -> None:
        if not 3 <= window <= 1024:
            raise ConfigError(f"window must be in [3, 1024], got {window}")
        self.ratios: deque[float] = deque(maxlen=window)

    def add(self, measured_s: float, predicted_s: float) -> float | None:
        if measured_s > 0 and predicted_s > 0 and math.isfinite(measured_s / predicted_s):
            self.ratios.append(measured_s / predicted_s)
        return statistics.median(self.ratios) if len(self.ratios) == self.ratios.maxlen else None

    def clear(self) -> None:
        self.ratios.clear()


class PaceMeter:
    """The median of a node's last ``window`` measured/predicted ratios, as a published pace."""

    def __init__(self, *, window: int = 16, threshold: float = THRESHOLD) -> None:
        if not 1.0 < threshold <= 1e3:
            raise ConfigError(f"threshold must be in (1, 1000], got {threshold}")
        self.threshold = threshold
        self.window = RatioWindow(window)
        self.published = 1.0

    def add(self, measured_s: float, predicted_s: float) -> float:
        """Note one step; the pace to publish now (1.0: as advertised)."""
        median, held = self.window.add(measured_s, predicted_s), self.published
        if median is None or (held > 1.0 and held * _LEAVE_BELOW <= median <= held * _LEAVE_ABOVE):
            return held
        self.published = 2.0 ** math.floor(math.log2(median)) if median > self.threshold else 1.0
        return self.published

    def reset(self) -> None:
        """A new plan: its stage is another amount of work, measured afresh."""
        self.window.clear()


Timing = tuple[float, float, float]  # (compute s, activation wait s, gradient wait s)
# A member's word on its compute stands unless its neighbours waited more than this many times
# as long on it: their waits also hold its work between steps (optimizer step, summary) and
# per-frame costs, which would otherwise make an honest member of a small stage look slow.
_BELIEVED_WITHIN = 2.0


# (src peer, dst peer) -> (bytes/s, RTT s, through a relay) as the node measured that link
# lately, or None
LinkNow = Callable[[str, str], tuple[float, float, bool] | None]


def _link_s(plan: Plan, link: int, micro_batches: int, measured: LinkNow) -> float:
    """One step's frames across the cut after stage ``link``, at what the link measures now
    (a direction not measured: at the plan's figure); infinite (no check) through a relay, or
    with neither direction measured (the plan's figure is then a guess from the records: in
    the NAT test the homes trained before their relayed link was first probed).

    The plan's figure is from when the plan was made: a link that got slower since, taken at
    the plan's figure, left its extra time to be charged as compute. A pace raised on that
    shrinks the member's stage, and its share of the same waits grows: the pace doubled at
    every check (docs/nat.md). A relayed link's waits are not even that: every frame, READY
    and summary crosses a relay's Python process, whose delay a probe of the idle path does
    not see (with the measured figure subtracted, the NAT test's homes still witnessed each
    other at 16-128x their compute). Such a link checks nobody's compute: the member's own
    word (its pace meter) stands there, as a replicated stage's does."""
    cut = next((x for x in plan.links if x.src_stage == link), None)
    if cut is None:
        return 0.0
    fwd, bwd = measured(cut.src_peer, cut.dst_peer), measured(cut.dst_peer, cut.src_peer)
    if fwd is None and bwd is None:
        return math.inf
    fwd = fwd or (cut.forward_bandwidth, cut.forward_rtt, False)
    bwd = bwd or (cut.backward_bandwidth, cut.backward_rtt, False)
    if fwd[2] or bwd[2]:
        return math.inf
    one_way = [(cut.forward_wire_bytes, *fwd[:2]), (cut.backward_wire_bytes, *bwd[:2])]
    return micro_batches * sum(b / max(bw, 1.0) + rtt / 2 for b, bw, rtt in one_way)


def ranks_fit(plan: Plan, ranks: Sequence[tuple[str, int]]) -> bool:
    """Whether a step's (peer, stage) per rank belong to ``plan``: a session finishes the
    steps of the plan it runs after the node adopted the next one (fewer stages, other
    seats), and its summaries must not be read against the new one."""
    return all(0 <= stage < len(plan.stages) and peer in plan.stages[stage].peers
               for peer, stage in ranks)  # fmt: skip


def checked_compute(
    plan: Plan, stages: Sequence[int], timings: Sequence[Timing], micro_batches: int,
    measured: LinkNow,
) -> list[float]:  # fmt: skip
    """Each process's compute in one step (rank order; ``stages[r]`` is rank r's stage): what
    it said, or what its neighbours waited on it where that is more than twice as much, less
    the links' time (``measured``: what the node knows each link costs now)."""
    width = [len(s.peers) for s in plan.stages]
    alone = {r: stages[r] for r in range(len(stages)) if width[stages[r]] == 1}
    at = {stage: r for r, stage in alone.items()}
    # The cuts between two stages of one process each: both ends witness across them.
    cut_s = {c: _link_s(plan, c, micro_batches, measured) for c in at if c + 1 in at}
    checked = []
    for r, (busy, wait_in, wait_out) in enumerate(timings):
        bounds = [busy]
        t = alone.get(r)
        if t is not None and t - 1 in at:  # the upstream waited for our gradients
            bounds.append(timings[at[t - 1]][2] - wait_out - cut_s[t - 1])
        if t is not None and t + 1 in at:  # the downstream waited for our activations
            bounds.append(timings[at[t + 1]][1] - wait_in - cut_s[t])
        seen = max(bounds)
        checked.append(seen if seen > _BELIEVED_WITHIN * busy else busy)
    return checked


class PaceWitness:
    """The paces of the other members of our plans, from their checked compute."""

    def __init__(self, *, window: int = 16, threshold: float = THRESHOLD) -> None:
        self._window, self._threshold = window, threshold
        self._meters: dict[str, PaceMeter] = {}
        self._plan: str | None = None

    def add(self, plan: str, peer: str, measured_s: float, predicted_s: float) -> None:
        if plan != self._plan:  # another stage: measured afresh, the published paces kept
            for meter in self._meters.values():
                meter.reset()
            self._plan = plan
        meter = self._meters.get(peer)
        if meter is None:
            if len(self._meters) >= 4 * MAX_WITNESSED:  # bounded: forget the fastest
                del self._meters[min(self._meters, key=lambda p: self._meters[p].published)]
            meter = self._meters[peer] = PaceMeter(window=self._window, threshold=self._threshold)
        meter.add(measured_s, predicted_s)

    def current(self) -> tuple[Witnessed, ...]:
        """The members witnessed slower than their devices (what our record says)."""
        slow = [Witnessed(p, m.published) for p, m in self._meters.items() if m.published > 1.0]
        return tuple(sorted(slow, key=lambda w: (-w.pace, w.peer))[:MAX_WITNESSED])


def witnessed_pace(members: Mapping[str, NodeInfo], peer: str) -> float:
    """The median (lower) of the paces other members witnessed of ``peer``; 1.0 if none."""
    seen = [
        w.pace
        for by, info in members.items()
        if by != peer and not info.observer
        for w in info.witnessed
        if w.peer == peer
    ]
    return statistics.median_low(sorted(seen)) if seen else 1.0


def with_witnessed_paces(members: Mapping[str, NodeInfo]) -> dict[str, NodeInfo]:
    """``members`` with each pace raised to what its witnesses saw, where that is slower."""
    out = dict(members)
    for peer, info in members.items():
        pace = witnessed_pace(members, peer)
        if pace > info.pace:
            out[peer] = dataclasses.replace(info, pace=pace)
    return out
