"""Measured beats modelled: how much longer a node's own work in a step takes than planned.

The planner times a stage by its device's calibrated figures (probe.py: one thread, once, on
a quiet host) plus its frames. On the testbed's 0.45-core hosts a fast plan stepped in 2.3-2.5x
its estimate (docs/testbed.md, session 11): the host's CPU per step is the compute the model
counts, and as much again that it does not (data, the schedule's bookkeeping, the update, lane
threads, the DHT worker, p2pd), all paid at the host's share; and the calibration itself moved
by 1.4x between runs. Pace (pace.py) does not see it: it counts compute alone and acts beyond
2x, in powers of two, to catch a node far slower than it says.

So each node measures its own work in every step: the step's wall time less its waits for
activations and gradients, for the others' summaries, for its own sends and the exchanges
(network time the simulator models apart; ``StepReport.own_s``). ``StretchMeter`` keeps the
median of that over what the planner's model predicts for the same work (its stage's compute
and dense frames at its advertised device and pace), and the node's record carries it
(``NodeInfo.stretch``), in quarter powers of two, moved only when the median leaves a band
of 1.68x around it (the first figure once more, after a window: ``StretchMeter``). The band,
not the step, is what holds the swarm still: a new figure re-plans every node of the swarm,
and planning costs a 0.4-core home of topology C a second of its CPU, which stalled the steps
of the next epoch and moved the stretch again (with a 1.41x band, C's OP-Fence run re-planned
on a new stretch four epochs running, its estimate 0.13 -> 0.30 s for steps of ~0.19). The
step only sets how far a figure, once published, may sit from the median it came from.
``bandwidth.peer_of`` multiplies a member's device times by the stretch it is planned at, the
same on every node.

Every planner plans every member at the median (high) of the slowdowns (pace times stretch) the
members measured (``as_planned``), not each at its own (one whose pace alone is slower, at its
pace). What a node measures is partly its host (its share, what else runs on it) and partly the
cost model's error for the stage it holds: on topology B two equal hosts measured 1.2-1.7 on
the first stage and 1.7-2.4 on the last, and planned each at its own, the swarm swapped their
stages for it (a state transfer for nothing; on a WAN, one of minutes) and would swap them
back. A node that has not trained has no measurement of its own either: planned at 1.0 beside
members at 2, every unseated node would look faster than every seated one. The median moves
every member's compute alike: the estimate's level and the trade of compute against links
follow what was measured, the ranking of members does not (a member far slower than the swarm
is pace's to catch, pace.py). A stretch can only make the swarm look slower: a liar among many
moves the median by one place. The high median, as a step runs at its slowest stage's pace: on
B's two-stage plan the stage-0 host measured 1.0 and waited 54 ms a step for the stage-1 host,
which measured 1.68.

Before its first step a node starts from a rehearsal's figure (rehearsal.py: 1.5 s of real
steps of the run's first stage at start, ``rehearsed_stretch``), so a fresh swarm's first
plan is planned at something measured: on B the model alone read 0.46-0.90 of a first plan's
steps, and hosts under a CPU quota rehearse at 1.1-1.5x their scaled device's model (session
21). Pure: fed numbers, no clock (tests/unit/test_stretch.py, test_rehearsal.py).
"""

import dataclasses
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusionllm.common.errors import ConfigError
from fusionllm.dag.cost import stage_frames, topk_charge
from fusionllm.dag.graph import GraphCosts
from fusionllm.dag.plan_build import topk_frames
from fusionllm.dag.planner import Plan, PlanConfig
from fusionllm.dht.records import MAX_STRETCH, DeviceInfo, NodeInfo
from fusionllm.node.control.pace import RatioWindow, nodes_compute_s, with_witnessed_paces

# Published values: quarter powers of two (a 19% step). Half powers put a median of 1.18 at
# 1.0: topology B's two-stage plan was estimated at 0.090 s for steps of 0.105 (session 16).
STEP = 2.0**0.25
# A published stretch holds while the median stays within this factor of it: a node moved to
# a stage of another size measures another ratio (its fixed costs weigh differently), which
# must not move its record, and the swarm's plan with it, back and forth.
_HOLD = 2.0**0.75


def predicted_own_s(
    plan: Plan, peer: str, device: DeviceInfo, config: PlanConfig, *, compute_s: float,
    pace: float,
) -> float | None:  # fmt: skip
    """What the planner's model gives ``peer``'s own work in one step of ``plan``: its
    stage's compute (``compute_s``, pace.predicted_compute_s), dense frames and the top-k
    frames it codes beyond them (plan_build: as the plan's estimate charges them), every
    micro-batch's share, at its device and ``pace`` (without its stretch, which is what is
    measured against it); None if it is not seated.

    Without the top-k frames, C's last stage measured 0.077 s of own work a step under
    AdaTopK and 0.034 s once a plan sent its gradients in f16: the coding was counted as
    stretch, 2.83, which planned every member slower, which gave AdaTopK a larger budget
    and less to compress (session 17)."""
    seat = next(((k, s) for k, s in enumerate(plan.stages) if peer in s.peers), None)
    if seat is None:
        return None
    k, stage = seat
    share = stage.shares[stage.peers.index(peer)]
    frames = stage_frames(k, len(plan.stages)) * 2 * device.frame_overhead  # forward and back
    dense_s, coded = np.array(device.frame_overhead), topk_frames(plan.links, len(plan.stages))[k]
    topk = sum(
        float(topk_charge(work.frames, work.dense_bytes, dense_s=dense_s,
                          per_frame=np.array(device.topk_frame_overhead),
                          per_byte=np.array(device.topk_byte_cost),
                          factor=config.topk_frame_factor))
        for work in coded
    )  # fmt: skip
    return (compute_s + config.micro_batches * share * (frames + topk)) * pace


class StretchMeter:
    """The median of a node's last ``window`` measured/modelled ratios of its own work, as a
    published stretch (0.0 until a window is full: not measured). The first ``skip`` steps
    of each plan are left out: a fresh swarm's first steps run beside its first probes and
    plans (on C a 0.4-core home's own work took 3-5x its later steps in steps 4-10).

    The first figure is provisional: the next full window, of steps after it, publishes its
    own median whatever the band, and only then does the band hold. A swarm's first window
    still runs beside its first plans and probe rounds: on C the last stage's median fell by
    13% from steps 8-24 to the rest of the run, and the figure published in that window,
    2.83, held for the whole run (inside the band of a true ~2.2), the plan estimated at
    0.243 s for steps of 0.175 (session 17)."""

    def __init__(self, *, window: int = 16, skip: int = 8) -> None:
        if not 0 <= skip <= 1024:
            raise ConfigError(f"skip must be in [0, 1024], got {skip}")
        self.window, self.skip = RatioWindow(window), skip
        self._skipped = 0
        self.published = 0.0
        self._windows = 0  # full windows that published, up to 2: then the band holds

    def start_from(self, rehearsed: float) -> None:
        """Publish a rehearsal's figure (``rehearsed_stretch``) until our steps measure one:
        the first window after it publishes its own whatever the band, the next confirms."""
        if not 1.0 <= rehearsed <= MAX_STRETCH:
            raise ConfigError(f"a rehearsed stretch must be in [1, {MAX_STRETCH}], got {rehearsed}")
        self.published, self._windows = rehearsed, 0

    def add(self, own_s: float, predicted_s: float) -> float:
        """Note one step; the stretch to publish now."""
        if self._skipped < self.skip:
            self._skipped += 1
            return self.published
        median, held = self.window.add(own_s, predicted_s), self.published
        if median is None:
            return held
        if self._windows >= 2 and held / _HOLD <= max(1.0, median) <= held * _HOLD:
            return held
        if not self._windows:
            self.window.clear()  # the confirming window is of steps after this one
        self._windows = min(2, self._windows + 1)
        self.published = _quantized(median)
        return self.published

    def repaced(self, before: float, after: float) -> None:
        """Our pace moved from ``before`` to ``after``: the stretch was measured against the
        old one. Pace and stretch are planned as their product (``swarm_slowdown``), so the
        figure keeps that product, and is provisional again: the window measured against
        the old pace is dropped. On C a node published pace 2, and 2 s later a stretch of 2.0
        from a window measured mostly at pace 1: the swarm was planned at 4.0 (estimate 0.276
        s, steps 0.178) until a window at the new pace brought it back (session 17)."""
        if self.published:
            self.published = _quantized(self.published * before / after)
        self.window.clear()
        self._windows = min(self._windows, 1)

    def reset(self) -> None:
        """A new plan: another stage, measured afresh (the published stretch stands)."""
        self.window.clear()
        self._skipped = 0


def _quantized(ratio: float) -> float:
    """A measured ratio as published: its nearest power of ``STEP``, in [1, MAX_STRETCH]."""
    return min(MAX_STRETCH, STEP ** round(math.log(max(1.0, ratio), STEP)))


def swarm_slowdown(members: Mapping[str, NodeInfo]) -> float:
    """How many times its device's model every member is planned at, at least: the median
    (high) of what the members that train measured of their own work, pace and stretch
    together, 1.0 if none has. Together, as each stretch is measured against its node's own
    pace (pacing.py): on C, h1 published pace 2 and stretch 1.41, h2 pace 1 and stretch 2.83,
    both running at 2.83 times their device's model; h2's stretch on top of h1's pace planned
    h1 at 5.66, and the plan at 0.259 s for steps of 0.200 (issue 25, session 16)."""
    seen = sorted(i.pace * i.stretch for i in members.values() if i.stretch and not i.observer)
    return statistics.median_high(seen) if seen else 1.0


def as_planned(members: Mapping[str, NodeInfo]) -> dict[str, NodeInfo]:
    """``members`` as every planner plans them: each pace raised to what its witnesses saw
    (pace.py), and each stretch what brings pace and stretch up to the swarm's slowdown
    (``swarm_slowdown``): a member slower than that by its pace alone is planned at its pace."""
    out = with_witnessed_paces(members)
    typical = swarm_slowdown(members)
    planned = {}
    for peer, info in out.items():
        stretch = max(1.0, typical / info.pace)
        planned[peer] = info if info.stretch == stretch else dataclasses.replace(
            info, stretch=stretch
        )  # fmt: skip
    return planned


@dataclass(frozen=True, kw_only=True)
class Rehearsal:
    """What a rehearsal timed: the first ``stop`` graph nodes (a stage starting at node 0),
    ``batch`` sequences a micro-batch, ``micro_batches`` of them a step, ``steps`` steps of
    ``step_s`` wall seconds each on average."""

    stop: int
    batch: int
    micro_batches: int
    steps: int
    step_s: float

    def __post_init__(self) -> None:
        for name in ("stop", "batch", "micro_batches", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
                raise ConfigError(f"rehearsal {name} must be an int in [1, 2**20], got {value!r}")
        if not (isinstance(self.step_s, float) and math.isfinite(self.step_s) and self.step_s > 0):
            raise ConfigError(f"rehearsal step_s must be a positive float, got {self.step_s!r}")

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("stop", "batch", "micro_batches", "steps", "step_s")}

    @classmethod
    def from_json(cls, data: Any) -> "Rehearsal":
        if not isinstance(data, dict) or set(data) != {
            "stop", "batch", "micro_batches", "steps", "step_s"
        }:  # fmt: skip
            raise ConfigError(f"a rehearsal is a dict of its five fields, got {data!r}")
        return cls(**data)


def rehearsed_stretch(
    rehearsal: Rehearsal, costs: GraphCosts, device: DeviceInfo, config: PlanConfig
) -> float:
    """A rehearsal's step (rehearsal.py) against the planner's compute for the same nodes on
    ``device``, as a published stretch would read it. Refuses a rehearsal of another shape
    than ``config``'s micro-batches or of more nodes than the model has (ConfigError)."""
    per_micro_batch = config.batch_size / config.micro_batches
    if (rehearsal.micro_batches, rehearsal.batch) != (config.micro_batches, per_micro_batch):
        raise ConfigError(
            f"a rehearsal of {rehearsal.micro_batches} x {rehearsal.batch} sequences is not the "
            f"run's {config.micro_batches} x {per_micro_batch:g}"
        )
    if rehearsal.stop > len(costs.nodes):
        raise ConfigError(
            f"a rehearsal of {rehearsal.stop} nodes; the model has {len(costs.nodes)}"
        )
    modelled = nodes_compute_s(costs, 0, rehearsal.stop, device, config)
    return _quantized(rehearsal.step_s / modelled)
