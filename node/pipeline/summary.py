"""A step's summary: what every process of a run tells every other before the optimizer step.

One float64 tensor of ``SUMMARY_LEN`` per process, sent to all others (runner.py's all-gather):

    [squared gradient norm, loss sum, loss count, plan vote, overflow, eval sum, eval count,
     compute s, activation wait s, gradient wait s]

``overflow`` is 1.0 where that process saw an inf/NaN gradient in an fp16 step (loss_scale.py):
every process then skips the step together. The eval sums are the validation losses of an
evaluation step (evaluation.py; 0 elsewhere). The last three are that process's step timings:
its forwards' and backwards' compute, and how long its schedule waited for activations and
for gradients; every member witnesses every other's pace from them (control/pace.py), and a
neighbour's waits check what a member says it computed. Pure functions; the runner sends and
takes them.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fusionllm.node.errors import PipelineError

SUMMARY_LEN = 10
_MAX_SECONDS = 1e6  # a step's timing; more is a lie or a broken clock


@dataclass(frozen=True)
class Summary:
    sq: float  # this process's share of the squared global gradient norm
    loss_sum: float
    loss_count: int
    vote: float
    overflow: bool = False
    eval_sum: float = 0.0
    eval_count: int = 0
    busy_s: float = 0.0
    wait_in_s: float = 0.0  # for activations
    wait_out_s: float = 0.0  # for gradients

    def to_tensor(self) -> torch.Tensor:
        values = [self.sq, self.loss_sum, float(self.loss_count), self.vote, float(self.overflow),
                  self.eval_sum, float(self.eval_count), self.busy_s, self.wait_in_s,
                  self.wait_out_s]  # fmt: skip
        return torch.tensor(values, dtype=torch.float64)  # (SUMMARY_LEN,)

    @classmethod
    def from_tensor(cls, part: torch.Tensor, *, step: int, sender: object) -> "Summary":
        """A peer's summary, checked (PipelineError naming the sender otherwise)."""
        bad = (
            tuple(part.shape) != (SUMMARY_LEN,)
            or not bool(torch.isfinite(part).all())
            or part[0] < 0
            or part[2] < 0
            or part[6] < 0
            or float(part[4]) not in (0.0, 1.0)
            or not bool(((part[7:] >= 0) & (part[7:] <= _MAX_SECONDS)).all())
        )
        if bad:
            raise PipelineError(f"step {step}: bad summary {part.tolist()} from {sender}")
        sq, loss_sum, count, vote, overflow, eval_sum, eval_count, *times = part.tolist()
        return cls(sq, loss_sum, round(count), vote, overflow == 1.0, eval_sum, round(eval_count),
                   *times)  # fmt: skip


@dataclass(frozen=True)
class StepTotals:
    sq: float
    loss_sum: float
    loss_count: int
    votes: tuple[float, ...]  # in rank order
    overflow: bool  # any process's
    eval_sum: float = 0.0
    eval_count: int = 0
    # (compute s, activation wait s, gradient wait s) of every process, in rank order
    timings: tuple[tuple[float, float, float], ...] = ()


def combine(parts: Sequence[Summary]) -> StepTotals:
    """The all-gather's result, the same on every process (rank order, float64 sums)."""
    total = torch.zeros(5, dtype=torch.float64)
    for part in parts:
        values = [part.sq, part.loss_sum, float(part.loss_count), part.eval_sum, part.eval_count]
        total += torch.tensor(values, dtype=torch.float64)
    return StepTotals(
        sq=float(total[0]),
        loss_sum=float(total[1]),
        loss_count=round(float(total[2])),
        votes=tuple(p.vote for p in parts),
        overflow=any(p.overflow for p in parts),
        eval_sum=float(total[3]),
        eval_count=round(float(total[4])),
        timings=tuple((p.busy_s, p.wait_in_s, p.wait_out_s) for p in parts),
    )
