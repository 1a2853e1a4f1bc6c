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
_FILLER_HEAD = FrameHeader(step=0, micro_batch=0, kind=FrameKind.FILLER, stage=0)


@dataclass(frozen=True, kw_only=True)
class BulkConfig:
    frame_bytes: int = 1 << 20
    lock_wait_s: float = 0.05  # a lane busy with training frames longer than this: skipped
    poll_s: float = 0.001  # how often TCP_INFO is read while the frames drain
    samples: int = 8  # a rate sample counts after nbytes // samples more bytes were acked

    def __post_init__(self) -> None:
        for name in ("frame_bytes", "samples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if self.frame_bytes > MAX_FILLER_BYTES:
            raise ConfigError(f"frame_bytes {self.frame_bytes} is over {MAX_FILLER_BYTES}")
        for name in ("lock_wait_s", "poll_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 <= value <= 10):
                raise ConfigError(f"{name} must be in [0, 10] s, got {value!r}")


def frame_sizes(nbytes: int, frame_bytes: int) -> list[int]:
    """``nbytes`` cut into filler frames of at most ``frame_bytes`` (the last one shorter)."""
    if nbytes < 1 or frame_bytes < 1:
        raise ValueError(f"nbytes and frame_bytes must be >= 1, got {nbytes}, {frame_bytes}")
    full, rest = divmod(nbytes, frame_bytes)
    return [frame_bytes] * full + ([rest] if rest else [])


def bulk_figure(
    start: TcpInfo, readings: Iterable[tuple[TcpInfo, float]], *, min_bytes: int
) -> WireSample | None:
    """The link's figure from the kernel's readings (with the wall clock they were read at)
    during a bulk probe that began at ``start``: the best but one of the trusted rate samples
    (the only one, where one was), each taken once ``min_bytes`` more were acknowledged than
    at the last one counted (a rate the kernel did not renew must not count twice); None
    where none was trusted."""
    if min_bytes < 1:
        raise ValueError(f"min_bytes must be >= 1, got {min_bytes}")
    acked, rates, rtts, last_at = start.bytes_acked, [], [], 0.0
    for info, at in readings:
        if not trusted(info) or info.bytes_acked - acked < min_bytes:
            continue
        acked, last_at = info.bytes_acked, at
        rates.append(info.delivery_rate)
        rtts.append(info.min_rtt_s)
    if not rates:
        return None
    best_but_one = sorted(rates)[-2] if len(rates) > 1 else rates[0]
    return WireSample(best_but_one, min(rtts), last_at)


def run_bulk(
    lane: LaneWriter,
    nbytes: int,
    timeout: float,
    config: BulkConfig | None = None,
    *,
    on_frame: Callable[[int], None] = lambda nbytes: None,
) -> WireSample | None:
    """Probe the link under ``lane`` with ``nbytes`` of filler, all within ``timeout`` s: its
    figure, or None (the lane busy, or no trusted sample). ``on_frame`` gets each filler
    frame's bytes (head and body) once it is written whole: what the peer was sent, which is
    less than ``nbytes`` when the lane was busy or a write failed. Raises what a write raises
    (DeadlineError, TransportError: the lane is then broken)."""
    config = config or BulkConfig()
    deadline = time.monotonic() + timeout
    if not lane.lock.acquire(timeout=config.lock_wait_s):
        return None
    readings: list[tuple[TcpInfo, float]] = []
    try:
        start = lane.kernel_info()
        sent = 0
        for size in frame_sizes(nbytes, config.frame_bytes):
            frame = _filler(size)
            sent += lane.write_locked(frame, deadline)
            on_frame(len(frame[0]) + size)
            # The write read TCP_INFO for the lane's meter already: one system call a frame.
            if lane.last_reading is None:
                raise TcpInfoError("TCP_INFO was not readable after a filler frame")
            readings.append(lane.last_reading)
    except TcpInfoError:
        return None  # not Linux, or the lane closed under us: the stream probe measures
    finally:
        lane.lock.release()
    readings.extend(_draining(lane, start.bytes_acked + sent, deadline, config.poll_s))
    return bulk_figure(start, readings, min_bytes=max(1, nbytes // config.samples))


def _draining(
    lane: LaneWriter, acked_by: int, deadline: float, poll_s: float
) -> Iterator[tuple[TcpInfo, float]]:
    """Readings until the kernel acknowledged ``acked_by`` bytes, or the deadline."""
    while time.monotonic() < deadline:
        try:
            info = lane.kernel_info()
        except TcpInfoError:
            return
        yield info, time.time()
        if info.bytes_acked >= acked_by:
            return
        time.sleep(poll_s)


# Filler's body: its content is never read (sealed, then dropped), so one buffer serves all
_ZEROS = memoryview(bytes(MAX_FILLER_BYTES))


def _filler(size: int) -> tuple[bytes, memoryview]:
    return encode_head(_FILLER_HEAD, size), _ZEROS[:size]
