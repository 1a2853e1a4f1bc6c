"""Discrete-event simulator of one training step: 1F1B over S stages and M micro-batches.

Every plan (OP-Fence's, a baseline's, the brute-force optimum's) is reduced to PipelineTimes and
timed here, so methods are compared on equal terms. Model: a stage runs one operation at a time
in the 1F1B order (warm-up forwards, one-forward-one-backward, cool-down backwards); a stage's
sends, activations forward and gradients back alike, leave through its one uplink: a FIFO busy
for the serialisation time of each transfer, which then arrives after the link's one-way
latency (so a step pays the 2(S-1) one-way latencies of the pipeline's fill and drain); a
stage averages its gradients inside its fence after its last backward (no overlap with
compute: conservative, and the same for every method).

Why one uplink per stage and not one resource per link direction: a middle stage's forward
and backward sends go to two peers over the same access link. On the testbed's topology C a
0.2-core host on an 8 Mbit/s uplink sent 874 KB forward and 868 KB back per step; timed as two
independent links, the naive plan ran at 2.07 s; at the configured caps this model says
1.56 s, the old one 1.32 (docs/results.md, benchmarks/testbed_estimates.py).

The step's summary all-gather (node/pipeline/runner.py) is not timed: every stage but the one
counting a tied parameter sends its summary before the tied sums, so the summaries stage 0
waits for left their stages before its last backward ended and are there when it ends.
"""

import math
from dataclasses import dataclass

from fusionllm.common.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class PipelineTimes:
    """Per micro-batch times (s). Link k joins stage k and k+1; its lists have S-1 entries."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    send_forward: tuple[float, ...] = ()  # serialisation of an activation, stage k -> k+1
    send_backward: tuple[float, ...] = ()  # serialisation of a gradient, stage k+1 -> k
    latency_forward: tuple[float, ...] = ()
    latency_backward: tuple[float, ...] = ()
    allreduce: tuple[float, ...] = ()  # once per step, per stage
    micro_batches: int = 1

    def __post_init__(self) -> None:
        s = len(self.forward)
        if s == 0:
            raise ConfigError("a pipeline needs at least one stage")
        if len(self.backward) != s:
            raise ConfigError(f"{s} forward times but {len(self.backward)} backward times")
        for name in ("send_forward", "send_backward", "latency_forward", "latency_backward"):
            n = len(getattr(self, name))
            if n not in (0, s - 1):
                raise ConfigError(f"{name} needs {s - 1} entries (or none), got {n}")
        if len(self.allreduce) not in (0, s):
            raise ConfigError(f"allreduce needs {s} entries (or none), got {len(self.allreduce)}")
        if self.micro_batches < 1:
            raise ConfigError(f"micro_batches must be >= 1, got {self.micro_batches}")
        for name in (
            "forward",
            "backward",
            "send_forward",
            "send_backward",
            "latency_forward",
            "latency_backward",
            "allreduce",
        ):
            bad = [x for x in getattr(self, name) if not (math.isfinite(x) and x >= 0)]
            if bad:
                raise ConfigError(f"{name} times must be finite and >= 0, got {bad[:3]}")

    @property
    def stages(self) -> int:
        return len(self.forward)


@dataclass(frozen=True, kw_only=True)
class SimResult:
    step_time: float
    bubble_fraction: float  # idle share of stage-time over the step (compute only)
    stage_finish: tuple[float, ...]  # when each stage's gradients are averaged


def _schedule(stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """1F1B order on one stage: stage s keeps at most S - s micro-batches in flight."""
    warmup = min(stages - stage - 1, micro_batches)
    order = [("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        order.append(("F", warmup + i))
        order.append(("B", i))
    order += [("B", i) for i in range(micro_batches - warmup, micro_batches)]
    return order


def simulate(times: PipelineTimes) -> SimResult:
    """Time one step; exact for the model in the module docstring."""
    s_count, m = times.stages, times.micro_batches

    def link_list(values: tuple[float, ...]) -> tuple[float, ...]:
        return values if values else (0.0,) * (s_count - 1)

    send_f, send_b = link_list(times.send_forward), link_list(times.send_backward)
    lat_f, lat_b = link_list(times.latency_forward), link_list(times.latency_backward)
    allreduce = times.allreduce or (0.0,) * s_count
    # arrive_f[s][i]: activation of micro-batch i available at stage s; arrive_b likewise.
    arrive_f = [[0.0 if s == 0 else math.nan] * m for s in range(s_count)]
    arrive_b = [[math.nan] * m for _ in range(s_count)]
    uplink_free = [0.0] * s_count  # when each stage's uplink is next free
    forward_done = [[math.nan] * m for _ in range(s_count)]
    schedules = [_schedule(s, s_count, m) for s in range(s_count)]
    cursor = [0] * s_count
    clock = [0.0] * s_count
    busy = [0.0] * s_count
    remaining = sum(len(x) for x in schedules)
    while remaining:
        progressed = False
        for s in range(s_count):
            while cursor[s] < len(schedules[s]):
                kind, i = schedules[s][cursor[s]]
                if kind == "F":
                    ready = arrive_f[s][i]
                else:
                    ready = forward_done[s][i] if s == s_count - 1 else arrive_b[s][i]
                if math.isnan(ready):
                    break
                start = max(clock[s], ready)
                duration = times.forward[s] if kind == "F" else times.backward[s]
                clock[s] = start + duration
                busy[s] += duration
                if kind == "F":
                    forward_done[s][i] = clock[s]
                    if s < s_count - 1:
                        uplink_free[s] = max(clock[s], uplink_free[s]) + send_f[s]
                        arrive_f[s + 1][i] = uplink_free[s] + lat_f[s]
                elif s > 0:
                    uplink_free[s] = max(clock[s], uplink_free[s]) + send_b[s - 1]
                    arrive_b[s - 1][i] = uplink_free[s] + lat_b[s - 1]
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen with a 1F1B order; guards against a bad edit
            raise RuntimeError(f"pipeline deadlock at cursors {cursor}")
    finish = tuple(clock[s] + allreduce[s] for s in range(s_count))
    step = max(finish)
    bubble = 1.0 - sum(busy) / (s_count * step) if step > 0 else 0.0
    return SimResult(step_time=step, bubble_fraction=bubble, stage_finish=finish)
