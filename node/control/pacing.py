"""A daemon's pace bookkeeping: its own measured compute and what it witnessed of the others.

The trainer reports each step of the plan it runs (the plan's digest, our compute, every rank's
timings); this keeps the steps of the adopted plan only (the trainer runs the old plan to its
switch step, and a step of a three-stage plan read against a two-stage one is nonsense) and
feeds ``PaceMeter``/``PaceWitness`` (pace.py) and ``StretchMeter`` (stretch.py). Each method
says whether what our record carries changed, so the daemon can publish it at once.
"""

from collections.abc import Mapping

from fusionllm.common.errors import ConfigError
from fusionllm.common.logs import get_logger
from fusionllm.dag.graph import GraphCosts
from fusionllm.dag.planner import PlanConfig
from fusionllm.dht.records import DeviceInfo, NodeInfo
from fusionllm.node.control.agreement import Candidate
from fusionllm.node.control.pace import (
    LinkNow,
    PaceMeter,
    PaceWitness,
    Timing,
    checked_compute,
    nodes_compute_s,
    predicted_compute_s,
    ranks_fit,
)
from fusionllm.node.control.stretch import (
    Rehearsal,
    StretchMeter,
    predicted_own_s,
    rehearsed_stretch,
)

logger = get_logger(__name__)


class StepPacing:
    def __init__(self) -> None:
        self.meter = PaceMeter()  # our measured compute against our device's
        self.witness = PaceWitness()  # the other members' paces, from the step summaries
        self.stretch = StretchMeter()  # our own work in a step against the planner's model
        self._paced_plan: str | None = None  # the plan the meter's steps were measured in

    def rehearsed(
        self, rehearsal: Rehearsal | None, costs: GraphCosts, device: DeviceInfo,
        config: PlanConfig,
    ) -> float | None:  # fmt: skip
        """Start our stretch from a rehearsal of the run's first stage (rehearsal.py), if one
        was timed; the figure, or None."""
        if rehearsal is None:
            return None
        try:
            figure = rehearsed_stretch(rehearsal, costs, device, config)
        except ConfigError as exc:
            logger.warning("ignoring the rehearsal: %s", exc)
            return None
        self.stretch.start_from(figure)
        logger.info("a rehearsed step took %.3g s, %.3g x our device's model of it: our own "
                    "work is planned at %.3g x until our steps measure it", rehearsal.step_s,
                    rehearsal.step_s / nodes_compute_s(costs, 0, rehearsal.stop, device, config),
                    figure)  # fmt: skip
        return figure

    def measured(
        self, adopted: Candidate | None, digest: str, compute_s: float, own_s: float, *,
        costs: GraphCosts, peer_id: str, device: DeviceInfo, config: PlanConfig,
    ) -> bool:  # fmt: skip
        """One step's compute of our stage, and all our own work in it (``StepReport.own_s``),
        against what our device predicts for them."""
        if adopted is None or adopted.digest != digest:  # a step of the plan we switch from
            return False
        if adopted.digest != self._paced_plan:
            self.meter.reset()
            self.stretch.reset()
            self._paced_plan = adopted.digest
        predicted = predicted_compute_s(costs, adopted.plan, peer_id, device, config)
        if predicted is None:
            return False
        pace, stretch = self.meter.published, self.stretch.published
        own = predicted_own_s(adopted.plan, peer_id, device, config, compute_s=predicted, pace=pace)
        if own is not None and self.stretch.add(own_s, own) != stretch:
            logger.info("our own work in a step runs %.3g x the planner's model of it",
                        self.stretch.published)  # fmt: skip
        if self.meter.add(compute_s, predicted) != pace:
            self.stretch.repaced(pace, self.meter.published)
            logger.warning("our compute runs %.3g x what our device predicts: planned so from now",
                           self.meter.published)  # fmt: skip
        return (pace, stretch) != (self.meter.published, self.stretch.published)

    def witnessed(
        self, adopted: Candidate | None, digest: str, ranks: list[tuple[str, int]],
        timings: list[Timing], *, members: Mapping[str, NodeInfo], costs: GraphCosts,
        peer_id: str, config: PlanConfig, measured: LinkNow,
    ) -> bool:  # fmt: skip
        """Every other member's checked compute against what its advertised device predicts;
        ``measured``: what our book says each link costs now (pace.checked_compute)."""
        if (adopted is None or adopted.digest != digest or len(ranks) != len(timings)
                or not ranks_fit(adopted.plan, ranks)):  # fmt: skip
            return False
        checked = checked_compute(
            adopted.plan, [s for _, s in ranks], timings, config.micro_batches, measured
        )
        before = self.witness.current()
        for (peer, _), compute_s in zip(ranks, checked, strict=True):
            info = members.get(peer)
            if peer == peer_id or info is None:
                continue
            predicted = predicted_compute_s(costs, adopted.plan, peer, info.device, config)
            if predicted is not None:
                self.witness.add(adopted.digest, peer, compute_s, predicted)
        if self.witness.current() == before:
            return False
        logger.info("witnessed paces: %s", self.witness.current())
        return True
