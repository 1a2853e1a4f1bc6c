"""A bulk probe on a lane: filler frames back to back, timed by the kernel as they drain.

On a host whose CPU share is taken by training, the probe paced by Python (probes.py: noise
and yamux in the node's trio thread) reads a 1 Gbit/s link at 3-35 MB/s of 125 (issue 25),
and a lane's training frames (128 KiB of tiny's activations, 20 ms apart) never fill the pipe
long enough for the kernel to time it. A bulk probe writes ``nbytes`` of filler frames on the
lane (kernel-paced ``sendall``: the socket takes them as fast as the link drains) and reads
``TCP_INFO`` after each frame and while the rest drains; the figure is the best but one of
the kernel's rate samples taken while data was queued (wire_meter.trusted), each after
``nbytes // samples`` more bytes were acknowledged, with the kernel's minimum RTT. Measured
on the testbed (docs/testbed.md): 1 MiB frames back to back read 91-124 MB/s of 125 with
0-4 busy loops in the sender's 0.45-core share.

Why the best but one, not the median (session 13, topology C): a kernel rate sample spans at
least a round trip of sends and of ACKs, so it reads the path low, never high, unless ACKs
arrive bunched; slow start on a new lane, a loss's recovery in the middle of the probe (a
home uplink's deep queue overflowing) and a peer whose own uplink delays our ACKs all pull
samples down. The median of a 1 MiB probe read 0.58-0.82 of a 2.5-12.5 MB/s cap on the
first probe of far or small links where the probe's best samples read 0.90-0.96 of it; one
bunched sample cannot set the figure.

Why frames of an eighth of the probe, and why a probe may go on (session 14, topology C):
with 1 MiB frames the kernel was read only after the write, which returns once most of the
frame is acknowledged, so a probe counted 2-7 samples, and with two the best but one is the
slower (h4 -> h5 read 0.48 of 1.25 MB/s from samples of 0.48 and 1.21). And a far link's
probe ended in slow start (h1 -> h5, 5 MB/s at 80 ms: 1.1 -> 3.9 MB/s), so while the kernel
still doubles its window the probe writes on, up to ``extend`` times its bytes, until it
has counted ``settled`` samples after slow start.

The lane is taken only if free within ``lock_wait_s`` (a training frame has the lane first);
the receiver reads filler frames within the same budgets as tensors and drops them
(lane/serve.py). Not a frame of ours, so a stream refuses it (inbound.py).
"""

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from fusionllm.common.errors import ConfigError
from fusionllm.node.p2p.framing import MAX_FILLER_BYTES, FrameHeader, FrameKind, encode_head
from fusionllm.node.p2p.lane.stream import LaneWriter
from fusionllm.node.p2p.lane.tcp_info import TcpInfo, TcpInfoError
from fusionllm.node.p2p.lane.wire_meter import WireSample, trusted

# A stream probe's deadline too (ControlConfig.probe_timeout_s): 1 MiB at 8 Mbit/s is ~1 s.
BULK_TIMEOUT_S = 5.0
# A kernel sample may read over the path where ACKs come bunched: h1 -> h4 on topology C read
# 8.7-9.0 MB/s of 6.25 in slow start (session 14). The bytes acknowledged over a few round
# trips can less, so no figure exceeds that average by more than the slack. Not a floor: where
# the peer's uplink is busy our ACKs queue behind its data and come out bunched as its queue
# drains, and the average over 4 round trips read 1.36x the cap (h3 -> h5, h5 -> h3).
GOODPUT_RTTS = 4
GOODPUT_MIN_SPAN_S = 0.05
GOODPUT_SLACK = 1.1
_FILLER_HEAD = FrameHeader(step=0, micro_batch=0, kind=FrameKind.FILLER, stage=0)


@dataclass(frozen=True, kw_only=True)
class BulkConfig:
    frame_bytes: int = 1 << 20
    lock_wait_s: float = 0.05  # a lane busy with training frames longer than this: skipped
    poll_s: float = 0.001  # how often TCP_INFO is read while the frames drain
    samples: int = 8  # a rate sample counts after nbytes // samples more bytes were acked
    # A probe whose kernel still doubles its window after nbytes goes on, up to this many
    # times nbytes, until it has counted ``settled`` samples past slow start.
    extend: int = 4
    settled: int = 2
    min_frame_bytes: int = 16 << 10

    def __post_init__(self) -> None:
        for name in ("frame_bytes", "samples", "extend", "settled", "min_frame_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if self.frame_bytes > MAX_FILLER_BYTES:
            raise ConfigError(f"frame_bytes {self.frame_bytes} is over {MAX_FILLER_BYTES}")
        for name in ("lock_wait_s", "poll_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 <= value <= 10):
                raise ConfigError(f"{name} must be in [0, 10] s, got {value!r}")


def counted_samples(
    start: TcpInfo, readings: Iterable[tuple[TcpInfo, float]], *, min_bytes: int
) -> list[tuple[TcpInfo, float]]:
    """The readings that count as rate samples: trusted, each once ``min_bytes`` more were
    acknowledged than at the last one counted (a rate the kernel did not renew must not count
    twice)."""
    if min_bytes < 1:
        raise ValueError(f"min_bytes must be >= 1, got {min_bytes}")
    acked, counted = start.bytes_acked, []
    for info, at in readings:
        if trusted(info) and info.bytes_acked - acked >= min_bytes:
            acked = info.bytes_acked
            counted.append((info, at))
    return counted


def bulk_figure(
    start: TcpInfo, readings: Iterable[tuple[TcpInfo, float]], *, min_bytes: int
) -> WireSample | None:
    """The link's figure from the kernel's readings (with the wall clock they were read at)
    during a bulk probe that began at ``start``: the best but one of the counted samples
    (``counted_samples``; the only one, where one was), never over ``GOODPUT_SLACK`` times
    the best ``goodput`` the probe kept up, with the least minimum RTT; None where none
    counted."""
    readings = list(readings)
    counted = counted_samples(start, readings, min_bytes=min_bytes)
    if not counted:
        return None
    rates = sorted(info.delivery_rate for info, _ in counted)
    figure = rates[-2] if len(rates) > 1 else rates[0]
    min_rtt = min(i.min_rtt_s for i, _ in counted)
    kept_up = goodput(readings, min_span_s=max(GOODPUT_RTTS * min_rtt, GOODPUT_MIN_SPAN_S))
    if kept_up is not None:
        figure = min(figure, GOODPUT_SLACK * kept_up)
    return WireSample(figure, min_rtt, counted[-1][1])


def goodput(readings: list[tuple[TcpInfo, float]], *, min_span_s: float) -> float | None:
    """The most bytes/s acknowledged over any run of busy readings at least ``min_span_s``
    long by the wall clock: what the path carried, averaged where bunched ACKs even out;
    None where the probe kept no run that long. Each reading's time was taken before its
    system call, so a run is timed from its first reading's time to the time of the reading
    after its last: never shorter than it was, however late a throttled prober ran."""
    idle = [0]  # idle[k]: untrusted readings among the first k
    for info, _ in readings:
        idle.append(idle[-1] + (not trusted(info)))
    best, j = None, 0
    for i, (first, at) in enumerate(readings):
        j = max(j, i + 1)
        while j < len(readings) and readings[j][1] - at < min_span_s:
            j += 1
        if j == len(readings):
            break
        if idle[j] == idle[i]:  # busy from reading i to reading j - 1
            rate = (readings[j - 1][0].bytes_acked - first.bytes_acked) / (readings[j][1] - at)
            best = rate if best is None else max(best, rate)
    return best


def past_slow_start(
    start: TcpInfo, readings: list[tuple[TcpInfo, float]], *, min_bytes: int, settled: int
) -> bool:
    """Whether the probe has counted ``settled`` samples since its kernel last doubled its
    window: on a far link a 1 MiB probe ends inside slow start (h1 -> h5 on topology C, 5 MB/s
    at 80 ms: samples 1.1 -> 3.9 MB/s, still climbing when it ended)."""
    ramping = [i for i, (info, _) in enumerate(readings) if info.slow_start]
    after = readings[ramping[-1] + 1 :] if ramping else readings
    base = readings[ramping[-1]][0] if ramping else start
    return len(counted_samples(base, after, min_bytes=min_bytes)) >= settled


def run_bulk(
    lane: LaneWriter,
    nbytes: int,
    timeout: float,
    config: BulkConfig | None = None,
    *,
    on_frame: Callable[[int], None] = lambda nbytes: None,
) -> WireSample | None:
    """Probe the link under ``lane`` with at least ``nbytes`` of filler (more while the kernel
    is in slow start: ``BulkConfig.extend``), all within ``timeout`` s: its figure, or None
    (the lane busy, or no trusted sample). ``on_frame`` gets each filler frame's bytes (head
    and body) once it is written whole: what the peer was sent, which is less than ``nbytes``
    when the lane was busy or a write failed. Raises what a write raises (DeadlineError,
    TransportError: the lane is then broken)."""
    config = config or BulkConfig()
    deadline = time.monotonic() + timeout
    if not lane.lock.acquire(timeout=config.lock_wait_s):
        return None
    min_bytes = max(1, nbytes // config.samples)
    try:
        start = lane.kernel_info()
        readings, sent = _write_filler(lane, start, nbytes, min_bytes, deadline, config, on_frame)
    except TcpInfoError:
        return None  # not Linux, or the lane closed under us: the stream probe measures
    finally:
        lane.lock.release()
    readings.extend(_draining(lane, start.bytes_acked + sent, deadline, config.poll_s))
    return bulk_figure(start, readings, min_bytes=min_bytes)


def _write_filler(
    lane: LaneWriter,
    start: TcpInfo,
    nbytes: int,
    min_bytes: int,
    deadline: float,
    config: BulkConfig,
    on_frame: Callable[[int], None],
) -> tuple[list[tuple[TcpInfo, float]], int]:
    """Filler frames, each small enough that the kernel is read while the probe runs (a 1 MiB
    write returns once most of it is acked: two samples, where one slow one set the figure),
    until ``nbytes`` are out and the kernel has left slow start; the readings and the sealed
    bytes sent."""
    frame_bytes = min(config.frame_bytes, max(config.min_frame_bytes, min_bytes))
    readings: list[tuple[TcpInfo, float]] = []
    sent = written = 0
    # Half the time for going on: the rest drains the queue and times its last samples.
    extend_until = time.monotonic() + (deadline - time.monotonic()) / 2
    while written < nbytes or (
        written < nbytes * config.extend
        and time.monotonic() < extend_until
        and not past_slow_start(start, readings, min_bytes=min_bytes, settled=config.settled)
    ):
        size = min(frame_bytes, nbytes - written) if written < nbytes else frame_bytes
        frame = _filler(size)
        sent += lane.write_locked(frame, deadline)
        written += size
        on_frame(len(frame[0]) + size)
        # The write read TCP_INFO for the lane's meter already: one system call a frame.
        if lane.last_reading is None:
            raise TcpInfoError("TCP_INFO was not readable after a filler frame")
        readings.append(lane.last_reading)
    return readings, sent


def _draining(
    lane: LaneWriter, acked_by: int, deadline: float, poll_s: float
) -> Iterator[tuple[TcpInfo, float]]:
    """Readings until the kernel acknowledged ``acked_by`` bytes, or the deadline."""
    while time.monotonic() < deadline:
        at = time.time()  # before the call, as every reading's (goodput)
        try:
            info = lane.kernel_info()
        except TcpInfoError:
            return
        yield info, at
        if info.bytes_acked >= acked_by:
            return
        time.sleep(poll_s)


# Filler's body: its content is never read (sealed, then dropped), so one buffer serves all
_ZEROS = memoryview(bytes(MAX_FILLER_BYTES))


def _filler(size: int) -> tuple[bytes, memoryview]:
    return encode_head(_FILLER_HEAD, size), _ZEROS[:size]
