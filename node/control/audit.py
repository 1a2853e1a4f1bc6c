"""Whether a proposal's claims hold in our own view: the rules and the numbers, checked here.

A proposal brings a plan and the figures that rank it. Nothing of that is trusted: the rules
(micro-batches, codecs, ratios, cut sizes, replica shares) must be exactly what the swarm's
settings and the planner's rules give, and every figure a proposer could shade to win (step
time, stage times, memory, bytes on the wire) is compared with the one we compute for the same
plan (``dag.plan_check.Retimer``). ``audit`` returns the worst ratio claimed / ours (the
*slack*) twice, and leaves the decision to the caller:

- ``Audit.view``: over every figure, those that hang on our bandwidth book included (link
  times, all-reduce, AdaTopK's bytes). Views differ by noise, so a claim may sit below ours by
  ``AuditLimits.tolerance``: the bar for a plan the swarm does not follow yet.
- ``Audit.own``: only what does not hang on our book: compute times and memory from the
  devices, the bytes AdaTopK puts on each link at the plan's *own* claimed bandwidth, and the
  step time by the plan's own figures (a number its own figures do not give is a lie in any
  view). The bar for the plan the swarm already follows:
  links measured under load drift by octaves, and re-judging a followed plan by today's
  samples would replace it every epoch (measured: a new digest per epoch while training).
"""

from collections.abc import Iterator
from dataclasses import dataclass

from fusionllm.common.errors import ConfigError
from fusionllm.dag.plan_check import Retimed
from fusionllm.dag.plan_records import Plan, PlanConfig
from fusionllm.dag.simulate import simulate
from fusionllm.dht.records import RecordError

# Plans travel with floats rounded to 12 significant digits (plan_records._canonical): a claim
# this close to ours is ours.
_ROUNDING = 1e-9


@dataclass(frozen=True, kw_only=True)
class AuditLimits:
    # A claim this far below our own figure is still believed. Books differ by grid steps (19%
    # a step on one link), and loopback links measured under training load drift by octaves
    # between epochs: a node refused its own 2-replica proposal 2 s after making it (all-reduce
    # claimed 0.096 s, 0.157 s in its newer view), and the swarm never agreed on a replicated
    # plan with 0.05. A liar gains at most this factor on what hangs on bandwidth; compute and
    # memory stay held to own_tolerance.
    tolerance: float = 0.5
    # Figures that do not hang on a bandwidth view are the same everywhere (but rounding).
    own_tolerance: float = 0.01
    # AdaTopK's bytes swing with the bandwidth (a link at its budget's edge flips from dense to
    # top-k); new proposals' views differ most while probes come in: compressing up to twice
    # what the rule gives at our bandwidth is believed (measured: 2.7x once at start-up).
    compression_tolerance: float = 0.5
    # Shares follow from device records alone, which every node reads alike.
    share_tolerance: float = 1e-6
    # A link we have not measured is estimated from its ends' records, which under-read a fast
    # link by ~5x on the testbed before the first probes: there a claim is believed up to this
    # factor above our estimate (Retimer's unmeasured_trust), and a liar gains no more.
    unmeasured_trust: float = 8.0

    def __post_init__(self) -> None:
        for name in ("tolerance", "own_tolerance", "compression_tolerance"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not 1.0 <= self.unmeasured_trust <= 64.0:
            raise ConfigError(f"unmeasured_trust must be in [1, 64], got {self.unmeasured_trust}")
        if not 0 <= self.share_tolerance < 0.01:
            raise ConfigError(f"share_tolerance must be in [0, 0.01), got {self.share_tolerance}")


@dataclass(frozen=True)
class Finding:
    slack: float  # min over the figures of claimed / ours, at most 1.0
    figure: str  # the figure that set it ("" when every claim is at least ours)
    claimed: float
    ours: float

    def __str__(self) -> str:
        if not self.figure:
            return "every figure at least ours"
        return f"{self.figure}: claims {self.claimed:.6g}, we compute {self.ours:.6g}"


CLEAN = Finding(1.0, "", 0.0, 0.0)


@dataclass(frozen=True)
class Audit:
    view: Finding = CLEAN  # every figure, against our view of the links
    own: Finding = CLEAN  # only figures no bandwidth view changes
    compression: Finding = CLEAN  # wire bytes against AdaTopK at the bandwidth we see

    def __str__(self) -> str:
        return str(min(self.view, self.compression, key=_slack))

    def believable(self, limits: "AuditLimits") -> bool:
        """The bar for a plan the swarm does not follow yet: every figure near ours."""
        return (
            self.view.slack >= 1.0 - limits.tolerance
            and self.compression.slack >= 1.0 - limits.compression_tolerance
        )

    def consistent(self, limits: "AuditLimits") -> bool:
        """The bar for a plan the swarm follows: the figures no bandwidth view changes."""
        return self.own.slack >= 1.0 - limits.own_tolerance


def audit(claimed: Plan, retimed: Retimed, config: PlanConfig, limits: AuditLimits) -> Audit:
    """How far ``claimed`` understates its figures against ``retimed`` (``Retimer.retime`` of
    it, which already refused codecs the rule never makes); RecordError where it breaks a rule."""
    ours = retimed.plan
    if claimed.micro_batches != config.micro_batches:
        raise RecordError(
            f"plan runs {claimed.micro_batches} micro-batches, the swarm {config.micro_batches}"
        )
    if len(claimed.stages) != len(ours.stages) or len(claimed.links) != len(ours.links):
        raise RecordError("plan and its recomputation differ in shape")
    for k, (mine, theirs) in enumerate(zip(ours.stages, claimed.stages, strict=True)):
        off = max(abs(a - b) for a, b in zip(mine.shares, theirs.shares, strict=True))
        if off > limits.share_tolerance:
            raise RecordError(
                f"stage {k} shares differ from the micro-batches its replicas run by {off:.3g}"
            )
    for k, (mine, theirs) in enumerate(zip(ours.links, claimed.links, strict=True)):
        if theirs.dense_bytes != mine.dense_bytes:
            raise RecordError(
                f"link {k} carries {theirs.dense_bytes} dense bytes, our model {mine.dense_bytes}"
            )
        for way in ("forward", "backward"):
            wire, codec = f"{way}_wire_bytes", getattr(theirs, f"{way}_codec")
            if getattr(theirs, wire) != getattr(mine, wire):
                raise RecordError(f"link {k} {way}: {codec} at {getattr(theirs, f'{way}_ratio')} "
                                  f"puts {getattr(mine, wire)} bytes on the wire")  # fmt: skip
    own = _worst(_own_figures(claimed, retimed))
    view = min(own, _worst(_view_figures(claimed, retimed)), key=_slack)
    return Audit(view=view, own=own, compression=_worst(_wire_figures(claimed, retimed.ours)))


def _slack(finding: Finding) -> float:
    return finding.slack


def _worst(figures: Iterator[tuple[str, float, float]]) -> Finding:
    worst = CLEAN
    for what, claim, own in figures:
        if claim < 0:
            raise RecordError(f"{what} is negative: {claim:.6g}")
        if claim < own * (1 - _ROUNDING) and claim / own < worst.slack:  # hence own > 0
            worst = Finding(claim / own, what, claim, own)
    return worst


def _own_figures(claimed: Plan, retimed: Retimed) -> Iterator[tuple[str, float, float]]:
    """(what, claimed, ours) for the figures no bandwidth view changes."""
    ours = retimed.plan
    try:
        by_its_figures = simulate(claimed.pipeline_times()).step_time
    except (ConfigError, ArithmeticError) as exc:  # negative times, a link of 0 B/s, ...
        raise RecordError(f"plan's own figures do not time a step: {exc}") from exc
    yield "estimated step time (by its own figures)", claimed.estimated_step_time, by_its_figures
    for k, (theirs, mine) in enumerate(zip(claimed.stages, ours.stages, strict=True)):
        yield f"stage {k} forward time", theirs.forward_time, mine.forward_time
        yield f"stage {k} backward time", theirs.backward_time, mine.backward_time
        for peer, a, b in zip(mine.peers, theirs.memory_bytes, mine.memory_bytes, strict=True):
            yield f"stage {k} memory on {peer[:16]}...", float(a), float(b)
    for k, (theirs, rule) in enumerate(zip(claimed.links, retimed.rule, strict=True)):
        # Fewer bytes than AdaTopK gives at the plan's own bandwidth: compressed beyond the rule.
        yield f"link {k} forward wire bytes", theirs.forward_wire_bytes, rule.forward_wire_bytes
        yield f"link {k} backward wire bytes", theirs.backward_wire_bytes, rule.backward_wire_bytes


def _view_figures(claimed: Plan, retimed: Retimed) -> Iterator[tuple[str, float, float]]:
    """(what, claimed, ours) for the figures our bandwidth book enters."""
    ours = retimed.plan
    yield "estimated step time", claimed.estimated_step_time, ours.estimated_step_time
    for k, (theirs, mine) in enumerate(zip(claimed.stages, ours.stages, strict=True)):
        yield f"stage {k} all-reduce time", theirs.allreduce_time, mine.allreduce_time


def _wire_figures(claimed: Plan, ours: tuple) -> Iterator[tuple[str, float, float]]:
    """(what, claimed, ours): bytes on each link against AdaTopK at the bandwidth we see."""
    for k, (theirs, mine) in enumerate(zip(claimed.links, ours, strict=True)):
        yield f"link {k} forward wire bytes (at our bandwidth)", theirs.forward_wire_bytes, \
            mine.forward_wire_bytes  # fmt: skip
        yield f"link {k} backward wire bytes (at our bandwidth)", theirs.backward_wire_bytes, \
            mine.backward_wire_bytes  # fmt: skip
