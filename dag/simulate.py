"""Discrete-event simulator of one training step: 1F1B over S stages and M micro-batches.

Every plan (OP-Fence's, a baseline's, the brute-force optimum's) is reduced to PipelineTimes and
timed here, so methods are compared on equal terms. Model: a stage runs one operation at a time
in the 1F1B order (warm-up forwards, one-forward-one-backward, cool-down backwards); a stage's
sends, activations forward and gradients back alike, leave through its one uplink: a FIFO busy
for the serialisation time of each transfer, which then arrives after the link's one-way
latency (so a step pays the 2(S-1) one-way latencies of the pipeline's fill and drain); a
frame on a connection that sat idle past its retransmission timeout starts from a smaller
TCP window and slow-starts (tcp_window.py: on slow, distant links that doubles a frame); a
stage averages its gradients inside its fence after its last backward (no overlap with
compute: conservative, and the same for every method).

Why one uplink per stage and not one resource per link direction: a middle stage's forward
and backward sends go to two peers over the same access link. On the testbed's topology C a
0.2-core host on an 8 Mbit/s uplink sent 874 KB forward and 868 KB back per step; timed as two
independent links, the naive plan ran at 2.07 s; at the configured caps this model says
1.56 s, the old one 1.32 (docs/results.md, benchmarks/testbed_estimates.py).

The step's summary all-gather (node/pipeline/runner.py) is not timed: every stage but the one
counting a tied parameter sends its summary before the tied sums, so the summaries stage 0
waits for left their stages before its last backward ended and are there when it ends. The
tied sums' frames are: a stage's ``allreduce`` term carries them too (tied_exchange.py).
"""

import math
from dataclasses import dataclass

from fusionllm.common.errors import ConfigError
from fusionllm.dag.tcp_window import send_time, window_after_idle

_LINK_FIELDS = (
    "send_forward",
    "send_backward",
    "latency_forward",
    "latency_backward",
    "bytes_forward",
    "bytes_backward",
)


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
    # A frame's bytes per link and direction. Given, a frame on a connection that sat idle
    # past its retransmission timeout restarts from a smaller window (tcp_window.py); the
    # link's bandwidth is then bytes over its send time, its round trip twice the latency.
    bytes_forward: tuple[float, ...] = ()
    bytes_backward: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        s = len(self.forward)
        if s == 0:
            raise ConfigError("a pipeline needs at least one stage")
        if len(self.backward) != s:
            raise ConfigError(f"{s} forward times but {len(self.backward)} backward times")
        for name in _LINK_FIELDS:
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
            "bytes_forward",
            "bytes_backward",
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


class _Uplinks:
    """Each stage's uplink (one FIFO for its frames both ways) and, where frame bytes are
    given, each connection's silence: connection (k, +1) carries link k's activations, (k, -1)
    its gradients. ``last``: when each connection last sent, relative to this step's start
    (negative: in the step before)."""

    def __init__(self, times: PipelineTimes, last: dict[tuple[int, int], float]) -> None:
        s_count = times.stages
        self.last = dict(last)
        self.free = [0.0] * s_count
        self.send = {
            +1: _links(times.send_forward, s_count),
            -1: _links(times.send_backward, s_count),
        }
        self.lat = {
            +1: _links(times.latency_forward, s_count),
            -1: _links(times.latency_backward, s_count),
        }
        self.nbytes = {+1: times.bytes_forward, -1: times.bytes_backward}

    def send_frame(self, stage: int, link: int, way: int, ready: float) -> float:
        """Stage ``stage`` sends a frame of ``link`` (way +1: forward) once it is ``ready``;
        when it arrives."""
        start = max(ready, self.free[stage])
        seconds, lat = self.send[way][link], self.lat[way][link]
        nbytes = self.nbytes[way][link] if self.nbytes[way] else 0.0
        if nbytes > 0 and seconds > 0:
            bandwidth, rtt = nbytes / seconds, 2 * lat
            idle = start - self.last.get((link, way), start)
            window = window_after_idle(idle, rtt, bandwidth)
            seconds = send_time(nbytes, bandwidth, rtt, window)
        self.free[stage] = start + seconds
        self.last[(link, way)] = self.free[stage]
        return self.free[stage] + lat


def _links(values: tuple[float, ...], s_count: int) -> tuple[float, ...]:
    return values if values else (0.0,) * (s_count - 1)


def simulate(times: PipelineTimes) -> SimResult:
    """Time one step; exact for the model in the module docstring. With frame bytes, the step
    runs twice: the second starts each connection as the first left it, a step earlier. A
    stage's step summary (runner.py) leaves on every connection it has as its schedule ends,
    so none of them has been silent since before that."""
    result, last, ends = _run(times, {})
    if not (times.bytes_forward or times.bytes_backward):
        return result
    carried = {}
    for (link, way), at in last.items():
        sender = link if way > 0 else link + 1
        carried[(link, way)] = max(at, ends[sender]) - result.step_time
    return _run(times, carried)[0]


def _run(
    times: PipelineTimes, last: dict[tuple[int, int], float]
) -> tuple[SimResult, dict[tuple[int, int], float], list[float]]:
    """One step from connections last used at ``last``: its result, when each last sent, and
    when each stage's schedule ended (its summary leaves then)."""
    s_count, m = times.stages, times.micro_batches
    allreduce = times.allreduce or (0.0,) * s_count
    uplinks = _Uplinks(times, last)
    # arrive_f[s][i]: activation of micro-batch i available at stage s; arrive_b likewise.
    arrive_f = [[0.0 if s == 0 else math.nan] * m for s in range(s_count)]
    arrive_b = [[math.nan] * m for _ in range(s_count)]
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
                        arrive_f[s + 1][i] = uplinks.send_frame(s, s, +1, clock[s])
                elif s > 0:
                    arrive_b[s - 1][i] = uplinks.send_frame(s, s - 1, -1, clock[s])
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen with a 1F1B order; guards against a bad edit
            raise RuntimeError(f"pipeline deadlock at cursors {cursor}")
    finish = tuple(clock[s] + allreduce[s] for s in range(s_count))
    step = max(finish)
    bubble = 1.0 - sum(busy) / (s_count * step) if step > 0 else 0.0
    result = SimResult(step_time=step, bubble_fraction=bubble, stage_finish=finish)
    return result, uplinks.last, clock
