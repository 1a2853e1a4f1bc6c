"""Dynamic loss scaling for fp16 runs, with torch.amp.GradScaler's semantics, for a pipeline.

float16 gradients of small magnitude flush to zero, so the last stage multiplies the loss by a
scale S before the backward and every gradient (link gradients between stages included) is
S times its true value; before the step each stage divides its parameter gradients by S.
When any gradient overflowed (inf or NaN) on any stage, every stage skips that step together
and S halves; after ``growth_interval`` steps in a row without one, S doubles.

Unlike GradScaler, the decision is the whole pipeline's: each process sends whether it saw an
overflow in the step's summary (runner.py), and every process updates its ``LossScale`` with
the same "any" of those flags, so the scales of all stages stay equal without being sent. S is
a power of two, so unscaling is exact: scaling a sum or summing the scaled parts give the
same bits. The scale and its run of good steps (``ScaleState``) are saved with a stage's
checkpoints and copies, and every member of a new plan restores the state of the step they
all resume from (training/session.py), so a plan change neither forgets nor splits it.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from fusionllm.common.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    init_scale: float = 2.0**16  # GradScaler's defaults
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        power_of_two = math.frexp(self.init_scale)[0] == 0.5
        if not (power_of_two and 1.0 <= self.init_scale <= 2.0**120):
            raise ConfigError(
                f"init_scale must be a power of two in [1, 2**120], got {self.init_scale}"
            )
        if self.growth_interval < 1:
            raise ConfigError(f"growth_interval must be >= 1, got {self.growth_interval}")


_MAX_SCALE = 2.0**120
_MAX_GOOD_STEPS = 1 << 30


class ScaleState(NamedTuple):
    """What a LossScale is between steps; from a file or a peer, checked (``checked``)."""

    scale: float
    good_steps: int

    @classmethod
    def checked(cls, scale: object, good_steps: object) -> "ScaleState":
        """ValueError unless ``scale`` is a power of two in [1, 2**120] and ``good_steps`` a
        whole number in [0, 2**30) (a float64 slot or a tensor carries it)."""
        value = float(scale)  # type: ignore[arg-type]
        if not (math.isfinite(value) and 1.0 <= value <= _MAX_SCALE):
            raise ValueError(f"loss scale must be in [1, 2**120], got {value}")
        if math.frexp(value)[0] != 0.5:
            raise ValueError(f"loss scale must be a power of two, got {value}")
        good = float(good_steps)  # type: ignore[arg-type]
        if not (0 <= good < _MAX_GOOD_STEPS and good == int(good)):
            raise ValueError(f"good steps must be a whole number in [0, 2**30), got {good}")
        return cls(value, int(good))


class LossScale:
    """The current scale and the run of good steps since the last change."""

    def __init__(self, config: LossScaleConfig | None = None) -> None:
        self.config = config if config is not None else LossScaleConfig()
        self.scale = float(self.config.init_scale)
        self.good_steps = 0

    def state(self) -> ScaleState:
        return ScaleState(self.scale, self.good_steps)

    def restore(self, state: ScaleState) -> None:
        """Continue from a saved state (a run of good steps past our interval grows next)."""
        self.scale, self.good_steps = state.scale, state.good_steps

    def update(self, overflow: bool) -> None:
        """After a step: halve on an overflow anywhere (never below 1), double after
        ``growth_interval`` good steps in a row (never above 2**120)."""
        if overflow:
            self.scale = max(self.scale / 2.0, 1.0)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.config.growth_interval:
            self.scale = min(self.scale * 2.0, _MAX_SCALE)
            self.good_steps = 0


def unscale_or_zero(grads: Sequence[torch.Tensor], scale: float) -> bool:
    """Divide the gradients by ``scale`` in place and return False, or, if any element is
    inf or NaN, zero them all (what is sent on must stay finite: peers refuse non-finite
    frames) and return True. One device sync, for the whole list."""
    if not grads:
        return False
    peaks = torch._foreach_norm(list(grads), float("inf"))  # max |g| per tensor; NaN stays NaN
    if not bool(torch.isfinite(torch.stack(peaks)).all()):
        torch._foreach_zero_(list(grads))
        return True
    torch._foreach_mul_(list(grads), 1.0 / scale)
    return False
