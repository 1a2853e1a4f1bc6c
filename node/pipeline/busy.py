"""How long a stage's forwards and backwards computed, on the device that ran them.

On a CPU, the host's wall time around ``StageWorker.forward``/``backward`` is the compute. On
a CUDA device those calls return once their kernels are queued: the wall time counts launches,
and the kernels' time lands in whatever waits next (a frame's copy to the host, the loss).
``StepReport.busy_s`` feeds the measured pace (control/pace.py), so there each call is
bracketed by CUDA events on the stage's stream instead, and the step reads their elapsed
times once, at the end of its schedule (one synchronize per step, where the losses are
needed anyway). ``compute_clock`` picks by device; the CPU path is the wall clock, unchanged.
"""

import time

import torch

from fusionllm.node.pipeline.compute import Compute


class WallClock:
    """CPU compute: the wall time around each call."""

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, mark: float) -> float:
        """Seconds since ``mark``: counted at once."""
        return time.perf_counter() - mark

    def settle(self, busy_s: float) -> float:
        """The step's compute: what ``stop`` returned, summed by the caller."""
        return busy_s


class CudaEventClock:
    """CUDA compute: events around each call, read once per step."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return event

    def start(self) -> torch.cuda.Event:
        return self._event()

    def stop(self, mark: torch.cuda.Event) -> float:
        """0 now: the kernels may still run; ``settle`` counts them."""
        self._pairs.append((mark, self._event()))
        return 0.0

    def settle(self, busy_s: float) -> float:
        """The step's kernel time between each start and stop, in seconds (waits for the last
        stop's kernels). ``busy_s`` (the zeros ``stop`` returned) is not used."""
        if not self._pairs:
            return 0.0
        self._pairs[-1][1].synchronize()
        total_ms = sum(start.elapsed_time(end) for start, end in self._pairs)
        self._pairs.clear()
        return total_ms / 1e3


def compute_clock(compute: Compute) -> WallClock | CudaEventClock:
    """The clock for a stage's compute on ``compute``'s device."""
    return CudaEventClock(compute.device) if compute.is_cuda else WallClock()
