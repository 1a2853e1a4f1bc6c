"""A bulk probe on a lane: filler frames back to back, timed by the kernel as they drain.

On a host whose CPU share is taken by training, the probe paced by Python (probes.py: noise
and yamux in the node's trio thread) reads a 1 Gbit/s link at 3-35 MB/s of 125 (issue 25),
and a lane's training frames (128 KiB of tiny's activations, 20 ms apart) never fill the pipe
long enough for the kernel to time it. A bulk probe writes ``nbytes`` of filler frames on the
lane (kernel-paced ``sendall``: the socket takes them as fast as the link drains) and reads
``TCP_INFO`` while they go and drain; the figure is the best but one of the kernel's rate
samples taken while data was queued (wire_meter.trusted), each after ``nbytes // samples``
more bytes were acknowledged, with the kernel's minimum RTT (bulk_figure.py). Measured
on the testbed (docs/testbed.md): 1 MiB frames back to back read 91-124 MB/s of 125 with
0-4 busy loops in the sender's 0.45-core share.

Why the kernel is read from a thread of its own (session 14): read only after each 1 MiB
write, which returns once most of the frame is acknowledged, a probe counted 2-7 samples, and
with two the best but one is the slower (h4 -> h5 on topology C read 0.48 of 1.25 MB/s from
samples of 0.48 and 1.21). Frames of an eighth gave more readings but, in a prober starved of
CPU (four busy loops in a 0.45-core share), left the socket dry between writes: a 1 Gbit/s
LAN read 1.8-40 MB/s of 125. So the frames stay 1 MiB and a poller reads ``TCP_INFO`` every
half a sample's bytes at the rate it last read (``poll_s`` to ``max_poll_s``) while they
drain (``getsockopt`` beside a blocked ``sendall``). Every 1 ms, the poller cost a 0.4-core
host that trained 30 ms of CPU a step, 0.147 -> 0.204 s steps (topology C, session 15).

Why a probe may go on: a far link's probe ended in slow start (h1 -> h5, 5 MB/s at 80 ms:
1.1 -> 3.9 MB/s), so while the kernel still doubles its window the probe writes on, up to
``extend`` times its bytes and half its time, until ``settled`` samples past slow start are
counted or its last samples stop climbing (bulk_figure.past_slow_start).

The lane is taken only if free within ``lock_wait_s`` (a training frame has the lane first);
the receiver reads filler frames within the same budgets as tensors and drops them
(lane/serve.py). Not a frame of ours, so a stream refuses it (inbound.py).
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fusionllm.common.errors import ConfigError
from fusionllm.node.p2p.framing import MAX_FILLER_BYTES, FrameHeader, FrameKind, encode_head
from fusionllm.node.p2p.lane.bulk_figure import Reading, bulk_figure, past_slow_start
from fusionllm.node.p2p.lane.stream import LaneWriter
from fusionllm.node.p2p.lane.tcp_info import TcpInfo, TcpInfoError
from fusionllm.node.p2p.lane.wire_meter import WireSample

# A stream probe's deadline too (ControlConfig.probe_timeout_s): 1 MiB at 8 Mbit/s is ~1 s.
BULK_TIMEOUT_S = 5.0
_FILLER_HEAD = FrameHeader(step=0, micro_batch=0, kind=FrameKind.FILLER, stage=0)


@dataclass(frozen=True, kw_only=True)
class BulkConfig:
    frame_bytes: int = 1 << 20
    lock_wait_s: float = 0.05  # a lane busy with training frames longer than this: skipped
    poll_s: float = 0.001  # how often TCP_INFO is read while the frames drain, at most
    max_poll_s: float = 0.02  # ... and at least
    samples: int = 8  # a rate sample counts after nbytes // samples more bytes were acked
    # A probe whose kernel still doubles its window after nbytes goes on, in frames of
    # nbytes // extend, up to extend times nbytes, until it counted ``settled`` samples past
    # slow start.
    extend: int = 4
    settled: int = 2

    def __post_init__(self) -> None:
        for name in ("frame_bytes", "samples", "extend", "settled"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if self.frame_bytes > MAX_FILLER_BYTES:
            raise ConfigError(f"frame_bytes {self.frame_bytes} is over {MAX_FILLER_BYTES}")
        for name in ("lock_wait_s", "poll_s", "max_poll_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 <= value <= 10):
                raise ConfigError(f"{name} must be in [0, 10] s, got {value!r}")


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
    poller: _Poller | None = None
    sent: int | None = None
    try:
        start = lane.kernel_info()
        poller = _Poller(lane, config, min_bytes)
        sent = _write_filler(lane, start, nbytes, min_bytes, deadline, config, on_frame, poller)
    except TcpInfoError:
        return None  # not Linux, or the lane closed under us: the stream probe measures
    finally:
        lane.lock.release()
        if poller is not None and sent is None:  # a write failed: no figure to wait for
            poller.stop()
    readings = poller.drained(start.bytes_acked + sent, deadline)
    return bulk_figure(start, readings, min_bytes=min_bytes)


def _write_filler(
    lane: LaneWriter,
    start: TcpInfo,
    nbytes: int,
    min_bytes: int,
    deadline: float,
    config: BulkConfig,
    on_frame: Callable[[int], None],
    poller: "_Poller",
) -> int:
    """Filler frames until ``nbytes`` are out and the kernel has left slow start (or the
    extension's bounds are reached); the sealed bytes sent."""
    sent = written = 0
    more = max(1, min(config.frame_bytes, nbytes // config.extend))
    # Half the time for going on: the rest drains the queue and times its last samples.
    extend_until = time.monotonic() + (deadline - time.monotonic()) / 2
    while written < nbytes or (
        written < nbytes * config.extend
        and time.monotonic() < extend_until
        and not past_slow_start(
            start, poller.readings(), min_bytes=min_bytes, settled=config.settled
        )
    ):
        size = min(config.frame_bytes, nbytes - written) if written < nbytes else more
        frame = _filler(size)
        sent += lane.write_locked(frame, deadline)
        written += size
        on_frame(len(frame[0]) + size)
        # The write read TCP_INFO for the lane's meter already: the poller keeps it too.
        if lane.last_reading is None:
            raise TcpInfoError("TCP_INFO was not readable after a filler frame")
        poller.add(lane.last_reading)
    return sent


class _Poller:
    """Reads the lane's ``TCP_INFO`` from a thread of its own, from creation until stopped
    (or the lane cannot be read), each reading timed before its call: every half of
    ``min_bytes`` at the rate the kernel last read, within the config's bounds."""

    MAX_READINGS = 20_000  # 20 s at 1 ms: past any probe's deadline

    def __init__(self, lane: LaneWriter, config: BulkConfig, min_bytes: int) -> None:
        self._lane, self._config, self._min_bytes = lane, config, min_bytes
        self._readings: list[Reading] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bulk-poll", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        low, high = self._config.poll_s, max(self._config.poll_s, self._config.max_poll_s)
        while not self._stop.is_set() and len(self._readings) < self.MAX_READINGS:
            at = time.time()
            try:
                info = self._lane.kernel_info()
            except TcpInfoError:
                return
            self._readings.append((info, at))
            rate = max(info.delivery_rate, 1.0)
            self._stop.wait(min(high, max(low, self._min_bytes / rate / 2)))

    def add(self, reading: Reading) -> None:
        self._readings.append(reading)

    def readings(self) -> list[Reading]:
        return list(self._readings)  # one operation: a copy safe beside the appending thread

    def stop(self) -> list[Reading]:
        self._stop.set()
        self._thread.join()
        return self.readings()

    def drained(self, acked_by: int, deadline: float) -> list[Reading]:
        """The readings once the kernel acknowledged ``acked_by`` bytes, or at the deadline
        (or once the lane cannot be read), the poller stopped."""
        while time.monotonic() < deadline and self._thread.is_alive():
            last = self._readings[-1][0] if self._readings else None
            if last is not None and last.bytes_acked >= acked_by:
                break
            time.sleep(max(self._config.max_poll_s, 0.001))  # the poller's readings decide
        return self.stop()


# Filler's body: its content is never read (sealed, then dropped), so one buffer serves all
_ZEROS = memoryview(bytes(MAX_FILLER_BYTES))


def _filler(size: int) -> tuple[bytes, memoryview]:
    return encode_head(_FILLER_HEAD, size), _ZEROS[:size]
